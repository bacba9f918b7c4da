// The softmax Jacobian's semiring formula for MaxProduct and Boolean in one pass over the
// rows, as CPU operators:
//
//   softmax_backward_max(g, p)             MaxProduct's message at softmax's input from g at
//                                          its output p
//   softmax_backward_or(g, p)              Boolean's, g a bool message and p the probabilities
//   softmax_backward_signed(g_hi, g_lo, p)  SignedMaxProduct's, g a (hi, lo) pair
//
// The formula (Semiring.softmax_backward) is out_i = g_i ⊗ lift(p_i(1 − p_i)) ⊕
// (⊕_{j≠i} g_j ⊗ lift(p_j)) ⊗ lift(−p_i); in torch it takes a dozen passes over the rows
// and their temporaries, here each row of n entries is read once and its leave-one-out ⊕
// works on a scratch row in L1. Every entry is the formula's own operations in its order
// (products and comparisons; no addition follows a product, so nothing contracts to an
// FMA): the results are the formula's to the bit, but for the sign of a zero where +0 and
// −0 tie for a row's largest term (the same value; which one torch's max keeps is its own). Operands: contiguous, of one shape; g
// and p float32 or float64 of one dtype (max, signed), or g bool and p float32/float64
// (or). The Python wrappers (extreme_entries.py) check that and take the torch formula
// otherwise, and where the signed kernel declines a row holding NaN.
//
// Part of semiring_autograd; included by operators.cpp after log_entries.h, whose
// threads_for and check_entries these use.

#pragma once

#include <ATen/ATen.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace extreme_entries {

// torch.maximum's value: NaN where either operand is NaN, else the larger.
template <typename T>
inline T max_nan(T x, T y) {
    return (x > y || x != x) ? x : y;
}

// torch.minimum's value: NaN where either operand is NaN, else the smaller.
template <typename T>
inline T min_nan(T x, T y) {
    return (x < y || x != x) ? x : y;
}

// Whether some of x[0, n) is NaN, given `spread`, the sum of x_j − x_j over them: 0 where
// every x_j is finite (a sum that vectorises, where a flag does not), else a scan.
template <typename T>
inline bool any_nan(const T* x, int64_t n, T spread) {
    if (spread == T(0)) return false;
    for (int64_t j = 0; j < n; ++j)
        if (x[j] != x[j]) return true;
    return false;
}

// t_j = g_j·|p_j| into t; whether some t_j is NaN.
template <typename T>
inline bool terms_row(const T* g, const T* p, T* t, int64_t n) {
    T spread = T(0);
#pragma omp simd reduction(+ : spread)
    for (int64_t j = 0; j < n; ++j) {
        t[j] = g[j] * std::fabs(p[j]);
        spread += t[j] - t[j];
    }
    return any_nan(t, n, spread);
}

// The largest of t[0, n) (n ≥ 2, no NaN), the first position holding it, and the largest
// of the others: the max and the max of the rest of loo_max.
template <typename T>
inline void top_two_row(const T* t, int64_t n, T& first, int64_t& at, T& second) {
    T top = -T(__builtin_inf());
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) top = t[j] > top ? t[j] : top;
    int64_t k = 0;
    while (t[k] != top) ++k;
    T rest = -T(__builtin_inf());
#pragma omp simd reduction(max : rest)
    for (int64_t j = 0; j < n; ++j) rest = (j != k && t[j] > rest) ? t[j] : rest;
    first = top, at = k, second = rest;
}

// MaxProduct's message at softmax's input, one row: with t_j = g_j·|p_j| and L_i =
// max_{j≠i} t_j (0 for a one-entry row, loo_max's empty), out_i = max(g_i·|p_i(1 − p_i)|,
// L_i·|−p_i|) with torch.maximum's NaN. A NaN t_k makes the formula's row all NaN: torch's
// max then gives L_i = NaN for i ≠ k, and t_k = g_k·|p_k| is NaN only where g_k·|p_k(1 −
// p_k)| is (a NaN factor, ∞·0, or 0·∞).
template <typename T>
inline void softmax_max_row(const T* g, const T* p, T* out, T* t, int64_t n) {
    if (terms_row(g, p, t, n)) {
        std::fill(out, out + n, std::numeric_limits<T>::quiet_NaN());
        return;
    }
    T first = T(0), second = T(0);
    int64_t at = 0;
    if (n > 1) top_two_row(t, n, first, at, second);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
        out[i] = max_nan(g[i] * std::fabs(p[i] * (T(1) - p[i])), first * std::fabs(-p[i]));
    if (n > 1)
        out[at] = max_nan(g[at] * std::fabs(p[at] * (T(1) - p[at])), second * std::fabs(-p[at]));
}

// softmax_max_row along rows of n contiguous entries.
template <typename T>
void softmax_backward_max_rows(const T* g, const T* p, T* out, int64_t n, int64_t rows,
                               int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> scratch(n);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; ++row)
            softmax_max_row(g + row * n, p + row * n, out + row * n, scratch.data(), n);
    }
}

// Boolean's message at softmax's input, along rows of n contiguous entries: with t_j = g_j ∧
// (p_j ≠ 0) and c the row's count of true t_j, out_i = (g_i ∧ p_i(1 − p_i) ≠ 0) ∨
// (c − t_i > 0 ∧ −p_i ≠ 0) (Boolean.loo's count; a NaN p is a non-zero derivative). c − t_i
// > 0 is c ≥ 2, or c = 1 and not t_i. Bools are read and written as bytes 0 and 1.
template <typename T>
void softmax_backward_or_rows(const uint8_t* g, const T* p, uint8_t* out, int64_t n,
                              int64_t rows, int threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < rows; ++row) {
        const uint8_t* gr = g + row * n;
        const T* pr = p + row * n;
        uint8_t* o = out + row * n;
        int64_t count = 0;
#pragma omp simd reduction(+ : count)
        for (int64_t j = 0; j < n; ++j) count += gr[j] & uint8_t(pr[j] != T(0));
        const int many = count > 1, one = count == 1;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const int g_i = gr[i], live = pr[i] != T(0);  // -p_i ≠ 0 too
            const int own = g_i & int(pr[i] * (T(1) - pr[i]) != T(0));
            const int others = many | (one & ((g_i & live) ^ 1));
            o[i] = uint8_t(own | (others & live));
        }
    }
}

// The two ends of x ⊗ lift(w) for a signed pair x = (h, l) (SignedMaxProduct.mul_lift):
// w > 0 keeps the order, w < 0 swaps it, w = 0 is no edge (-inf, +inf) unless h or l is
// NaN. Plain values, not a struct: a struct keeps GCC from vectorising the loops.
template <typename T>
inline T lift_hi(T h, T l, T w) {
    const bool none = (w == T(0)) & (h == h) & (l == l);
    return none ? -T(__builtin_inf()) : (w > T(0) ? h : l) * w;
}

template <typename T>
inline T lift_lo(T h, T l, T w) {
    const bool none = (w == T(0)) & (h == h) & (l == l);
    return none ? T(__builtin_inf()) : (w > T(0) ? l : h) * w;
}

// SignedMaxProduct's message at softmax's input, one row: with t_j = g_j ⊗ lift(p_j) and
// (H_i, L_i) = (max_{j≠i} t_j.hi, −max_{j≠i} −t_j.lo) (loo's (-inf, +inf) for a one-entry
// row), out_i = g_i ⊗ lift(p_i(1 − p_i)) ⊕ (H_i, L_i) ⊗ lift(−p_i), ⊕ = (torch.maximum,
// torch.minimum). Returns false, out unwritten, where t holds NaN.
template <typename T>
inline bool softmax_signed_row(const T* gh, const T* gl, const T* p, T* oh, T* ol, T* th,
                               T* tl, int64_t n) {
    T spread = T(0);
#pragma omp simd reduction(+ : spread)
    for (int64_t j = 0; j < n; ++j) {
        const T h = lift_hi(gh[j], gl[j], p[j]), l = lift_lo(gh[j], gl[j], p[j]);
        th[j] = h, tl[j] = -l;
        spread += (h - h) + (l - l);
    }
    if (any_nan(th, n, spread) || any_nan(tl, n, spread)) return false;
    T first_h = -T(__builtin_inf()), second_h = first_h, first_l = first_h, second_l = first_h;
    int64_t at_h = 0, at_l = 0;
    if (n > 1) {
        top_two_row(th, n, first_h, at_h, second_h);
        top_two_row(tl, n, first_l, at_l, second_l);
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const T w = p[i] * (T(1) - p[i]);
        oh[i] = max_nan(lift_hi(gh[i], gl[i], w), lift_hi(first_h, -first_l, -p[i]));
        ol[i] = min_nan(lift_lo(gh[i], gl[i], w), lift_lo(first_h, -first_l, -p[i]));
    }
    for (int64_t i : {at_h, at_l}) {
        if (n < 2) break;
        const T w = p[i] * (T(1) - p[i]);
        const T h = i == at_h ? second_h : first_h, l = -(i == at_l ? second_l : first_l);
        oh[i] = max_nan(lift_hi(gh[i], gl[i], w), lift_hi(h, l, -p[i]));
        ol[i] = min_nan(lift_lo(gh[i], gl[i], w), lift_lo(h, l, -p[i]));
    }
    return true;
}

// softmax_signed_row along rows of n contiguous entries; bad[row] = 1 where a row was left
// uncomputed, else 0.
template <typename T>
void softmax_backward_signed_rows(const T* gh, const T* gl, const T* p, T* oh, T* ol,
                                  uint8_t* bad, int64_t n, int64_t rows, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> scratch(2 * n);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
            const int64_t at = row * n;
            bad[row] = !softmax_signed_row(gh + at, gl + at, p + at, oh + at, ol + at,
                                           scratch.data(), scratch.data() + n, n);
        }
    }
}

// softmax_backward_max_rows along the last dim of g and p (contiguous, of one shape and
// dtype, float32 or float64).
inline at::Tensor softmax_backward_max_op(const at::Tensor& g, const at::Tensor& p) {
    log_entries::check_entries("softmax_backward_max", g, p);
    TORCH_CHECK(g.dim() >= 1, "softmax_backward_max: g and p must have a dim to work along");
    const int64_t n = g.size(-1), rows = n ? g.numel() / n : 0;
    return log_entries::entries(g, [&](auto tag, at::Tensor& o, int64_t count, int) {
        using T = std::remove_pointer_t<decltype(tag)>;
        softmax_backward_max_rows<T>(g.const_data_ptr<T>(), p.const_data_ptr<T>(),
                                     o.data_ptr<T>(), n, rows, log_entries::threads_for(4 * count));
    });
}

// (hi, lo, declined): softmax_backward_signed_rows along the last dim of g_hi, g_lo and p
// (contiguous, of one shape and dtype, float32 or float64); declined (0-d bool) true when a
// row was left uncomputed (the caller's torch formula then handles every row).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_backward_signed_op(
    const at::Tensor& g_hi, const at::Tensor& g_lo, const at::Tensor& p) {
    log_entries::check_entries("softmax_backward_signed", g_hi, p);
    log_entries::check_entries("softmax_backward_signed", g_lo, p);
    TORCH_CHECK(p.dim() >= 1, "softmax_backward_signed: g and p must have a dim to work along");
    const int64_t n = p.size(-1), rows = n ? p.numel() / n : 0;
    auto bad = at::zeros({rows}, p.options().dtype(at::kByte));
    auto lo = at::empty_like(g_lo, at::MemoryFormat::Contiguous);
    auto hi = log_entries::entries(g_hi, [&](auto tag, at::Tensor& o, int64_t count, int) {
        using T = std::remove_pointer_t<decltype(tag)>;
        softmax_backward_signed_rows<T>(g_hi.const_data_ptr<T>(), g_lo.const_data_ptr<T>(),
                                        p.const_data_ptr<T>(), o.data_ptr<T>(), lo.data_ptr<T>(),
                                        bad.data_ptr<uint8_t>(), n, rows,
                                        log_entries::threads_for(8 * count));
    });
    return {hi, lo, bad.any().to(at::kBool)};
}

// A bool tensor's storage as bytes (0 or 1 each): read-only, and to write.
inline const uint8_t* read_bytes(const at::Tensor& b) {
    return reinterpret_cast<const uint8_t*>(b.const_data_ptr<bool>());
}
inline uint8_t* write_bytes(at::Tensor& b) {
    return reinterpret_cast<uint8_t*>(b.data_ptr<bool>());
}

// softmax_backward_or_rows along the last dim of g (bool) and p (float32 or float64), both
// contiguous and of one shape.
inline at::Tensor softmax_backward_or_op(const at::Tensor& g, const at::Tensor& p) {
    TORCH_CHECK(g.is_contiguous() && p.is_contiguous() && g.sizes() == p.sizes() &&
                    g.scalar_type() == at::kBool &&
                    (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble),
                "softmax_backward_or: g (bool) and p (float32 or float64) contiguous, of one "
                "shape, got ",
                g.sizes(), " ", g.scalar_type(), " and ", p.sizes(), " ", p.scalar_type());
    TORCH_CHECK(g.dim() >= 1, "softmax_backward_or: g and p must have a dim to work along");
    const int64_t n = g.size(-1), rows = n ? g.numel() / n : 0;
    auto out = at::empty_like(g, at::MemoryFormat::Contiguous);
    const int threads = log_entries::threads_for(2 * g.numel());
    if (p.scalar_type() == at::kDouble)
        softmax_backward_or_rows<double>(read_bytes(g), p.const_data_ptr<double>(),
                                         write_bytes(out), n, rows, threads);
    else
        softmax_backward_or_rows<float>(read_bytes(g), p.const_data_ptr<float>(),
                                        write_bytes(out), n, rows, threads);
    return out;
}

}  // namespace extreme_entries
