// The attention probabilities a semiring backward recomputes, in one operator call per
// tensor:
//
//   softmax_rows_(scores, keep, factor)  scores ← softmax(scores · factor) along each row of
//                                        n entries, in place, the entries where keep (one
//                                        row of n per query row, read by every batch and
//                                        head) is false excluded
//
// torch spells it as six full passes (the scale, the mask's fill, the row maxima, the
// shifted exponentials, the row sums, the division); here each row is read and written in
// L1, with the AVX-512 exp of extreme_matmul.h (within 1 ulp). The values are the torch
// chain's (tensor_helpers.attention_probs) within its rounding: a row whose kept entries
// hold NaN or +inf is NaN throughout, a row with no kept entry 0 throughout (no edges).
// Operands: scores contiguous float32/float64 (rows, n); keep contiguous bool (q, n), row
// r of scores reading row r mod q. The Python wrapper (kernels/__init__.py) checks that
// and takes the torch chain otherwise.
//
// Part of semiring_autograd; included by operators.cpp after log_entries.h and
// extreme_matmul.h, whose threads_for, row maxima and exponentials these use.

#pragma once

#include <ATen/ATen.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

namespace attention_rows {

// One row of n scores in place: x ← x · factor, -inf where keep is false (keep null: none
// excluded), then softmax; NaN throughout where a kept entry is NaN or +inf, 0 where none
// is kept.
template <typename T>
void softmax_row(T* x, const uint8_t* keep, T factor, int64_t n) {
    const T inf = __builtin_inf();
    T top = -inf;
    int bad = 0;
    int64_t j0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        const __m512 f = _mm512_set1_ps(factor), none = _mm512_set1_ps(-inf);
        const __m512 plus = _mm512_set1_ps(inf);
        __m512 most = none;
        __mmask16 odd = 0;
        for (; j0 + 16 <= n; j0 += 16) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + j0), f);
            if (keep) {
                const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + j0));
                const __mmask16 kept = _mm_test_epi8_mask(bytes, bytes);
                v = _mm512_mask_blend_ps(kept, none, v);
            }
            _mm512_storeu_ps(x + j0, v);
            odd |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, plus, _CMP_EQ_OQ);
            most = _mm512_max_ps(most, v);
        }
        top = _mm512_reduce_max_ps(most);
        bad = odd != 0;
    }
#endif
#pragma omp simd reduction(max : top) reduction(| : bad)
    for (int64_t j = j0; j < n; ++j) {
        const T v = (keep == nullptr || keep[j]) ? x[j] * factor : -inf;
        x[j] = v;
        bad |= (v != v) | (v == inf);
        top = v > top ? v : top;
    }
    if (bad || top == -inf) {
        const T fill = bad ? std::numeric_limits<T>::quiet_NaN() : T(0);
        for (int64_t j = 0; j < n; ++j) x[j] = fill;
        return;
    }
    double total = 0;
    for (int64_t c = 0; c < n; c += SUM_CHUNK) {  // chunk sums added in double: long rows
        const int64_t end = std::min(n, c + SUM_CHUNK);
        T part = 0;
        int64_t j = c;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>) {
            const __m512 shift = _mm512_set1_ps(top);
            __m512 sum = _mm512_setzero_ps();
            for (; j + 16 <= end; j += 16) {
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + j), shift));
                _mm512_storeu_ps(x + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            part = _mm512_reduce_add_ps(sum);
        }
#endif
#pragma omp simd reduction(+ : part)
        for (int64_t i = j; i < end; ++i) {
            const T e = exp_nonpositive(x[i] - top);
            x[i] = e;
            part += e;
        }
        total += part;
    }
    const T scale = T(1) / T(total);  // sum ≥ 1: the largest term's e^0
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[j] = x[j] * scale;
}

// softmax_row over rows [0, rows) of n entries, row r reading keep's row r mod keep_rows.
template <typename T>
void softmax_rows(T* x, const uint8_t* keep, int64_t keep_rows, T factor, int64_t rows,
                  int64_t n, int threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        softmax_row(x + r * n, keep ? keep + (r % keep_rows) * n : nullptr, factor, n);
}

inline void softmax_rows_op(at::Tensor scores, const std::optional<at::Tensor>& keep,
                            double factor) {
    const auto dtype = scores.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kDouble) && scores.is_contiguous() &&
                    scores.dim() >= 1,
                "softmax_rows_: scores contiguous float32 or float64 with a dim of keys, got ",
                scores.sizes(), " ", dtype);
    const int64_t n = scores.size(-1), rows = n ? scores.numel() / n : 0;
    int64_t keep_rows = 0;
    if (keep) {
        TORCH_CHECK(keep->scalar_type() == at::kBool && keep->is_contiguous() &&
                        keep->dim() == 2 && keep->size(1) == n && keep->size(0) > 0 &&
                        (rows == 0 || rows % keep->size(0) == 0),
                    "softmax_rows_: keep contiguous bool (query rows, ", n,
                    ") dividing the scores' rows, got ", keep->sizes(), " ",
                    keep->scalar_type());
        keep_rows = keep->size(0);
    }
    if (rows == 0 || n == 0) return;
    const uint8_t* mask = keep ? reinterpret_cast<const uint8_t*>(keep->const_data_ptr<bool>())
                               : nullptr;
    const int threads = log_entries::threads_for(4 * scores.numel());
    if (dtype == at::kDouble)
        softmax_rows<double>(scores.data_ptr<double>(), mask, keep_rows, factor, rows, n,
                             threads);
    else
        softmax_rows<float>(scores.data_ptr<float>(), mask, keep_rows, float(factor), rows, n,
                            threads);
}

}  // namespace attention_rows
