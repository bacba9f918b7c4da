// The softmax Jacobian's semiring formula for MaxProduct and Boolean in one pass over the
// rows, as CPU operators:
//
//   softmax_backward_max(g, p)  MaxProduct's message at softmax's input from g at its output p
//   softmax_backward_or(g, p)   Boolean's, g a bool message and p the probabilities
//
// The formula (Semiring.softmax_backward) is out_i = g_i ⊗ lift(p_i(1 − p_i)) ⊕
// (⊕_{j≠i} g_j ⊗ lift(p_j)) ⊗ lift(−p_i); in torch it takes a dozen passes over the rows
// and their temporaries, here each row of n entries is read once and its leave-one-out ⊕
// works on a scratch row in L1. Every entry is the formula's own operations in its order
// (products and comparisons; no addition follows a product, so nothing contracts to an
// FMA): the results are the formula's to the bit. Operands: contiguous, of one shape; g
// and p float32 or float64 of one dtype (max), or g bool and p float32/float64 (or). The
// Python wrappers (extreme_entries.py) check that and take the torch formula otherwise.
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

// t_j = g_j·|p_j| into t; whether some t_j is NaN.
template <typename T>
inline bool terms_row(const T* g, const T* p, T* t, int64_t n) {
    bool nan = false;
#pragma omp simd reduction(| : nan)
    for (int64_t j = 0; j < n; ++j) {
        t[j] = g[j] * std::fabs(p[j]);
        nan |= t[j] != t[j];
    }
    return nan;
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
        const uint8_t many = count > 1, one = count == 1;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t live = pr[i] != T(0);  // -p_i ≠ 0 too
            const uint8_t own = gr[i] & uint8_t(pr[i] * (T(1) - pr[i]) != T(0));
            const uint8_t others = many | (one & uint8_t(!(gr[i] & live)));
            o[i] = own | (others & live);
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

// A bool tensor's storage as bytes (0 or 1 each).
inline uint8_t* bytes(const at::Tensor& b) {
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
        softmax_backward_or_rows<double>(bytes(g), p.const_data_ptr<double>(), bytes(out), n,
                                         rows, threads);
    else
        softmax_backward_or_rows<float>(bytes(g), p.const_data_ptr<float>(), bytes(out), n,
                                        rows, threads);
    return out;
}

}  // namespace extreme_entries
