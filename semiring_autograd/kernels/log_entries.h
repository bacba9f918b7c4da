// The Log semiring's elementwise primitives in one pass each, as CPU operators:
//
//   plus_log_abs(a, w)          a + log|w| (a ⊗ lift(w)), or log|w| alone (lift(w)) without a
//   log_add(a, b)               log(e^a + e^b) (a ⊕ b), torch.logaddexp's specials
//   log_add_rows_(out, a, b)    the same over rows with strides between them, out may be a
//   softmax_backward_log(g, p)  the message at softmax's input from g at its output p, per row
//   log_plus_shifts_            z = log z + shift (+ shift_b) in place, for log_gemm_finish_
//   log_space_columns(a, r)     log_space_rows along the columns of a transposed message
//
// torch spells the first as three passes (abs, log, add) with two temporaries, and its
// log and logaddexp take several times the time of these loops on AVX-512 (log_abs16 and
// exp16_nonpositive of extreme_matmul.h, 16 floats at a time); the softmax Jacobian's
// semiring formula takes about a dozen passes over the rows. Operands: contiguous, of one
// shape and one dtype (float32 or float64), but log_space_columns' (strided along k and
// batch, unit stride along m) and log_add_rows_' (unit stride along rows); the Python wrappers (log_entries.py) check that and take the
// torch formulas otherwise, and log_gemm_finish_ takes torch's log and additions where
// log_plus_shifts_ declines its operands.
//
// Part of semiring_autograd; included by operators.cpp after extreme_matmul.h, whose
// log_positive, log_abs_entry, exp_nonpositive, log_abs16, exp16_nonpositive, log_add16,
// row_top, row_runner_up and loo_row these use.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <optional>

namespace log_entries {

// one thread below this many entries (operators.cpp's PARALLEL_WORK / ENTRY_COST)
constexpr int64_t PARALLEL_ENTRIES = int64_t(1) << 15;

inline int threads_for(int64_t count) {
    return count < PARALLEL_ENTRIES ? 1 : std::max(1, at::get_num_threads());
}

// log(e^a + e^b) = big + log(1 + t), t = e^(small - big), with the rounding of 1 + t
// corrected; -inf for two -inf, +inf where either is +inf, NaN where either is NaN.
template <typename T>
inline T log_add_entry(T a, T b) {
    const T inf = __builtin_inf();
    const bool a_big = a >= b;
    const T big = a_big ? a : b, small = a_big ? b : a;
    const T d = small - big;  // ≤ 0; NaN for two equal infinities or a NaN
    const T t = exp_nonpositive(d == d ? d : -inf);
    const T u = T(1) + t;
    const T log1p = log_positive(u) - ((u - T(1)) - t) / u;
    const bool nan = (a != a) | (b != b);
    return nan ? a + b : big + log1p;
}

// log z as torch.log: -inf at ±0, +inf at +inf, NaN below 0 and at NaN.
template <typename T>
inline T log_entry(T z) {
    return z < T(0) ? std::numeric_limits<T>::quiet_NaN() : log_abs_entry(z);
}

// z = log z + shift (+ shift_b[j]) along one row of n entries, in place.
template <typename T>
inline void log_plus_shift_row(T* z, T shift, const T* shift_b, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
        const __m512 s = _mm512_set1_ps(shift), zero = _mm512_setzero_ps();
        const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
        for (; j + 16 <= n; j += 16) {
            const __m512 x = _mm512_loadu_ps(z + j);
            const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
            __m512 l = _mm512_add_ps(_mm512_mask_blend_ps(negative, log_abs16(x), nan), s);
            if (shift_b) l = _mm512_add_ps(l, _mm512_loadu_ps(shift_b + j));
            _mm512_storeu_ps(z + j, l);
        }
    }
#endif
    if (shift_b) {
#pragma omp simd
        for (int64_t i = j; i < n; ++i) z[i] = (log_entry(z[i]) + shift) + shift_b[i];
    } else {
#pragma omp simd
        for (int64_t i = j; i < n; ++i) z[i] = log_entry(z[i]) + shift;
    }
}

// z = log z + shift[row] (+ shift_b[batch, j]) in place, for rows of n entries, m rows a
// batch: shift one entry a row, shift_b (null: none) n entries a batch.
template <typename T>
void log_plus_shifts(T* z, const T* shift, const T* shift_b, int64_t rows, int64_t m, int64_t n,
                     int threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t row = 0; row < rows; ++row)
        log_plus_shift_row(z + row * n, shift[row], shift_b ? shift_b + (row / m) * n : nullptr,
                           n);
}

// out = a + log|w| (a null: log|w|), entries [0, count).
template <typename T>
void plus_log_abs(const T* a, const T* w, T* out, int64_t count, int threads) {
    (void)threads;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
        const int64_t vectors = count / 16;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t v = 0; v < vectors; ++v) {
            const int64_t i = 16 * v;
            const __m512 l = log_abs16(_mm512_loadu_ps(w + i));
            _mm512_storeu_ps(out + i, a ? _mm512_add_ps(_mm512_loadu_ps(a + i), l) : l);
        }
        for (int64_t i = 16 * vectors; i < count; ++i)
            out[i] = a ? a[i] + log_abs_entry(w[i]) : log_abs_entry(w[i]);
        return;
    }
#endif
    if (a) {
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
        for (int64_t i = 0; i < count; ++i) out[i] = a[i] + log_abs_entry(w[i]);
    } else {
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
        for (int64_t i = 0; i < count; ++i) out[i] = log_abs_entry(w[i]);
    }
}

// out = log(e^a + e^b), entries [0, count), in the calling thread; out may be a or b.
template <typename T>
inline void log_add_span(const T* a, const T* b, T* out, int64_t count) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // log_add_entry, 16 entries at a time
        for (; i + 16 <= count; i += 16) {
            const __m512 x = _mm512_loadu_ps(a + i), y = _mm512_loadu_ps(b + i);
            _mm512_storeu_ps(out + i, log_add16(x, y).sum);
        }
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < count; ++j) out[j] = log_add_entry(a[j], b[j]);
}

// out = log(e^a + e^b) along rows of n entries: a, b and out (rows, n) with unit stride
// along n and a row stride each (a's or b's 0: one row read by every row); out may be a or
// b, entry for entry (in place); in pieces of ADD_PIECE entries.
template <typename T>
void log_add_rows(Rows<const T> a, Rows<const T> b, Rows<T> out, int64_t rows, int64_t n,
                  int threads) {
    (void)threads;
    const int64_t pieces = (n + ADD_PIECE - 1) / ADD_PIECE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t task = 0; task < rows * pieces; ++task) {
        const int64_t r = task / pieces, at = (task % pieces) * ADD_PIECE;
        log_add_span(a.row(r) + at, b.row(r) + at, out.row(r) + at, std::min(ADD_PIECE, n - at));
    }
}

// log|1 - p| with the rounding of u = 1 - p corrected: log|u| - ((u - 1) + p) / u (the
// error term 0 where u is 0: -inf at p = 1).
template <typename T>
inline T log_one_minus_entry(T p) {
    const T u = T(1) - p, fix = ((u - T(1)) + p) / u;
    return log_abs_entry(u) - (u != T(0) ? fix : T(0));
}

// Along one row of n entries: lp = log|p| and t = g + lp.
template <typename T>
inline void log_terms_row(const T* g, const T* p, T* t, T* lp, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
        for (; j + 16 <= n; j += 16) {
            const __m512 l = log_abs16(_mm512_loadu_ps(p + j));
            _mm512_storeu_ps(lp + j, l);
            _mm512_storeu_ps(t + j, _mm512_add_ps(_mm512_loadu_ps(g + j), l));
        }
    }
#endif
#pragma omp simd
    for (int64_t i = j; i < n; ++i) {
        const T l = log_abs_entry(p[i]);
        lp[i] = l;
        t[i] = g[i] + l;
    }
}

// Along one row of n entries, with out holding L: out = log(e^(t + log|1 - p|) + e^(L + lp)).
template <typename T>
inline void softmax_combine_row(const T* t, const T* p, const T* lp, T* out, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            const __m512 pv = _mm512_loadu_ps(p + j), u = _mm512_sub_ps(one, pv);
            const __mmask16 nonzero = _mm512_cmp_ps_mask(u, zero, _CMP_NEQ_UQ);
            const __m512 error = _mm512_add_ps(_mm512_sub_ps(u, one), pv);  // (u - 1) + p
            const __m512 fix = _mm512_maskz_div_ps(nonzero, error, u);
            const __m512 log_u = _mm512_sub_ps(log_abs16(u), fix);
            const __m512 own = _mm512_add_ps(_mm512_loadu_ps(t + j), log_u);
            const __m512 rest = _mm512_add_ps(_mm512_loadu_ps(out + j), _mm512_loadu_ps(lp + j));
            _mm512_storeu_ps(out + j, log_add16(own, rest).sum);
        }
    }
#endif
#pragma omp simd
    for (int64_t i = j; i < n; ++i)
        out[i] = log_add_entry(t[i] + log_one_minus_entry(p[i]), out[i] + lp[i]);
}

// Log's softmax message along one row in the frame of the row's largest term, for rows
// where that loses nothing (else false, out untouched): with t_j = g_j + log|p_j|, top =
// max t, e_j = e^(t_j - top) and D_i = Σ_{j≠i} e_j (loo_row's sums: the total minus e_i,
// the argmax's apart, within LOO_SHARED_GAP of the second largest),
// out_i = top + log(e_i·|1 - p_i| + D_i·|p_i|): one log and one exp an entry besides log|p|,
// where the log-space combination takes three logs and two exps. Declines a row with a
// nonzero |p| below LINEAR_MIN_P, a gap over LOO_SHARED_GAP between its two largest terms
// (one term or none: the argmax's D would flush), NaN or +inf. t: n entries of scratch.
template <typename T>
bool softmax_linear_row(const T* g, const T* p, T* out, T* t, int64_t n) {
    int tiny = 0;
    int64_t j0 = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        __mmask16 small = 0;
        for (; j0 + 16 <= n; j0 += 16) {
            const __m512 pv = _mm512_loadu_ps(p + j0);
            small |= below_linear_min16(pv);
            _mm512_storeu_ps(t + j0, _mm512_add_ps(_mm512_loadu_ps(g + j0), log_abs16(pv)));
        }
        tiny = small != 0;
    }
#endif
#pragma omp simd reduction(| : tiny)
    for (int64_t j = j0; j < n; ++j) {
        tiny |= below_linear_min(p[j]);
        t[j] = g[j] + log_abs_entry(p[j]);
    }
    T top;
    int64_t at;
    if (tiny || !linear_frame_top(t, n, &top, &at)) return false;
    double total = 0, total_at = 0;
    for (int64_t c = 0; c < n; c += SUM_CHUNK) {  // chunk sums added in double: long rows
        const int64_t end = std::min(n, c + SUM_CHUNK);
        T part = 0, part_at = 0;
        int64_t j1 = c;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>) {
            const __m512 shift = _mm512_set1_ps(top);
            __m512 sum = _mm512_setzero_ps(), sum_at = _mm512_setzero_ps();
            for (; j1 + 16 <= end; j1 += 16) {
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(t + j1), shift));
                _mm512_storeu_ps(t + j1, e);
                sum = _mm512_add_ps(sum, e);
                const int64_t lane = at - j1;
                const __mmask16 others =
                    lane >= 0 && lane < 16 ? __mmask16(~(1u << lane)) : __mmask16(0xFFFF);
                sum_at = _mm512_mask_add_ps(sum_at, others, sum_at, e);
            }
            part = _mm512_reduce_add_ps(sum), part_at = _mm512_reduce_add_ps(sum_at);
        }
#endif
#pragma omp simd reduction(+ : part, part_at)
        for (int64_t j = j1; j < end; ++j) {
            const T e = exp_nonpositive(t[j] - top);
            t[j] = e;
            part += e;
            part_at += j == at ? T(0) : e;
        }
        total += part, total_at += part_at;
    }
    const T sum = T(total), sum_at = T(total_at);
    int64_t j2 = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        const __m512 one = _mm512_set1_ps(1.0f), total_v = _mm512_set1_ps(sum);
        const __m512 zero = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
        for (; j2 + 16 <= n; j2 += 16) {
            const __m512 e = _mm512_loadu_ps(t + j2), pv = _mm512_loadu_ps(p + j2);
            __m512 den = _mm512_max_ps(_mm512_sub_ps(total_v, e), zero);
            const int64_t lane = at - j2;
            if (lane >= 0 && lane < 16)
                den = _mm512_mask_mov_ps(den, __mmask16(1u << lane), _mm512_set1_ps(sum_at));
            const __m512 own = _mm512_abs_ps(_mm512_sub_ps(one, pv));
            const __m512 x = _mm512_fmadd_ps(e, own, _mm512_mul_ps(den, _mm512_abs_ps(pv)));
            _mm512_storeu_ps(out + j2, _mm512_add_ps(log_abs16(x), shift));
        }
    }
#endif
#pragma omp simd
    for (int64_t j = j2; j < n; ++j) {
        const T e = t[j], pj = p[j], d = sum - e, den = j == at ? sum_at : (d > T(0) ? d : T(0));
        const T u = T(1) - pj, own = u < T(0) ? -u : u;
        out[j] = log_nonnegative(e * own + den * (pj < T(0) ? -pj : pj)) + top;
    }
    return true;
}

// The Log semiring's message at softmax's input from g at its output p = softmax(s), along
// rows of n contiguous entries: with t_j = g_j + log p_j and L_i = log Σ_{j≠i} e^(t_j) (the
// leave-one-out ⊕ of loo_row), out_i = log(e^(t_i + log(1 - p_i)) + e^(L_i + log p_i)), the
// ⊕ of the paths through ∂p_i/∂s_i = p_i(1 - p_i) and through ∂p_j/∂s_i = -p_j p_i (j ≠ i):
// in the frame of the row's largest term where that loses nothing (softmax_linear_row),
// else in log space. bad[row] = 1 where a row's t holds NaN or +inf and the row was left
// uncomputed, else 0.
template <typename T>
void softmax_backward_rows(const T* g, const T* p, T* out, uint8_t* bad, int64_t n,
                           int64_t rows, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> scratch(2 * n);
        T* t = scratch.data();
        T* lp = t + n;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
            const int64_t at = row * n;
            bad[row] = 0;
            if (softmax_linear_row(g + at, p + at, out + at, t, n)) continue;
            log_terms_row(g + at, p + at, t, lp, n);
            const bool done = loo_row<T, false>(t, nullptr, out + at, nullptr, n);
            bad[row] = !done;
            if (done) softmax_combine_row(t, p + at, lp, out + at, n);
        }
    }
}

// The message operand of a shift-and-GEMM in log space for a message held transposed: a
// (count, k, m), unit stride along m, batch and row strides sab and sak (r: srb, srk). Per
// batch and column j, the shift (the maximum over k where finite, else 0) and liveness
// (that maximum is finite) into shift[b·m + j] and live[b·m + j], and e = e^(a - shift)
// into out (count, k, m) contiguous, or, given r, e·r into rows [0, k) and e into rows
// [k, 2k) of out (count, 2k, m): log_space_rows' values entry by entry, transposed. A
// column whose maximum is +inf or NaN takes std::exp, as its shifted entries may be positive.
template <typename T>
void log_space_columns(const T* a, int64_t sab, int64_t sak, const T* r, int64_t srb,
                       int64_t srk, T* out, T* shift, uint8_t* live, int64_t count, int64_t k,
                       int64_t m, int threads) {
    const T inf = __builtin_inf();
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<uint8_t> slow(m);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < count; ++b) {
            const T* ab = a + b * sab;
            T* s = shift + b * m;
            uint8_t* flags = slow.data();
            for (int64_t j = 0; j < m; ++j) s[j] = -inf, flags[j] = 0;
            for (int64_t q = 0; q < k; ++q) {
                const T* row = ab + q * sak;
#pragma omp simd
                for (int64_t j = 0; j < m; ++j) {
                    const T x = row[j];
                    flags[j] |= x != x;
                    s[j] = x > s[j] ? x : s[j];
                }
            }
            bool any_slow = false;
            for (int64_t j = 0; j < m; ++j) {
                const bool nan = flags[j], finite = !nan && s[j] > -inf && s[j] < inf;
                live[b * m + j] = finite;
                flags[j] = nan || s[j] == inf;
                any_slow |= flags[j];
                s[j] = finite ? s[j] : T(0);
            }
            T* e = out + b * (r ? 2 : 1) * k * m + (r ? k * m : 0);
            T* er = r ? out + b * 2 * k * m : nullptr;
            for (int64_t q = 0; q < k; ++q) {
                const T* row = ab + q * sak;
                T* eq = e + q * m;
#pragma omp simd
                for (int64_t j = 0; j < m; ++j) {
                    const T d = row[j] - s[j];  // ≤ 0 but in the slow columns
                    eq[j] = exp_nonpositive(d <= T(0) ? d : T(0));
                }
                if (any_slow)
                    for (int64_t j = 0; j < m; ++j)
                        if (flags[j]) eq[j] = std::exp(row[j] - s[j]);
                if (r) {
                    const T* rq = r + b * srb + q * srk;
                    T* erq = er + q * m;
#pragma omp simd
                    for (int64_t j = 0; j < m; ++j) erq[j] = eq[j] * rq[j];
                }
            }
        }
    }
}

// (shift, live), each (count, m, 1): log_space_columns on a (count, k, m) and r (a's shape),
// each of unit stride along m, into out (count, k, m), or (count, 2k, m) given r, contiguous.
inline std::tuple<at::Tensor, at::Tensor> log_space_columns_op(const at::Tensor& a,
                                                               const std::optional<at::Tensor>& r,
                                                               at::Tensor out) {
    const auto dtype = a.scalar_type();
    TORCH_CHECK(a.dim() == 3 && a.stride(2) == 1 && (dtype == at::kFloat || dtype == at::kDouble),
                "log_space_columns: a (count, k, m) float32/float64 of unit stride along m, got ",
                a.sizes(), " ", a.strides(), " ", dtype);
    TORCH_CHECK(!r || (r->sizes() == a.sizes() && r->stride(2) == 1 && r->scalar_type() == dtype),
                "log_space_columns: r of a's shape and dtype, unit stride along m");
    const int64_t count = a.size(0), k = a.size(1), m = a.size(2);
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype &&
                    out.sizes() == at::IntArrayRef({count, (r ? 2 : 1) * k, m}),
                "log_space_columns: out (count, k, m), or (count, 2k, m) with r, contiguous, "
                "got ", out.sizes());
    auto shift = at::empty({count, m, 1}, a.options());
    auto live = at::empty({count, m, 1}, a.options().dtype(at::kBool));
    const int threads = threads_for(a.numel() * (r ? 2 : 1));
    if (dtype == at::kDouble)
        log_space_columns<double>(a.const_data_ptr<double>(), a.stride(0), a.stride(1),
                                  r ? r->const_data_ptr<double>() : nullptr, r ? r->stride(0) : 0,
                                  r ? r->stride(1) : 0, out.data_ptr<double>(),
                                  shift.data_ptr<double>(), live.view(at::kByte).data_ptr<uint8_t>(),
                                  count, k, m, threads);
    else
        log_space_columns<float>(a.const_data_ptr<float>(), a.stride(0), a.stride(1),
                                 r ? r->const_data_ptr<float>() : nullptr, r ? r->stride(0) : 0,
                                 r ? r->stride(1) : 0, out.data_ptr<float>(),
                                 shift.data_ptr<float>(), live.view(at::kByte).data_ptr<uint8_t>(),
                                 count, k, m, threads);
    return {shift, live};
}

inline void check_entries(const char* name, const at::Tensor& x, const at::Tensor& y) {
    TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.sizes() == y.sizes() &&
                    x.scalar_type() == y.scalar_type() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
                name, ": operands contiguous, of one shape and dtype (float32 or float64), got ",
                x.sizes(), " ", x.scalar_type(), " and ", y.sizes(), " ", y.scalar_type());
}

template <typename Body>
at::Tensor entries(const at::Tensor& like, Body body) {
    auto out = at::empty_like(like, at::MemoryFormat::Contiguous);
    const int64_t count = out.numel();
    if (like.scalar_type() == at::kDouble)
        body(static_cast<double*>(nullptr), out, count, threads_for(count));
    else
        body(static_cast<float*>(nullptr), out, count, threads_for(count));
    return out;
}

inline at::Tensor plus_log_abs_op(const std::optional<at::Tensor>& a, const at::Tensor& w) {
    if (a) check_entries("plus_log_abs", *a, w);
    else check_entries("plus_log_abs", w, w);
    return entries(w, [&](auto tag, at::Tensor& out, int64_t count, int threads) {
        using T = std::remove_pointer_t<decltype(tag)>;
        plus_log_abs<T>(a ? a->const_data_ptr<T>() : nullptr, w.const_data_ptr<T>(),
                        out.data_ptr<T>(), count, threads);
    });
}

// Whether t (contiguous, of z's dtype) has z's sizes but `one` (a dim index) of size 1.
inline bool fits(const at::Tensor& t, const at::Tensor& z, int64_t one) {
    if (t.dim() != z.dim() || !t.is_contiguous() || t.scalar_type() != z.scalar_type())
        return false;
    for (int64_t d = 0; d < z.dim(); ++d)
        if (t.size(d) != (d == one ? 1 : z.size(d))) return false;
    return true;
}

// z = log z + shift (+ shift_b) in place, one pass (log_gemm_finish_'s last step), for z
// (…, m, n) contiguous float32/float64, shift (…, m, 1) and shift_b (…, 1, n) of its dtype,
// contiguous: true; false, nothing written, for other operands.
inline bool log_plus_shifts_(at::Tensor& z, const at::Tensor& shift,
                             const std::optional<at::Tensor>& shift_b) {
    const int64_t d = z.dim();
    if (d < 2 || !z.is_contiguous() || z.numel() == 0 ||
        (z.scalar_type() != at::kFloat && z.scalar_type() != at::kDouble) ||
        !fits(shift, z, d - 1) || (shift_b && !fits(*shift_b, z, d - 2)))
        return false;
    const int64_t n = z.size(-1), m = z.size(-2), rows = z.numel() / n;
    const int threads = threads_for(z.numel());
    if (z.scalar_type() == at::kDouble)
        log_plus_shifts<double>(z.data_ptr<double>(), shift.const_data_ptr<double>(),
                                shift_b ? shift_b->const_data_ptr<double>() : nullptr, rows, m,
                                n, threads);
    else
        log_plus_shifts<float>(z.data_ptr<float>(), shift.const_data_ptr<float>(),
                               shift_b ? shift_b->const_data_ptr<float>() : nullptr, rows, m, n,
                               threads);
    return true;
}

// (out, declined): softmax_backward_rows along the last dim of g and p (contiguous, of one
// shape and dtype, float32 or float64); declined (0-d bool) true when a row was left
// uncomputed (the caller's torch formula then handles every row).
inline std::tuple<at::Tensor, at::Tensor> softmax_backward_log_op(const at::Tensor& g,
                                                                 const at::Tensor& p) {
    check_entries("softmax_backward_log", g, p);
    TORCH_CHECK(g.dim() >= 1, "softmax_backward_log: g and p must have a dim to work along");
    const int64_t n = g.size(-1), rows = n ? g.numel() / n : 0;
    auto bad = at::zeros({rows}, g.options().dtype(at::kByte));
    auto out = entries(g, [&](auto tag, at::Tensor& o, int64_t count, int) {
        using T = std::remove_pointer_t<decltype(tag)>;
        softmax_backward_rows<T>(g.const_data_ptr<T>(), p.const_data_ptr<T>(), o.data_ptr<T>(),
                                 bad.data_ptr<uint8_t>(), n, rows, threads_for(4 * count));
    });
    return {out, bad.any().to(at::kBool)};
}

inline at::Tensor log_add_op(const at::Tensor& a, const at::Tensor& b) {
    check_entries("log_add", a, b);
    return entries(a, [&](auto tag, at::Tensor& out, int64_t count, int threads) {
        using T = std::remove_pointer_t<decltype(tag)>;
        log_add_rows<T>({a.const_data_ptr<T>(), 0}, {b.const_data_ptr<T>(), 0},
                        {out.data_ptr<T>(), 0}, 1, count, threads);
    });
}

// The operands of a ⊕ over rows (log_add_rows_, entropy_add_rows_): 2-D of one shape (rows,
// n) and dtype (float32 or float64), each with unit stride along n and any row stride; the
// outputs' rows apart (a row stride of at least n, or one row).
inline void check_add_rows(const char* name, std::initializer_list<const at::Tensor*> outs,
                           std::initializer_list<const at::Tensor*> operands) {
    const at::Tensor& first = **outs.begin();
    const auto dtype = first.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, name,
                ": float32 or float64 operands, got ", dtype);
    for (const auto& list : {outs, operands})
        for (const at::Tensor* t : list)
            TORCH_CHECK(t->dim() == 2 && t->sizes() == first.sizes() &&
                            t->scalar_type() == dtype && (t->size(1) <= 1 || t->stride(1) == 1),
                        name, ": operands 2-D of one shape and dtype with unit stride along rows, "
                        "got ", t->sizes(), " ", t->strides(), " ", t->scalar_type(), " for ",
                        first.sizes());
    for (const at::Tensor* t : outs)
        TORCH_CHECK(t->size(0) <= 1 || t->stride(0) >= t->size(1), name,
                    ": an output's rows overlap (stride ", t->stride(0), " for rows of ",
                    t->size(1), ")");
}

// A 2-D operand of the ⊕ over rows as Rows (its data and row stride).
template <typename T>
inline Rows<const T> rows_of(const at::Tensor& t) {
    return {t.const_data_ptr<T>(), t.stride(0)};
}

template <typename T>
inline Rows<T> rows_into(at::Tensor& t) {
    return {t.data_ptr<T>(), t.stride(0)};
}

// out = log(e^a + e^b) for a, b and out of check_add_rows; out may be a or b itself (in
// place).
inline void log_add_rows_op(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
    check_add_rows("log_add_rows_", {&out}, {&a, &b});
    const int64_t rows = out.size(0), n = out.size(1);
    if (rows == 0 || n == 0) return;
    AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "log_add_rows_", [&] {
        log_add_rows<scalar_t>(rows_of<scalar_t>(a), rows_of<scalar_t>(b),
                               rows_into<scalar_t>(out), rows, n, threads_for(rows * n));
    });
}

}  // namespace log_entries
