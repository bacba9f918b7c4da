// Layer norm's composition (primitives.standardize) for MaxProduct, Log and Entropy in one
// operator call each, along contiguous rows, as CPU operators:
//
//   standardize_max(a, c, s)        MaxProduct's message at x from a at n = c·s
//   standardize_log(a, c, s)        Log's
//   entropy_standardize(la, r, c, s)  Entropy's, a the pair (log Z, r)
//
// The composition, per row of n entries with c = x − μ and s = (mean(c²) + eps)^(−1/2) (one
// s per row): g_s = ⊕_j a_j ⊗ lift(c_j); g_v = g_s ⊗ lift(−s³/2); g_c,j = a_j ⊗ lift(s) ⊕
// g_v ⊗ lift(2c_j/n); g_μ = ⊕_j g_c,j ⊗ lift(−1); out_j = g_c,j ⊕ g_μ ⊗ lift(1/n). In torch
// it takes about fifteen passes over the rows and their temporaries; here a row is read
// from memory once and its three sweeps (g_s; g_c and g_μ; out) run over it in L1. Each
// local derivative is computed with torch's operations in the composition's order (s·s·s,
// then −0.5·; 2·c, then / n; 1/n rounded once from double), so MaxProduct's results are the
// composition's to the bit (products and maxima only; torch.maximum's and amax's NaN
// propagate); Log's and Entropy's logs and exponentials are the series of extreme_matmul.h
// (within a few ulp of torch's). Log and Entropy decline (bad[row] = 1, the row left
// uncomputed) a row whose terms hold NaN or +inf, whose s is not finite and positive, or
// (Entropy) whose r holds an entry that is not finite; -inf (no path) is an ordinary value
// there. Operands: a (and r) and c contiguous, of one
// shape; s contiguous with one entry per row; one dtype, float32 or float64. The Python
// wrappers check that and take the composition otherwise, and for every row where a row
// was declined.
//
// Part of semiring_autograd; included by operators.cpp after extreme_matmul.h,
// log_entries.h and extreme_entries.h, whose log_positive, log_abs_entry, exp_nonpositive,
// log_add_entry, entropy_add_entry, threads_for, check_entries and max_nan these use.

#pragma once

#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace standardize {

// The local derivatives of one row's composition that do not vary along the row, as
// message values (products and logs taken as torch takes them).
template <typename T>
struct RowWeights {
    T s;        // c → n: s
    T v;        // v → s: −0.5·s³
    T n;        // c → v weighs (2·c_j) / n
    T inverse;  // μ → c → x: 1/n, rounded once from double
};

template <typename T>
inline RowWeights<T> row_weights(T s, int64_t n) {
    return {s, T(-0.5) * (s * s * s), T(n), T(1.0 / double(n))};
}

// MaxProduct along one row: ⊕ is max (NaN kept, as torch.maximum's and amax's), ⊗ by
// lift(w) is ·|w|. The maxima are taken apart from the NaN flags so that the loops
// vectorise.
template <typename T>
void max_row(const T* a, const T* c, T s, T* out, int64_t n) {
    const RowWeights<T> w = row_weights(s, n);
    const T nan = std::numeric_limits<T>::quiet_NaN();
    T g_s = -std::numeric_limits<T>::infinity();
    int any_nan = 0;
#pragma omp simd reduction(max : g_s) reduction(| : any_nan)
    for (int64_t j = 0; j < n; ++j) {  // amax of a·|c|
        const T t = a[j] * std::fabs(c[j]);
        any_nan |= t != t;
        g_s = std::max(g_s, t);
    }
    if (any_nan) g_s = nan;
    const T g_v = g_s * std::fabs(w.v), own = std::fabs(w.s);
    T g_mu = -std::numeric_limits<T>::infinity();
    int mu_nan = 0;
#pragma omp simd reduction(max : g_mu) reduction(| : mu_nan)
    for (int64_t j = 0; j < n; ++j) {
        const T through = g_v * std::fabs((T(2) * c[j]) / w.n);
        const T g_c = extreme_entries::max_nan(a[j] * own, through);
        out[j] = g_c;
        mu_nan |= g_c != g_c;
        g_mu = std::max(g_mu, g_c);
    }
    if (mu_nan) g_mu = nan;
    const T back = (g_mu * std::fabs(T(-1))) * std::fabs(w.inverse);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = extreme_entries::max_nan(out[j], back);
}

// log Σ_j e^{x_j} over a row whose entries are finite or -inf (the largest taken out
// first, as torch.logsumexp does), and, given r, Σ_j e^{x_j − L} r_j (Entropy's Z-weighted
// mean; 0 where every x_j is -inf).
template <typename T>
inline T log_sum_row(const T* x, const T* r, int64_t n, T* mean) {
    const T inf = std::numeric_limits<T>::infinity();
    T top = -inf;
    for (int64_t j = 0; j < n; ++j) top = x[j] > top ? x[j] : top;
    if (top == -inf) {
        if (mean) *mean = T(0);
        return -inf;
    }
    T sum = T(0), weighted = T(0);
    if (r) {
#pragma omp simd reduction(+ : sum, weighted)
        for (int64_t j = 0; j < n; ++j) {
            const T e = exp_nonpositive(x[j] - top);
            sum += e;
            weighted += e * r[j];
        }
        *mean = weighted / sum;
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) sum += exp_nonpositive(x[j] - top);
    }
    return top + log_positive(sum);
}

// Whether entries [0, n) are all at most `high` and at least `low` (NaN is neither).
template <typename T>
inline bool within(const T* x, int64_t n, T low, T high) {
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t j = 0; j < n; ++j) bad |= !(x[j] >= low && x[j] <= high);
    return !bad;
}

// Log (r null) or Entropy (r the rows' second components, out_r its results) along one
// row; scratch holds 2n entries. Returns false, the row left uncomputed, where a term is NaN
// or +inf, an r entry is not finite, or s is not finite and positive.
template <typename T>
bool log_row(const T* a, const T* r, const T* c, T s, T* out, T* out_r, T* scratch,
             int64_t n) {
    const T inf = std::numeric_limits<T>::infinity(), largest = std::numeric_limits<T>::max();
    if (!(s > T(0) && s <= largest)) return false;
    if (r && !within(r, n, -largest, largest)) return false;
    const RowWeights<T> w = row_weights(s, n);
    T* t = scratch;
    T* t_r = scratch + n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {  // a ⊗ lift(c)
        const T l = log_abs_entry(c[j]);
        t[j] = a[j] + l;
        if (r) t_r[j] = t[j] == -inf ? T(0) : r[j] - l;
    }
    if (!within(t, n, -inf, largest)) return false;
    T g_s_r = T(0);
    const T g_s = log_sum_row(t, r ? t_r : nullptr, n, &g_s_r);
    const T log_v = log_abs_entry(w.v), log_s = log_abs_entry(w.s);
    const T g_v = g_s + log_v, g_v_r = g_v == -inf ? T(0) : g_s_r - log_v;
    // g_c into out (and out_r); a is finite or -inf where t is
    for (int64_t j = 0; j < n; ++j) {
        const T l2 = log_abs_entry((T(2) * c[j]) / w.n);
        const T own = a[j] + log_s, through = g_v + l2;
        if (r) {
            const T own_r = own == -inf ? T(0) : r[j] - log_s;
            const T through_r = through == -inf ? T(0) : g_v_r - l2;
            entropy_add_entry(own, own_r, through, through_r, out + j, out_r + j);
        } else {
            out[j] = log_entries::log_add_entry(own, through);
        }
    }
    if (!within(out, n, -inf, largest)) return false;
    T g_mu_r = T(0);
    const T g_mu = log_sum_row(out, r ? out_r : nullptr, n, &g_mu_r);  // ⊗ lift(−1): + 0
    const T log_inverse = log_abs_entry(w.inverse);
    const T back = g_mu + log_inverse, back_r = back == -inf ? T(0) : g_mu_r - log_inverse;
    for (int64_t j = 0; j < n; ++j) {
        if (r)
            entropy_add_entry(out[j], out_r[j], back, back_r, out + j, out_r + j);
        else
            out[j] = log_entries::log_add_entry(out[j], back);
    }
    return true;
}

#if defined(__AVX512F__)
// log_row for float, 16 entries at a time (the scalar entry functions on a row's tail).
inline float log_sum_row16(const float* x, const float* r, int64_t n, float top, float* mean) {
    if (top == -__builtin_inff()) {
        *mean = 0.0f;
        return top;
    }
    const int64_t body = n / 16 * 16;
    const __m512 shift = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps(), weighted = _mm512_setzero_ps();
    for (int64_t j = 0; j < body; j += 16) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + j), shift));
        sum = _mm512_add_ps(sum, e);
        if (r) weighted = _mm512_fmadd_ps(e, _mm512_loadu_ps(r + j), weighted);
    }
    float total = _mm512_reduce_add_ps(sum), total_r = _mm512_reduce_add_ps(weighted);
    for (int64_t j = body; j < n; ++j) {
        const float e = exp_nonpositive(x[j] - top);
        total += e;
        if (r) total_r += e * r[j];
    }
    *mean = total_r / total;
    return top + log_positive(total);
}

// (la, r) ⊗ lift(w) given log|w| = l, 16 lanes: (la + l, r − l), r 0 where la + l is -inf.
struct Pair16 {
    __m512 l, r;
};

inline Pair16 times16(__m512 la, __m512 r, __m512 l) {
    const __m512 sum = _mm512_add_ps(la, l);
    const __mmask16 path = _mm512_cmp_ps_mask(sum, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ);
    return {sum, _mm512_maskz_mov_ps(path, _mm512_sub_ps(r, l))};
}

// x ⊕ y of Log (r null: only .l) or Entropy, 16 lanes (entropy_add's vector form).
inline Pair16 add16(Pair16 x, Pair16 y, bool entropy) {
    const LogAdd16 s = log_add16(x.l, y.l);
    if (!entropy) return {s.sum, s.sum};
    const __m512 r_big = _mm512_mask_blend_ps(s.x_big, y.r, x.r);
    const __m512 r_small = _mm512_mask_blend_ps(s.x_big, x.r, y.r);
    const __m512 mean = _mm512_div_ps(_mm512_fmadd_ps(s.t, r_small, r_big), s.u);
    const __mmask16 path = _mm512_cmp_ps_mask(s.sum, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ);
    return {s.sum, _mm512_maskz_mov_ps(path, mean)};
}

// Whether some lane is NaN or above the largest float.
inline __mmask16 above16(__m512 x) {
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
}

inline bool log_row16(const float* a, const float* r, const float* c, float s, float* out,
                      float* out_r, float* scratch, int64_t n) {
    const float inf = __builtin_inff(), largest = std::numeric_limits<float>::max();
    if (!(s > 0.0f && s <= largest)) return false;
    if (r && !within(r, n, -largest, largest)) return false;
    const bool entropy = r != nullptr;
    const RowWeights<float> w = row_weights(s, n);
    float* t = scratch;
    float* t_r = scratch + n;
    const int64_t body = n / 16 * 16;
    const __m512 zero = _mm512_setzero_ps();
    __m512 top = _mm512_set1_ps(-inf);
    __mmask16 bad = 0;
    for (int64_t j = 0; j < body; j += 16) {  // a ⊗ lift(c)
        const Pair16 x = times16(_mm512_loadu_ps(a + j), entropy ? _mm512_loadu_ps(r + j) : zero,
                                 log_abs16(_mm512_loadu_ps(c + j)));
        _mm512_storeu_ps(t + j, x.l);
        if (entropy) _mm512_storeu_ps(t_r + j, x.r);
        bad |= above16(x.l);
        top = _mm512_max_ps(top, x.l);
    }
    float top_t = _mm512_reduce_max_ps(top);
    for (int64_t j = body; j < n; ++j) {
        const float l = log_abs_entry(c[j]);
        t[j] = a[j] + l;
        if (entropy) t_r[j] = t[j] == -inf ? 0.0f : r[j] - l;
        if (!(t[j] <= largest)) return false;
        top_t = std::max(top_t, t[j]);
    }
    if (bad) return false;
    float g_s_r = 0.0f;
    const float g_s = log_sum_row16(t, entropy ? t_r : nullptr, n, top_t, &g_s_r);
    const float log_v = log_abs_entry(w.v), log_s = log_abs_entry(w.s);
    const float g_v = g_s + log_v, g_v_r = g_v == -inf ? 0.0f : g_s_r - log_v;
    const __m512 two = _mm512_set1_ps(2.0f), count = _mm512_set1_ps(w.n);
    top = _mm512_set1_ps(-inf);
    for (int64_t j = 0; j < body; j += 16) {  // g_c = a ⊗ lift(s) ⊕ g_v ⊗ lift(2c/n)
        const __m512 l2 = log_abs16(_mm512_div_ps(_mm512_mul_ps(two, _mm512_loadu_ps(c + j)), count));
        const Pair16 own = times16(_mm512_loadu_ps(a + j), entropy ? _mm512_loadu_ps(r + j) : zero,
                                   _mm512_set1_ps(log_s));
        const Pair16 through = times16(_mm512_set1_ps(g_v), _mm512_set1_ps(g_v_r), l2);
        const Pair16 g_c = add16(own, through, entropy);
        _mm512_storeu_ps(out + j, g_c.l);
        if (entropy) _mm512_storeu_ps(out_r + j, g_c.r);
        bad |= above16(g_c.l);
        top = _mm512_max_ps(top, g_c.l);
    }
    float top_c = _mm512_reduce_max_ps(top);
    for (int64_t j = body; j < n; ++j) {
        const float l2 = log_abs_entry((2.0f * c[j]) / w.n);
        const float own = a[j] + log_s, through = g_v + l2;
        if (entropy) {
            const float own_r = own == -inf ? 0.0f : r[j] - log_s;
            const float through_r = through == -inf ? 0.0f : g_v_r - l2;
            entropy_add_entry(own, own_r, through, through_r, out + j, out_r + j);
        } else {
            out[j] = log_entries::log_add_entry(own, through);
        }
        if (!(out[j] <= largest)) return false;
        top_c = std::max(top_c, out[j]);
    }
    if (bad) return false;
    float g_mu_r = 0.0f;
    const float g_mu = log_sum_row16(out, entropy ? out_r : nullptr, n, top_c, &g_mu_r);
    const float log_inverse = log_abs_entry(w.inverse);
    const float back = g_mu + log_inverse, back_r = back == -inf ? 0.0f : g_mu_r - log_inverse;
    const Pair16 b = {_mm512_set1_ps(back), _mm512_set1_ps(back_r)};
    for (int64_t j = 0; j < body; j += 16) {  // out = g_c ⊕ g_μ ⊗ lift(1/n)
        const Pair16 x = {_mm512_loadu_ps(out + j), entropy ? _mm512_loadu_ps(out_r + j) : zero};
        const Pair16 sum = add16(x, b, entropy);
        _mm512_storeu_ps(out + j, sum.l);
        if (entropy) _mm512_storeu_ps(out_r + j, sum.r);
    }
    for (int64_t j = body; j < n; ++j) {
        if (entropy)
            entropy_add_entry(out[j], out_r[j], back, back_r, out + j, out_r + j);
        else
            out[j] = log_entries::log_add_entry(out[j], back);
    }
    return true;
}
#endif

// Rows of n contiguous entries, split over `threads`.
template <typename T>
void max_rows(const T* a, const T* c, const T* s, T* out, int64_t n, int64_t rows,
              int threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < rows; ++row)
        max_row(a + row * n, c + row * n, s[row], out + row * n, n);
}

template <typename T>
void log_rows(const T* a, const T* r, const T* c, const T* s, T* out, T* out_r, uint8_t* bad,
              int64_t n, int64_t rows, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> scratch(2 * n);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
            const int64_t at = row * n;
            const T* rr = r ? r + at : nullptr;
            T* orr = out_r ? out_r + at : nullptr;
#if defined(__AVX512F__)
            if constexpr (std::is_same_v<T, float>) {
                bad[row] = !log_row16(a + at, rr, c + at, s[row], out + at, orr, scratch.data(), n);
                continue;
            }
#endif
            bad[row] = !log_row(a + at, rr, c + at, s[row], out + at, orr, scratch.data(), n);
        }
    }
}

// a (and r) and c contiguous of one shape (…, n), s contiguous with one entry per row, one
// float dtype
inline int64_t check_rows(const char* name, const at::Tensor& a, const at::Tensor& c,
                          const at::Tensor& s) {
    log_entries::check_entries(name, a, c);
    TORCH_CHECK(a.dim() >= 1 && a.size(-1) > 0, name, ": rows must not be empty, got ",
                a.sizes());
    const int64_t rows = a.numel() / a.size(-1);
    TORCH_CHECK(s.is_contiguous() && s.numel() == rows && s.scalar_type() == a.scalar_type(),
                name, ": s must hold one entry per row of a (", rows, ") in a's dtype, got ",
                s.sizes(), " ", s.scalar_type());
    return rows;
}

inline at::Tensor standardize_max_op(const at::Tensor& a, const at::Tensor& c,
                                     const at::Tensor& s) {
    const int64_t rows = check_rows("standardize_max", a, c, s), n = a.size(-1);
    auto out = at::empty_like(a);
    auto run = [&](auto tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        max_rows<T>(a.const_data_ptr<T>(), c.const_data_ptr<T>(), s.const_data_ptr<T>(),
                    out.data_ptr<T>(), n, rows, log_entries::threads_for(4 * a.numel()));
    };
    if (a.scalar_type() == at::kDouble) run(static_cast<double*>(nullptr));
    else run(static_cast<float*>(nullptr));
    return out;
}

// (out, out_r, declined): Entropy given r, else Log (out_r empty); declined (0-d bool) true
// when a row was left uncomputed.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> log_space_op(
    const char* name, const at::Tensor& a, const std::optional<at::Tensor>& r,
    const at::Tensor& c, const at::Tensor& s) {
    const int64_t rows = check_rows(name, a, c, s), n = a.size(-1);
    if (r) log_entries::check_entries(name, *r, a);
    auto out = at::empty_like(a);
    auto out_r = r ? at::empty_like(a) : at::empty({0}, a.options());
    std::vector<uint8_t> bad(rows);
    auto run = [&](auto tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        log_rows<T>(a.const_data_ptr<T>(), r ? r->const_data_ptr<T>() : nullptr,
                    c.const_data_ptr<T>(), s.const_data_ptr<T>(), out.data_ptr<T>(),
                    r ? out_r.data_ptr<T>() : nullptr, bad.data(), n, rows,
                    log_entries::threads_for(16 * a.numel()));
    };
    if (a.scalar_type() == at::kDouble) run(static_cast<double*>(nullptr));
    else run(static_cast<float*>(nullptr));
    const bool declined = std::any_of(bad.begin(), bad.end(), [](uint8_t b) { return b != 0; });
    return {out, out_r, at::scalar_tensor(declined, a.options().dtype(at::kBool))};
}

inline std::tuple<at::Tensor, at::Tensor> standardize_log_op(const at::Tensor& a,
                                                             const at::Tensor& c,
                                                             const at::Tensor& s) {
    auto [out, unused, declined] = log_space_op("standardize_log", a, std::nullopt, c, s);
    return {out, declined};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_standardize_op(
    const at::Tensor& la, const at::Tensor& r, const at::Tensor& c, const at::Tensor& s) {
    return log_space_op("entropy_standardize", la, r, c, s);
}

}  // namespace standardize
