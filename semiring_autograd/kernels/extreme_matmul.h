// Max-times and signed max/min-times matrix products for the CPU, in register blocks, and
// one-pass elementwise and per-row kernels, on raw pointers. Included by operators.cpp, which
// registers them as torch operators; no torch headers here. Built with -fno-trapping-math,
// which lets selects between two computed values vectorise (no FP trap is ever enabled, so
// no result changes).
//
// max_times and signed_times work on contiguous row-major operands with a batch dimension:
//   a: (batch, m, k), b: (batch, k, n), out: (batch, m, n), where n is a multiple of the
//   block width W (signed_times' caller pads b; max_times reads b's n_real columns and packs
//   its strips with NaN past them), and fill out[bt, :, columns c0*W .. c1*W) for the
//   batches bt in [b0, b1), on `threads` OpenMP threads (max_times of at most STREAM_ROWS
//   rows, over every column, reads b along its rows: max_times_streamed). lift_times reads
//   strided operands and writes its product transposed (see there); signed_mul_lift,
//   entropy_weights, entropy_mul_lift, entropy_add_rows and ratio_where_positive are elementwise
//   (entropy_mul_lift_spread: w broadcast); nan_or_inf scans entries;
//   loo_log, log_space_rows, entropy_reduce_rows, entropy_softmax_backward_rows,
//   all_rows_live and gemm_exact work along contiguous rows.
//
// A NaN operand entry means "no edge" (the semiring zero): NaN products never win a max or
// a min, because an update is `p > acc ? p : acc`, false for NaN. max_block and lift_block
// skip the terms that provably cannot change a max or a min (see kept_terms); the results
// are the same to the bit.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Cache-line aligned storage for packed strips: a vector load from one never spans two lines
// (a split load costs two; measured 20-30% on the kernels that read strips most).
template <typename T>
struct Aligned {
    typedef T value_type;
    Aligned() = default;
    template <typename U>
    Aligned(const Aligned<U>&) {}
    T* allocate(std::size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    bool operator==(const Aligned&) const { return true; }
    bool operator!=(const Aligned&) const { return false; }
};

template <typename T>
using Buffer = std::vector<T, Aligned<T>>;

template <typename T>
struct Vec {
    typedef T type __attribute__((vector_size(64)));
    static constexpr int lanes = 64 / sizeof(T);
};

template <typename V>
inline V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
}

template <typename V>
inline void store(void* p, V v) {
    std::memcpy(p, &v, sizeof(V));
}

// The first `valid` entries at p as a vector (the other lanes 0).
template <typename T, typename V = typename Vec<T>::type>
inline V load_part(const T* p, int64_t valid) {
    if (valid >= Vec<T>::lanes) return load<V>(p);
    V v = V{} + T(0);
    for (int64_t c = 0; c < valid; ++c) v[c] = p[c];
    return v;
}

// Whether every lane of v is finite: v·0 is 0 for a finite lane, NaN otherwise.
template <typename T, typename V = typename Vec<T>::type>
inline bool finite_lanes(V v) {
    const V z = v * T(0);
    bool ok = true;
    for (int c = 0; c < Vec<T>::lanes; ++c) ok = ok && z[c] == T(0);
    return ok;
}

template <typename V>
inline V vmax(V x, V y) {
    return x > y ? x : y;
}

template <typename V>
inline V vmin(V x, V y) {
    return x < y ? x : y;
}

constexpr int C = 2;  // vectors per row in a block: W = C * lanes columns
constexpr int64_t KC = 256;  // k block: a packed strip block (KC x W) stays in L1

constexpr int PRUNE_GROUP = 128, FIRST_GROUP = 32;  // k entries per pruning decision

// Pruning (branch and bound), shared by max_block and lift_block. A term's product has
// |x[i, q] · y[q, j]| ≤ |x[i, q]| · by[q], where by[q] is the largest |y| over the strip's
// row q (NaN counted as 0), and the rounding of a product is monotone in its factors. Once
// every live accumulator of row i has passed a mark t[i] (hi ≥ t and, for pairs, lo ≤ -t)
// with t[i] ≥ |x[i, q]| · by[q] for every row i of a block, q's terms lose every max and
// min (a tie keeps the accumulator, as a computed term would), so they are skipped. The
// marks are taken per group of k entries; a NaN bound keeps the term.

// Write q0 + g to qs, in order, for the g < count whose terms may still count: some row r
// < R has !(|x[r·rs + g·gs]| · by[g] <= t[r]). Returns how many. Branch-free (a kept
// fraction that varies from group to group would mispredict a loop over set bits); qs has
// room for count + 16 entries.
template <typename T, int R>
inline int kept_terms(const T* x, int64_t rs, int64_t gs, const T* by, const T (&t)[R],
                      int count, int32_t q0, int32_t* qs) {
    int n = 0, g = 0;
#if defined(__AVX512F__) && defined(__BMI2__)
    if constexpr (std::is_same_v<T, float>) {
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                               14, 15);
        auto emit = [&](uint32_t keep) {  // the kept entries of g .. g + 15
            const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(q0 + g));
            _mm512_storeu_si512(qs + n, _mm512_maskz_compress_epi32(keep, at));
            n += __builtin_popcount(keep);
        };
        if (gs == 1) {  // rows along g (max_block's a)
            for (; g + 16 <= count; g += 16) {
                const __m512 b = _mm512_loadu_ps(by + g);
                __mmask16 done = 0xffff;
                for (int r = 0; r < R; ++r) {
                    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + r * rs + g));
                    done &= _mm512_cmp_ps_mask(_mm512_mul_ps(v, b), _mm512_set1_ps(t[r]),
                                               _CMP_LE_OQ);
                }
                emit(static_cast<uint16_t>(~done));
            }
        } else if (rs == 1 && gs == 4) {
            if constexpr (R == 4) {  // q-major groups of 4 rows (lift_block)
                const __m512 marks = _mm512_setr_ps(t[0], t[1], t[2], t[3], t[0], t[1], t[2],
                                                    t[3], t[0], t[1], t[2], t[3], t[0], t[1],
                                                    t[2], t[3]);
                const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3,
                                                         3, 3, 3);
                for (; g + 16 <= count; g += 16) {
                    uint32_t keep = 0;
                    for (int h = 0; h < 16; h += 4) {
                        const __m512 b = _mm512_permutexvar_ps(
                            spread, _mm512_castps128_ps512(_mm_loadu_ps(by + g + h)));
                        const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + (g + h) * 4));
                        uint32_t d =
                            _mm512_cmp_ps_mask(_mm512_mul_ps(v, b), marks, _CMP_LE_OQ);
                        d &= (d >> 1) & (d >> 2) & (d >> 3);  // all 4 rows done, per q
                        keep |= (~_pext_u32(d, 0x1111) & 0xf) << h;
                    }
                    emit(keep);
                }
            }
        }
    }
#endif
    for (; g < count; ++g) {
        bool done = true;
        for (int r = 0; r < R; ++r) {
            const T v = x[r * rs + g * gs];
            done = done && (v < T(0) ? -v : v) * by[g] <= t[r];
        }
        qs[n] = q0 + g;
        n += !done;
    }
    return n;
}

// The least lane of v, by halving (log2(lanes) dependent steps, not lanes - 1).
template <typename T, typename V = typename Vec<T>::type>
inline T least_lane(V v) {
    if constexpr (Vec<T>::lanes == 16) {
        v = vmin(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4,
                                            5, 6, 7));
        v = vmin(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8,
                                            9, 10, 11));
        v = vmin(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15,
                                            12, 13));
        v = vmin(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12,
                                            15, 14));
    } else {
        static_assert(Vec<T>::lanes == 8);
        v = vmin(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
        v = vmin(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
        v = vmin(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    }
    return v[0];
}

// The marks of a block of accumulators: t[r] = their minimum over row r's live columns.
// `dead` holds, per column, -inf for a live column and +inf for one with no term at all
// (padding, or every entry NaN), whose accumulators never move and so must not hold the
// others back.
template <typename T, int R, typename V = typename Vec<T>::type>
inline void max_marks(const V (&acc)[R][C], const T* dead, T (&t)[R]) {
    constexpr int L = Vec<T>::lanes;
    for (int r = 0; r < R; ++r) {
        V least = vmax(acc[r][0], load<V>(dead));
        for (int c = 1; c < C; ++c) least = vmin(least, vmax(acc[r][c], load<V>(dead + c * L)));
        t[r] = least_lane<T>(least);
    }
}

// term(q) for every q < kc but the skipped ones: per group of k entries (FIRST_GROUP in a
// first k block, while the accumulators are new, so that skipping starts early; one group
// per k block after that), marks(t) takes the rows' marks and kept_terms (row bounds x
// with strides rs, gs; strip bounds by) picks the entries to run.
template <typename T, int R, typename Marks, typename Term>
inline void pruned_terms(int64_t kc, bool resume, const T* x, int64_t rs, int64_t gs,
                         const T* by, Marks marks, Term term) {
    int32_t qs[PRUNE_GROUP + 16];
    const int64_t group = resume ? PRUNE_GROUP : FIRST_GROUP;
    for (int64_t q0 = 0; q0 < kc; q0 += group) {
        const int count = static_cast<int>(std::min(kc - q0, group));
        int n = count;
        if (resume || q0 > 0) {
            T t[R];
            marks(t);
            n = kept_terms<T, R>(x + q0 * gs, rs, gs, by + q0, t, count,
                                 static_cast<int32_t>(q0), qs);
        }
        if (n == count)  // nothing skipped: the plain loop, without the index list
            for (int64_t q = q0; q < q0 + count; ++q) term(q);
        else
            for (int i = 0; i < n; ++i) term(qs[i]);
    }
}

// out[i, j] = max(start, max_q a[i, q] * b[q, j]) for R rows from i, W columns from j and
// q < kc ≤ KC, where start is `init`, or out's current value when `resume` (a later k
// block). a has row stride lda; b is a packed strip (row stride W); out has row stride ldo.
//
// Terms that cannot change the result are skipped (see kept_terms and pruned_terms; bb:
// the strip's bounds, dead: its dead columns).
template <typename T, int R>
void max_block(const T* a, int64_t lda, const T* b, const T* bb, const T* dead, T* out,
               int64_t ldo, int64_t kc, T init, bool resume) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    V acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            acc[r][c] = resume ? load<V>(out + r * ldo + c * L) : V{} + init;
    auto term = [&](int64_t q) {
        V bv[C];
        for (int c = 0; c < C; ++c) bv[c] = load<V>(b + q * W + c * L);
        for (int r = 0; r < R; ++r) {
            const T s = a[r * lda + q];
            for (int c = 0; c < C; ++c) acc[r][c] = vmax(bv[c] * s, acc[r][c]);
        }
    };
    pruned_terms<T, R>(
        kc, resume, a, lda, 1, bb, [&](T(&t)[R]) { max_marks<T, R>(acc, dead, t); }, term);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) store(out + r * ldo + c * L, acc[r][c]);
}

// A block of (hi, lo) accumulators: started at (-inf, +inf), the empty pair, or at out's
// current values when `resume` (a later k block); stored back at the end.
template <typename T, int R, typename V = typename Vec<T>::type>
inline void start_pairs(V (&acc_hi)[R][C], V (&acc_lo)[R][C], const T* hi, const T* lo,
                        int64_t ldo, bool resume) {
    constexpr int L = Vec<T>::lanes;
    const T inf = __builtin_inf();
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            acc_hi[r][c] = resume ? load<V>(hi + r * ldo + c * L) : V{} - inf;
            acc_lo[r][c] = resume ? load<V>(lo + r * ldo + c * L) : V{} + inf;
        }
}

template <typename T, int R, typename V = typename Vec<T>::type>
inline void store_pairs(const V (&acc_hi)[R][C], const V (&acc_lo)[R][C], T* hi, T* lo,
                        int64_t ldo) {
    constexpr int L = Vec<T>::lanes;
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            store(hi + r * ldo + c * L, acc_hi[r][c]);
            store(lo + r * ldo + c * L, acc_lo[r][c]);
        }
}

// Signed pairs: a is (ahi, alo), b is (bhi, blo), or a single point b (bhi == blo) when
// POINT. hi[i, j] = max_q of the largest corner product, lo = min_q of the smallest; empty
// (every q NaN) gives (-inf, +inf). Strides and `resume` as in max_block.
template <typename T, int R, bool POINT>
void signed_block(const T* ahi, const T* alo, int64_t lda, const T* bhi, const T* blo, T* hi,
                  T* lo, int64_t ldo, int64_t kc, bool resume) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    V acc_hi[R][C], acc_lo[R][C];
    start_pairs<T, R>(acc_hi, acc_lo, hi, lo, ldo, resume);
    for (int64_t q = 0; q < kc; ++q) {
        V bh[C], bl[C];
        for (int c = 0; c < C; ++c) {
            bh[c] = load<V>(bhi + q * W + c * L);
            bl[c] = POINT ? bh[c] : load<V>(blo + q * W + c * L);
        }
        for (int r = 0; r < R; ++r) {
            const T sh = ahi[r * lda + q], sl = alo[r * lda + q];
            for (int c = 0; c < C; ++c) {
                V p1 = bh[c] * sh, p2 = bh[c] * sl, top, bottom;
                if (POINT) {
                    top = vmax(p1, p2);
                    bottom = vmin(p1, p2);
                } else {
                    V p3 = bl[c] * sh, p4 = bl[c] * sl;
                    top = vmax(vmax(p1, p2), vmax(p3, p4));
                    bottom = vmin(vmin(p1, p2), vmin(p3, p4));
                }
                acc_hi[r][c] = vmax(top, acc_hi[r][c]);
                acc_lo[r][c] = vmin(bottom, acc_lo[r][c]);
            }
        }
    }
    store_pairs<T, R>(acc_hi, acc_lo, hi, lo, ldo);
}

// The marks of a block of (hi, lo) accumulators: t[r] = the minimum over row r's live
// columns of hi and of -lo (`dead` as in max_marks).
template <typename T, int R, typename V = typename Vec<T>::type>
inline void pair_marks(const V (&acc_hi)[R][C], const V (&acc_lo)[R][C], const T* dead,
                       T (&t)[R]) {
    constexpr int L = Vec<T>::lanes;
    for (int r = 0; r < R; ++r) {
        V least = V{} + T(__builtin_inf());
        for (int c = 0; c < C; ++c) {
            const V d = load<V>(dead + c * L);
            least = vmin(least, vmin(vmax(acc_hi[r][c], d), -vmin(acc_lo[r][c], -d)));
        }
        t[r] = least_lane<T>(least);
    }
}

// A lifted point times a signed pair, the point first: hi[i, j] = max_q of p[i, q] · xhi[q, j]
// when p[i, q] > 0, else p[i, q] · xlo[q, j]; lo[i, j] the min of the other end. Each term
// needs 2 products and 2 extremes, where the pair-first form needs 6: the point's sign picks
// the ends by address (`flip`: 0 or W, set by the caller), not by a branch or a blend.
// `ps` and `flip` hold the R rows' point entries per q (q-major, row stride `stride`);
// `strip` holds, per q, W entries of xhi then W of xlo, NaN where empty. Strides and
// `resume` as in max_block. Terms that cannot change the result are skipped as in
// max_block, with the points' magnitudes `pa` (laid out as ps, NaN as 0) as the row bounds
// and the strip's bx and dead.
template <typename T, int R>
void lift_block(const T* ps, const T* pa, const int32_t* flip, int stride, const T* strip,
                const T* bx, const T* dead, T* hi, T* lo, int64_t ldo, int64_t kc,
                bool resume) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    V acc_hi[R][C], acc_lo[R][C];
    start_pairs<T, R>(acc_hi, acc_lo, hi, lo, ldo, resume);
    auto term = [&](int64_t q) {
        const T* row = strip + q * 2 * W;
        for (int r = 0; r < R; ++r) {
            const T s = ps[q * stride + r];
            const T* top = row + flip[q * stride + r];
            const T* bottom = row + (W - flip[q * stride + r]);
            for (int c = 0; c < C; ++c) {
                acc_hi[r][c] = vmax(load<V>(top + c * L) * s, acc_hi[r][c]);
                acc_lo[r][c] = vmin(load<V>(bottom + c * L) * s, acc_lo[r][c]);
            }
        }
    };
    pruned_terms<T, R>(
        kc, resume, pa, 1, stride, bx,
        [&](T(&t)[R]) { pair_marks<T, R>(acc_hi, acc_lo, dead, t); }, term);
    store_pairs<T, R>(acc_hi, acc_lo, hi, lo, ldo);
}

constexpr int ROWS = 4;
constexpr int64_t KC_LIFT = 128;  // the same for a pair strip (KC_LIFT x 2W)
constexpr int64_t MAX_CHUNK = 512;  // rows of a lift_times task
constexpr int64_t SCRATCH = 1 << 17;  // entries of a lift_times task's results, per end

// The pruning bounds of a packed strip whose rows hold `vecs` vectors (W = C of them per
// row end): bx[q] = the largest |entry| of row q (0 when all are NaN), and dead[c] = +inf
// for a column none of whose rows has an entry in its first W, else -inf. Runs after the
// packing, over rows in L1.
template <typename T>
void strip_bounds(const T* strip, int vecs, int64_t k, T* bx, T* dead) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const V zero = V{} + T(0), one = V{} + T(1);
    V seen[C];
    for (int c = 0; c < C; ++c) seen[c] = zero;
    for (int64_t q = 0; q < k; ++q) {
        V big = zero;  // NaN loses every vmax
        for (int c = 0; c < vecs; ++c) {
            const V v = load<V>(strip + (q * vecs + c) * L);
            big = vmax(v < zero ? -v : v, big);
            if (c < C) seen[c] = v == v ? one : seen[c];
        }
        T b = big[0];
        for (int l = 1; l < L; ++l) b = big[l] > b ? big[l] : b;
        bx[q] = b;
    }
    for (int c = 0; c < C; ++c)
        for (int l = 0; l < L; ++l)
            dead[c * L + l] = seen[c][l] > T(0) ? -T(__builtin_inf()) : T(__builtin_inf());
}

// Copy columns [j, j + W) of the k x n matrix b into a contiguous k x W strip, so the
// kernel's loads are unit-stride whatever n is (large power-of-two row strides would
// otherwise map every row of the strip onto the same cache sets); |b| when `abs_b`
// (max-times of a lifted real derivative); NaN in the columns at or past n. `bounds`, unless
// null, gets the strip's pruning bounds: bx (k entries), then dead (W entries).
template <typename T>
void pack(const T* b, int64_t k, int64_t n, int64_t j, Buffer<T>& strip, Buffer<T>* bounds,
          bool abs_b) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    strip.resize(k * W);
    if (j + W > n) {  // the last columns, then NaN
        const int64_t valid = n - j;
        for (int64_t q = 0; q < k; ++q)
            for (int64_t c = 0; c < W; ++c) {
                const T v = c < valid ? b[q * n + j + c] : T(NAN);
                strip[q * W + c] = abs_b && v < T(0) ? -v : v;
            }
    } else if (!abs_b) {
        for (int64_t q = 0; q < k; ++q) std::memcpy(&strip[q * W], b + q * n + j, W * sizeof(T));
    } else {
        const V zero = V{} + T(0);
        for (int64_t q = 0; q < k; ++q)
            for (int c = 0; c < C; ++c) {
                const V v = load<V>(b + q * n + j + c * L);
                store(&strip[q * W + c * L], v < zero ? -v : v);
            }
    }
    if (bounds) {
        bounds->resize(k + W);
        strip_bounds(strip.data(), C, k, bounds->data(), bounds->data() + k);
    }
}

// Pack columns [j, j + W) of a signed pair x (k x n, strides xqs per q and xjs per column,
// any layout) into the k x 2W `strip`: per q, W entries of xhi then W of xlo, both NaN where
// the entry is empty (xhi < xlo) or a padding column (j + c >= n); with the strip's pruning
// bounds bx and dead (see strip_bounds).
template <typename T>
void pack_pair(const T* xh, const T* xl, int64_t xqs, int64_t xjs, int64_t k, int64_t n,
               int64_t j, T* strip, T* bx, T* dead) {
    constexpr int W = C * Vec<T>::lanes;
    constexpr int64_t QB = 32;  // q block: its part of the strip (QB x 2W) stays in L1
    const T nan = __builtin_nan("");
    for (int64_t q0 = 0; q0 < k; q0 += QB) {
        const int64_t q1 = std::min(k, q0 + QB);
        for (int64_t c = 0; c < W; ++c) {
            T* out = strip + c;
            const bool pad = j + c >= n;
            const T* h = xh + (pad ? 0 : (j + c) * xjs);
            const T* l = xl + (pad ? 0 : (j + c) * xjs);
            for (int64_t q = q0; q < q1; ++q) {
                const T vh = pad ? nan : h[q * xqs], vl = pad ? nan : l[q * xqs];
                const bool empty = vh < vl;
                out[q * 2 * W] = empty ? nan : vh;
                out[q * 2 * W + W] = empty ? nan : vl;
            }
        }
    }
    strip_bounds(strip, 2 * C, k, bx, dead);
}

// Run body(bt, cb, scratch) for every batch bt in [b0, b1) and column block cb in [c0, c1):
// on `threads` OpenMP threads when built with OpenMP, each with its own `Local` scratch. The
// library then shares the OpenMP runtime torch already loaded (same soname), so the team is
// torch's own intra-op threads, not a second pool competing with them for the cores.
struct Scratch {
    Buffer<float> f32[2];
    Buffer<double> f64[2];
    Buffer<float>* get(float*) { return f32; }
    Buffer<double>* get(double*) { return f64; }
};

template <typename Local = Scratch, typename Body>
void for_blocks(int64_t b0, int64_t b1, int64_t c0, int64_t c1, int threads, Body body) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Local scratch;
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = b0; bt < b1; ++bt)
            for (int64_t cb = c0; cb < c1; ++cb) body(bt, cb, scratch);
    }
#else
    (void)threads;
    Local scratch;
    for (int64_t bt = b0; bt < b1; ++bt)
        for (int64_t cb = c0; cb < c1; ++cb) body(bt, cb, scratch);
#endif
}

// Whether entries [0, count) of x are all finite (one pass on the calling thread).
template <typename T>
bool finite_entries(const T* x, int64_t count) {
    const T largest = std::numeric_limits<T>::max();
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < count; ++i) bad |= !(x[i] >= -largest && x[i] <= largest);
    return !bad;
}

// Whether the first `valid` columns of a packed k x W strip (the others are padding) are
// all finite.
template <typename T>
bool finite_strip(const T* strip, int64_t k, int64_t valid) {
    constexpr int W = C * Vec<T>::lanes;
    if (valid >= W) return finite_entries(strip, k * W);
    for (int64_t q = 0; q < k; ++q)
        if (!finite_entries(strip + q * W, valid)) return false;
    return true;
}

// Up to this many rows (a prompt's tokens), max_times reads b along its rows, once, in
// chunks of at most STREAM_COLUMNS columns (stream_rows), instead of packing column strips:
// with so few rows the product is bound by reading b, and a strip gathers 32 columns from
// every row of b. With fewer chunks than threads, each thread takes a share of b's rows
// (whole rows, read in order) into a product of its own, and the shares' maxima are joined.
constexpr int64_t STREAM_ROWS = 8, STREAM_COLUMNS = 1024;

// Columns [j0, j0 + width) of out[i, :] = max(init, max_q a[i, q] · b'[q, :]) over the
// `count` indices q from a and b on, for M rows of a (row stride lda) and b' = b (|b| when
// abs_b, row stride ldb), out row stride ldo; *bad set where an entry of b read is NaN or
// infinite (x - x is 0 for every finite x, NaN otherwise). The same products and maxima as
// max_block. A partial last vector reads 0 past width and writes out's columns there: out
// has room up to the next multiple of the lanes (its padding, left unspecified).
template <typename T, int M>
void stream_rows(const T* a, int64_t lda, int64_t count, const T* b, int64_t ldb, T* out,
                 int64_t ldo, int64_t j0, int64_t width, T init, int abs_b, bool* bad) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const int64_t vectors = (width + L - 1) / L;
    for (int i = 0; i < M; ++i)
        for (int64_t j = 0; j < width; ++j) out[i * ldo + j0 + j] = init;
    V seen = V{} + T(0);
    for (int64_t q = 0; q < count; ++q) {
        const T* row = b + q * ldb + j0;
        T s[M];
        for (int i = 0; i < M; ++i) s[i] = a[i * lda + q];
        for (int64_t v = 0; v < vectors; ++v) {
            V x = load_part<T>(row + v * L, width - v * L);
            if (abs_b) x = x < T(0) ? -x : x;
            seen += x - x;
            for (int i = 0; i < M; ++i) {
                T* o = out + i * ldo + j0 + v * L;
                store(o, vmax(x * s[i], load<V>(o)));
            }
        }
    }
    if (!finite_lanes<T>(seen)) *bad = true;
}

// stream_rows for m ≤ STREAM_ROWS rows.
template <typename T, int M = STREAM_ROWS>
void stream_rows_m(int64_t m, const T* a, int64_t lda, int64_t count, const T* b, int64_t ldb,
                   T* out, int64_t ldo, int64_t j0, int64_t width, T init, int abs_b, bool* bad) {
    if constexpr (M > 1)
        if (m < M)
            return stream_rows_m<T, M - 1>(m, a, lda, count, b, ldb, out, ldo, j0, width, init,
                                           abs_b, bad);
    stream_rows<T, M>(a, lda, count, b, ldb, out, ldo, j0, width, init, abs_b, bad);
}

// max_times of at most STREAM_ROWS rows (see there), across threads by chunks of columns or
// by shares of b's rows.
template <typename T>
void max_times_streamed(const T* a, const T* b, T* out, int64_t m, int64_t k, int64_t n,
                        int64_t b0, int64_t b1, T init, int abs_b, int threads, int* nonfinite,
                        int64_t n_real) {
    if (nonfinite && !finite_entries(a + b0 * m * k, (b1 - b0) * m * k)) {
        *nonfinite = 1;
        return;
    }
    const int64_t chunks = (n_real + STREAM_COLUMNS - 1) / STREAM_COLUMNS;
    const int64_t shares =
        chunks * (b1 - b0) < threads ? std::max<int64_t>(1, std::min<int64_t>(threads, k)) : 1;
    // the product of share s > 0 of batch entry bt: at partial + ((s - 1) · batch + bt) · m · n
    std::vector<T> partial((shares - 1) * (b1 - b0) * m * n);
    for_blocks(b0, b1, 0, chunks * shares, threads, [&](int64_t bt, int64_t task, Scratch&) {
        if (nonfinite && __atomic_load_n(nonfinite, __ATOMIC_RELAXED)) return;
        const int64_t ch = task / shares, share = task % shares;
        const int64_t q0 = k * share / shares, q1 = k * (share + 1) / shares;
        const int64_t j0 = ch * STREAM_COLUMNS, width = std::min(STREAM_COLUMNS, n_real - j0);
        T* target = share == 0 ? out + bt * m * n
                               : &partial[((share - 1) * (b1 - b0) + bt - b0) * m * n];
        bool bad = false;
        stream_rows_m<T>(m, a + bt * m * k + q0, k, q1 - q0, b + (bt * k + q0) * n_real, n_real,
                         target, n, j0, width, init, abs_b, &bad);
        if (bad && nonfinite) __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
    });
    for (int64_t share = 1; share < shares; ++share)
        for (int64_t bt = b0; bt < b1; ++bt) {
            const T* p = &partial[((share - 1) * (b1 - b0) + bt - b0) * m * n];
            for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < n_real; ++j) {
                    T& o = out[(bt * m + i) * n + j];
                    o = p[i * n + j] > o ? p[i * n + j] : o;
                }
        }
}

// max_times on contiguous a (batch, m, k) and b (batch, k, n_real) into out (batch, m, n),
// n a multiple of the block width (the columns from n_real on unspecified), see above.
// Given `nonfinite`, the operands' entries are tested too (b's as they are packed or
// streamed; a's by the task of each a[bt]'s first column block, or before streaming):
// where one is NaN or infinite, *nonfinite is set to 1, the tasks still to run return at
// once, and out is left unspecified (the operator fills it with NaN; the caller takes its
// torch formula).
template <typename T>
void max_times(const T* a, const T* b, T* out, int64_t m, int64_t k, int64_t n, int64_t b0,
               int64_t b1, int64_t c0, int64_t c1, T init, int abs_b, int threads,
               int* nonfinite, int64_t n_real) {
    constexpr int W = C * Vec<T>::lanes;
    if (m <= STREAM_ROWS && c0 == 0 && c1 * W == n) {
        max_times_streamed(a, b, out, m, k, n, b0, b1, init, abs_b, threads, nonfinite, n_real);
        return;
    }
    for_blocks(b0, b1, c0, c1, threads, [&](int64_t bt, int64_t cb, Scratch& scratch) {
        if (nonfinite && __atomic_load_n(nonfinite, __ATOMIC_RELAXED)) return;
        Buffer<T>* buffers = scratch.get(static_cast<T*>(nullptr));
        const T* ab = a + bt * m * k;
        T* ob = out + bt * m * n;
        const int64_t j = cb * W;
        pack(b + bt * k * n_real, k, n_real, j, buffers[0], &buffers[1], abs_b);
        if (nonfinite && !(finite_strip(buffers[0].data(), k, n_real - j) &&
                           (cb != c0 || finite_entries(ab, m * k)))) {
            __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
            return;
        }
        const T* dead = buffers[1].data() + k;
        for (int64_t q0 = 0; q0 < k; q0 += KC) {
            const int64_t kc = std::min(KC, k - q0);
            const T *sb = buffers[0].data() + q0 * W, *bb = buffers[1].data() + q0;
            int64_t i = 0;
            for (; i + ROWS <= m; i += ROWS)
                max_block<T, ROWS>(ab + i * k + q0, k, sb, bb, dead, ob + i * n + j, n, kc,
                                   init, q0);
            for (; i < m; ++i)
                max_block<T, 1>(ab + i * k + q0, k, sb, bb, dead, ob + i * n + j, n, kc, init,
                                q0);
        }
    });
}

template <typename T, bool POINT>
void signed_times(const T* ahi, const T* alo, const T* bhi, const T* blo, T* hi, T* lo,
                  int64_t m, int64_t k, int64_t n, int64_t b0, int64_t b1, int64_t c0,
                  int64_t c1, int threads) {
    constexpr int W = C * Vec<T>::lanes;
    for_blocks(b0, b1, c0, c1, threads, [&](int64_t bt, int64_t cb, Scratch& scratch) {
        Buffer<T>* strips = scratch.get(static_cast<T*>(nullptr));
        const int64_t ao = bt * m * k, bo = bt * k * n, oo = bt * m * n;
        const int64_t j = cb * W;
        pack<T>(bhi + bo, k, n, j, strips[0], nullptr, false);
        if (!POINT) pack<T>(blo + bo, k, n, j, strips[1], nullptr, false);
        for (int64_t q0 = 0; q0 < k; q0 += KC) {
            const int64_t kc = std::min(KC, k - q0);
            const T* sh = strips[0].data() + q0 * W;
            const T* sl = POINT ? nullptr : strips[1].data() + q0 * W;
            int64_t i = 0;
            for (; i + ROWS <= m; i += ROWS) {
                const int64_t x = ao + i * k + q0, o = oo + i * n + j;
                signed_block<T, ROWS, POINT>(ahi + x, alo + x, k, sh, sl, hi + o, lo + o, n, kc,
                                             q0);
            }
            for (; i < m; ++i) {
                const int64_t x = ao + i * k + q0, o = oo + i * n + j;
                signed_block<T, 1, POINT>(ahi + x, alo + x, k, sh, sl, hi + o, lo + o, n, kc,
                                          q0);
            }
        }
    });
}

// Layout of the point entries lift_prep writes: group g (rows i0 + g·ROWS ..) starts at
// g·GROUP_STRIDE in ps, pa and flip. The padding (16 entries) keeps the groups' lines in
// different L1 sets: lift_prep stores to every group per q, and unpadded strides (powers of
// two) would map all of them onto a few sets.
constexpr int64_t GROUP_STRIDE = ROWS * KC_LIFT + 16;

// The point entries of rows [i0, i1) of p for one k block (kc ≤ KC_LIFT entries from p's
// column q0, `p` pointing there), as lift_block reads them: per group of ROWS rows (fewer
// in the last), q-major (ps[g·GROUP_STRIDE + q·rows + r]), 0 as NaN when ZERO_EMPTY; the
// same layout for their magnitudes pa (NaN as 0: the pruning bounds) and flips (0 when
// positive, else W). Reads along p's rows (q outer), so that a contiguous p streams in
// order.
template <typename T, bool ZERO_EMPTY>
void lift_prep(const T* p, int64_t prs, int64_t pqs, int64_t i0, int64_t i1, int64_t kc,
               T* __restrict ps, T* __restrict pa, int32_t* __restrict flip) {
    typedef T V __attribute__((vector_size(ROWS * sizeof(T))));
    typedef int32_t I __attribute__((vector_size(ROWS * sizeof(int32_t))));
    constexpr int W = C * Vec<T>::lanes;
    const V zero = V{} + T(0), nan = V{} + T(__builtin_nan(""));
    const T nan1 = __builtin_nan("");
    const int64_t whole = prs == 1 ? i0 + (i1 - i0) / ROWS * ROWS : i0;
    for (int64_t q = 0; q < kc; ++q) {
        const T* row = p + q * pqs;
        for (int64_t i = i0; i < whole; i += ROWS) {
            const int64_t at = (i - i0) / ROWS * GROUP_STRIDE + q * ROWS;
            const V v = load<V>(row + i), a = v < zero ? -v : v;
            store(ps + at, ZERO_EMPTY ? (v == zero ? nan : v) : v);
            store(pa + at, a > zero ? a : zero);  // NaN loses
            store(flip + at, __builtin_convertvector(v > zero, I) ? I{} : I{} + W);
        }
        for (int64_t i = whole; i < i1; i += ROWS) {
            const int64_t rows = std::min<int64_t>(ROWS, i1 - i);
            for (int64_t r = 0; r < rows; ++r) {
                const T s = row[(i + r) * prs], a = s < T(0) ? -s : s;
                const int64_t at = (i - i0) / ROWS * GROUP_STRIDE + q * rows + r;
                ps[at] = ZERO_EMPTY && s == T(0) ? nan1 : s;
                pa[at] = a > T(0) ? a : T(0);
                flip[at] = s > T(0) ? 0 : W;
            }
        }
    }
}

// hi/lo[bt, j, i] = the signed matmul of lift(p) (batch, m, k) and the pair x (batch, k, n)
// at [i, j], for the batches in [b0, b1) and x's column blocks in [c0, c1): the product
// transposed, out contiguous (batch, n, m), which is x^T ⊗ lift(p^T), the backward of a
// matmul by a real matrix. p and x are read through strides (a batch stride of 0
// broadcasts). x is packed once; a task is a chunk of p's rows, whose entries it reads once
// per k block (lift(0) as NaN when zero_empty) and runs against every column block, so a
// strip block stays in L1 while all the chunk's rows use it; the chunk's results collect in
// `scratch` and are written out transposed at the end.
template <typename T>
void lift_times(const T* p, int64_t pbs, int64_t prs, int64_t pqs, const T* xh, const T* xl,
                int64_t xbs, int64_t xqs, int64_t xjs, T* hi, T* lo, int64_t m, int64_t k,
                int64_t n, int64_t b0, int64_t b1, int64_t c0, int64_t c1, int zero_empty,
                int threads) {
    constexpr int W = C * Vec<T>::lanes;
    const int64_t blocks = c1 - c0, strip_size = k * 2 * W;
    // one chunk of rows per thread (the reads of p's entries then run along long rows),
    // at most MAX_CHUNK rows so that a chunk's entries for one k block stay in L2
    // and at most what keeps its results (chunk x blocks x W, twice) within SCRATCH entries
    const int64_t per_batch = std::max<int64_t>(1, (threads + b1 - b0 - 1) / (b1 - b0));
    // results' row stride, a line longer than the row: the transposed write-out reads
    // columns, which a power-of-two stride would map onto a few cache sets
    const int64_t ldo = blocks * W + 64 / sizeof(T);
    int64_t chunk = (m + per_batch - 1) / per_batch;
    chunk = std::min({MAX_CHUNK, std::max<int64_t>(ROWS, SCRATCH / ldo / ROWS * ROWS),
                      (chunk + ROWS - 1) / ROWS * ROWS});
    const int64_t chunks = (m + chunk - 1) / chunk;
    Buffer<T> strips((b1 - b0) * blocks * strip_size), bx((b1 - b0) * blocks * k),
        dead((b1 - b0) * blocks * W);
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = b0; bt < b1; ++bt)
            for (int64_t cb = c0; cb < c1; ++cb) {
                const int64_t s = (bt - b0) * blocks + cb - c0;
                pack_pair(xh + bt * xbs, xl + bt * xbs, xqs, xjs, k, n, cb * W,
                          strips.data() + s * strip_size, bx.data() + s * k,
                          dead.data() + s * W);
            }
        const int64_t groups = (chunk + ROWS - 1) / ROWS;
        Buffer<T> ps(groups * GROUP_STRIDE), pa(groups * GROUP_STRIDE), scratch(2 * chunk * ldo);
        std::vector<int32_t> flip(groups * GROUP_STRIDE);
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = b0; bt < b1; ++bt)
            for (int64_t h = 0; h < chunks; ++h) {
                const int64_t i0 = h * chunk, i1 = std::min(m, i0 + chunk);
                for (int64_t q0 = 0; q0 < k; q0 += KC_LIFT) {
                    const int64_t kc = std::min(KC_LIFT, k - q0);
                    const T* src = p + bt * pbs + q0 * pqs;
                    if (zero_empty)
                        lift_prep<T, true>(src, prs, pqs, i0, i1, kc, ps.data(), pa.data(),
                                           flip.data());
                    else
                        lift_prep<T, false>(src, prs, pqs, i0, i1, kc, ps.data(), pa.data(),
                                            flip.data());
                    for (int64_t cb = c0; cb < c1; ++cb) {
                        const int64_t s = (bt - b0) * blocks + cb - c0;
                        const T* sb = strips.data() + s * strip_size + q0 * 2 * W;
                        const T *bxs = bx.data() + s * k + q0, *ds = dead.data() + s * W;
                        for (int64_t i = i0; i < i1; i += ROWS) {
                            const int rows = static_cast<int>(std::min<int64_t>(ROWS, i1 - i));
                            const int64_t at = (i - i0) / ROWS * GROUP_STRIDE;
                            T* h_out = scratch.data() + (i - i0) * ldo + (cb - c0) * W;
                            T* l_out = h_out + chunk * ldo;
                            if (rows == ROWS)
                                lift_block<T, ROWS>(ps.data() + at, pa.data() + at,
                                                    flip.data() + at, ROWS, sb, bxs, ds, h_out,
                                                    l_out, ldo, kc, q0);
                            else
                                for (int r = 0; r < rows; ++r)
                                    lift_block<T, 1>(ps.data() + at + r, pa.data() + at + r,
                                                     flip.data() + at + r, rows, sb, bxs, ds,
                                                     h_out + r * ldo, l_out + r * ldo, ldo, kc,
                                                     q0);
                        }
                    }
                }
                const int64_t j1 = std::min(n, c1 * W);
                for (int64_t j = c0 * W; j < j1; ++j) {
                    const T* h_in = scratch.data() + j - c0 * W;
                    T* h_out = hi + (bt * n + j) * m;
                    T* l_out = lo + (bt * n + j) * m;
                    for (int64_t i = i0; i < i1; ++i) {
                        h_out[i] = h_in[(i - i0) * ldo];
                        l_out[i] = h_in[(chunk + i - i0) * ldo];
                    }
                }
            }
    }
}

// lift_times for small problems, its terms in its order without packing, pruning or
// scratch: hi/lo[bt, i, j] over q ascending of the pair x[bt, i, q] (strides xbs, xis, xqs;
// empty where xhi < xlo) times the point p[bt, q, j] (strides pbs, pqs, and 1 along j;
// NaN at 0 when zero_empty), an end replaced only by a product beyond it (ties and NaN
// products keep it), so every bit equals lift_times'; out contiguous (batch, m, n).
template <typename T>
void lift_times_direct(const T* p, int64_t pbs, int64_t pqs, const T* xh, const T* xl,
                       int64_t xbs, int64_t xis, int64_t xqs, T* hi, T* lo, int64_t batch,
                       int64_t m, int64_t k, int64_t n, bool zero_empty) {
    const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
    for (int64_t bt = 0; bt < batch; ++bt)
        for (int64_t i = 0; i < m; ++i) {
            T* __restrict h_out = hi + (bt * m + i) * n;
            T* __restrict l_out = lo + (bt * m + i) * n;
            std::fill(h_out, h_out + n, -inf);
            std::fill(l_out, l_out + n, inf);
            for (int64_t q = 0; q < k; ++q) {
                const int64_t at = bt * xbs + i * xis + q * xqs;
                const T h = xh[at], l = xl[at];
                if (h < l) continue;  // an empty entry
                const T* __restrict ps = p + bt * pbs + q * pqs;
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) {
                    const T s = zero_empty && ps[j] == T(0) ? nan : ps[j];
                    const bool positive = s > T(0);
                    const T top = (positive ? h : l) * s, bottom = (positive ? l : h) * s;
                    h_out[j] = top > h_out[j] ? top : h_out[j];
                    l_out[j] = bottom < l_out[j] ? bottom : l_out[j];
                }
            }
        }
}

// (hi, lo) = (ahi, alo) ⊗ lift(w) elementwise, for `count` contiguous entries: w > 0 keeps
// the pair's order, w < 0 swaps it, w = 0 is no edge (-inf, +inf); an empty pair
// (-inf, +inf) stays empty. One pass, where torch needs eight (and its select is slow).
template <typename T>
void signed_mul_lift(const T* ah, const T* al, const T* w, T* hi, T* lo, int64_t count,
                     int threads) {
    const T inf = __builtin_inf();
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
    for (int64_t i = 0; i < count; ++i) {
        const T x = w[i], h = ah[i], l = al[i];
        // w = 0 is no edge, except from a NaN value (NaN ⊗ lift(0) is NaN, as in torch)
        const bool pos = x > T(0), none = x == T(0) && h == h && l == l;
        hi[i] = none ? -inf : (pos ? h : l) * x;
        lo[i] = none ? inf : (pos ? l : h) * x;
    }
}

// Natural logarithm of a finite x > 0, vectorisable (no calls, no branches): x = 2^e·m with
// m in [√½, √2), and log m = 2·atanh(s) = 2s·(1 + s²/3 + s⁴/5 + …) for s = (m-1)/(m+1),
// |s| < 0.172, so s² < 0.0295 and the series stops where its next term falls below the
// format's rounding (4 terms for float, 9 for double; error under 2 ulp, measured).
// e·ln 2 is added in two parts, the first exact in e. Subnormal x is scaled into the
// normal range first.
template <typename T>
struct LogParts;

template <>
struct LogParts<float> {
    typedef int32_t I;
    static constexpr int mantissa = 23, bias = 127, terms = 4;
    static constexpr float ln2_hi = 0.693145751953125f, ln2_lo = 1.4286068203094173e-06f;
};

template <>
struct LogParts<double> {
    typedef int64_t I;
    static constexpr int mantissa = 52, bias = 1023, terms = 9;
    static constexpr double ln2_hi = 0.6931471824645996, ln2_lo = -1.904654299957768e-09;
};

template <typename T>
inline T log_positive(T x) {
    typedef LogParts<T> P;
    typedef typename P::I I;
    const bool subnormal = x < std::numeric_limits<T>::min();
    const T scale = T(I(1) << (P::mantissa + 1));
    x = subnormal ? x * scale : x;
    I bits;
    std::memcpy(&bits, &x, sizeof bits);
    const I fraction = bits & ((I(1) << P::mantissa) - 1);
    const I above = fraction > I(T(0.41421356237309503) * T(I(1) << P::mantissa));  // m ≥ √2
    const I e = (bits >> P::mantissa) - P::bias + above - (subnormal ? P::mantissa + 1 : 0);
    const I mbits = fraction | ((P::bias - above) << P::mantissa);
    T m;
    std::memcpy(&m, &mbits, sizeof m);
    const T s = (m - T(1)) / (m + T(1)), s2 = s * s;
    T series = T(1) / T(2 * P::terms + 1);
#pragma GCC unroll 16
    for (int i = P::terms - 1; i >= 1; --i) series = series * s2 + T(1) / T(2 * i + 1);
    const T two_s = s + s;
    return T(e) * P::ln2_hi + (T(e) * P::ln2_lo + (two_s + two_s * s2 * series));
}

// 1/i! (folded to a constant where i is one).
constexpr double inverse_factorial(int i) { return i <= 1 ? 1.0 : inverse_factorial(i - 1) / i; }

// e^x for x ≤ 0, vectorisable: x = k·ln 2 + f with k an integer and |f| ≤ ln2/2, e^f by its
// Taylor polynomial (degree 7 for float, 13 for double, cut where the next term falls below
// the rounding) in Horner form, 2^k put into the exponent bits. Below the normal range the
// result is subnormal, as torch.exp's (2^k applied in two steps, the second rounding once);
// below half the smallest subnormal, and for -inf, it is 0. x must not be NaN.
template <typename T>
inline T exp_nonpositive(T x) {
    typedef LogParts<T> P;
    typedef typename P::I I;
    constexpr int terms = sizeof(T) == 4 ? 7 : 13;
    const T shifter = T(1.5) * T(I(1) << P::mantissa);  // adding it rounds to an integer
    const T lowest = -T(P::bias + P::mantissa) * T(0.6931471805599453);  // e^x < 2^-(min+1)
    const bool under = x < lowest;
    const T xs = under ? T(0) : x;
    const T kf = (xs * T(1.4426950408889634) + shifter) - shifter;
    const T f = (xs - kf * P::ln2_hi) - kf * P::ln2_lo;
    T series = T(inverse_factorial(terms));
#pragma GCC unroll 16
    for (int i = terms - 1; i >= 0; --i) series = series * f + T(inverse_factorial(i));
    const bool deep = kf < T(1 - P::bias);  // 2^k itself below the normal range
    const I bits = (static_cast<I>(deep ? kf + T(64) : kf) + P::bias) << P::mantissa;
    T scale;
    std::memcpy(&scale, &bits, sizeof scale);
    const T value = series * scale;
    return under ? T(0) : deep ? value * T(5.421010862427522e-20) : value;  // · 2^-64
}

#if defined(__AVX512F__)
// log|x| of 16 floats: |x| = 2^e·m with m in [0.75, 1.5) by getexp and getmant (exact,
// subnormals included), log m = f − f²/2 + f³·g(f) for f = m − 1, g a degree-8 polynomial
// fitted to (log(1 + f) − f + f²/2) / f³ on [−0.25, 0.5] (relative error 7e-8), e·ln 2 added
// in two parts. Within 1 ulp of the true logarithm for every positive float (0.93 at most,
// checked against double over all of them); the instructions carry the specials through:
// -inf at 0, +inf at inf, NaN at NaN. Twice as fast as the series in log_positive.
inline __m512 log_abs16(__m512 x) {
    static constexpr float g[9] = {
        0.33333333021489187f,  -0.25000056099380041f, 0.20000172025670782f,
        -0.16660911586043123f, 0.14267211181705788f,  -0.12635526392208918f,
        0.11688433855124182f,  -0.096023289206834658f, 0.043264014141404218f};
    const __m512 one = _mm512_set1_ps(1.0f), a = _mm512_abs_ps(x);
    const __m512 m = _mm512_getmant_ps(a, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
    const __mmask16 halved = _mm512_cmp_ps_mask(m, one, _CMP_LT_OQ);  // m = mantissa / 2
    const __m512 e = _mm512_mask_add_ps(_mm512_getexp_ps(a), halved, _mm512_getexp_ps(a), one);
    const __m512 f = _mm512_sub_ps(m, one);
    __m512 p = _mm512_set1_ps(g[8]);
    for (int i = 7; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(g[i]));
    const __m512 tail =
        _mm512_mul_ps(_mm512_mul_ps(f, f), _mm512_fmsub_ps(f, p, _mm512_set1_ps(0.5f)));
    const __m512 low =
        _mm512_fmadd_ps(e, _mm512_set1_ps(LogParts<float>::ln2_lo), _mm512_add_ps(f, tail));
    return _mm512_fmadd_ps(e, _mm512_set1_ps(LogParts<float>::ln2_hi), low);
}

// exp_nonpositive for 16 floats: the same reduction and Taylor polynomial, 2^k applied by
// scalef (subnormal results included, rounded once); 0 below half the smallest subnormal
// and at -inf. x must not be NaN.
inline __m512 exp16_nonpositive(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-150 * 0.6931471805599453f),
                                               _CMP_LT_OQ);
    const __m512 xs = _mm512_maskz_mov_ps(~under, x);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xs, _mm512_set1_ps(1.4426950408889634f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(LogParts<float>::ln2_hi), xs);
    f = _mm512_fnmadd_ps(k, _mm512_set1_ps(LogParts<float>::ln2_lo), f);
    __m512 p = _mm512_set1_ps(float(inverse_factorial(7)));
    for (int i = 6; i >= 0; --i)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(float(inverse_factorial(i))));
    return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, k));
}

// log(e^x + e^y) of 16 floats: big + log(1 + t) with t = e^(small - big), the rounding of
// u = 1 + t corrected; -inf for two -inf, +inf where either is +inf, NaN where either is
// NaN. With its parts t, u and the lanes where x is the big one (x >= y), which the Entropy
// ⊕ weighs its r by. The Log ⊕ (log_entries.h) and the Entropy ⊕ share it.
struct LogAdd16 {
    __m512 sum, t, u;
    __mmask16 x_big;
};

inline LogAdd16 log_add16(__m512 x, __m512 y) {
    const __m512 one = _mm512_set1_ps(1.0f), none = _mm512_set1_ps(-__builtin_inff());
    const __mmask16 x_big = _mm512_cmp_ps_mask(x, y, _CMP_GE_OQ);
    const __m512 big = _mm512_mask_blend_ps(x_big, y, x);
    const __m512 small = _mm512_mask_blend_ps(x_big, x, y);
    __m512 d = _mm512_sub_ps(small, big);  // <= 0; NaN for two equal infinities or a NaN
    d = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, d, _CMP_ORD_Q), none, d);
    const __m512 t = exp16_nonpositive(d), u = _mm512_add_ps(one, t);
    const __m512 fix = _mm512_div_ps(_mm512_sub_ps(_mm512_sub_ps(u, one), t), u);
    const __m512 log1p = _mm512_sub_ps(log_abs16(u), fix);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, y, _CMP_UNORD_Q);
    const __m512 sum = _mm512_mask_blend_ps(nan, _mm512_add_ps(big, log1p), _mm512_add_ps(x, y));
    return {sum, t, u, x_big};
}
#endif

// The Entropy ⊕ of (la, ra) and (lb, rb), elementwise: la ⊕ lb = big + log(1 + t) with
// t = e^(small - big), and r = (r_big + t·r_small) / (1 + t), the Z-weighted mean. Both -inf
// gives (-inf, 0) (r is 0 there by convention); a NaN gives a NaN log Z.
template <typename T>
inline void entropy_add_entry(T a, T ra, T b, T rb, T* lo, T* ro) {
    const T inf = __builtin_inf();
    const bool a_big = a >= b;
    const T big = a_big ? a : b, small = a_big ? b : a;
    const T r_big = a_big ? ra : rb, r_small = a_big ? rb : ra;
    const T d = small - big;  // ≤ 0; NaN when both are -inf or +inf, or for a NaN
    const T t = exp_nonpositive(d == d ? d : -inf);
    const T u = T(1) + t;
    // log(1 + t) with the rounding of 1 + t corrected: log u - ((u - 1) - t) / u
    const T log1p = log_positive(u) - ((u - T(1)) - t) / u;
    const bool nan = (a != a) | (b != b);
    const T sum = nan ? a + b : big + log1p, mean = (r_big + t * r_small) / u;
    *lo = sum;
    *ro = sum == -inf ? T(0) : mean;
}

// The Entropy ⊕ entry by entry over [0, count), in the calling thread: (lo, ro) = (la, ra) ⊕
// (lb, rb); the outputs may be either operand, entry for entry (in place).
template <typename T>
inline void entropy_add_span(const T* la, const T* ra, const T* lb, const T* rb, T* lo, T* ro,
                             int64_t count) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // entropy_add_entry, 16 entries at a time
        const __m512 none = _mm512_set1_ps(-__builtin_inff());
        for (; i + 16 <= count; i += 16) {
            const LogAdd16 s = log_add16(_mm512_loadu_ps(la + i), _mm512_loadu_ps(lb + i));
            const __m512 r_a = _mm512_loadu_ps(ra + i), r_b = _mm512_loadu_ps(rb + i);
            const __m512 r_big = _mm512_mask_blend_ps(s.x_big, r_b, r_a);
            const __m512 r_small = _mm512_mask_blend_ps(s.x_big, r_a, r_b);
            const __m512 mean = _mm512_div_ps(_mm512_fmadd_ps(s.t, r_small, r_big), s.u);
            _mm512_storeu_ps(lo + i, s.sum);
            const __mmask16 path = _mm512_cmp_ps_mask(s.sum, none, _CMP_NEQ_UQ);
            _mm512_storeu_ps(ro + i, _mm512_maskz_mov_ps(path, mean));
        }
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < count; ++j)
        entropy_add_entry(la[j], ra[j], lb[j], rb[j], lo + j, ro + j);
}

// The elementwise ⊕ kernels over rows (entropy_add_rows here, log_add_rows in
// log_entries.h) hand the threads pieces of this many entries, so that a few long rows
// still spread over them.
constexpr int64_t ADD_PIECE = int64_t(1) << 12;

// A row operand of the ⊕ kernels: entries at data + row·stride + j (stride 0: one row read
// by every row).
template <typename T>
struct Rows {
    T* data;
    int64_t stride;
    T* row(int64_t r) const { return data + r * stride; }
};

// The Entropy ⊕ along rows of n entries: (lo, ro) = (la, ra) ⊕ (lb, rb), each (rows, n)
// with unit stride along n and a row stride of its own; lo and ro may be la and ra, or lb
// and rb, entry for entry (in place).
template <typename T>
void entropy_add_rows(Rows<const T> la, Rows<const T> ra, Rows<const T> lb, Rows<const T> rb,
                      Rows<T> lo, Rows<T> ro, int64_t rows, int64_t n, int threads) {
    (void)threads;
    const int64_t pieces = (n + ADD_PIECE - 1) / ADD_PIECE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t task = 0; task < rows * pieces; ++task) {
        const int64_t r = task / pieces, at = (task % pieces) * ADD_PIECE;
        entropy_add_span(la.row(r) + at, ra.row(r) + at, lb.row(r) + at, rb.row(r) + at,
                         lo.row(r) + at, ro.row(r) + at, std::min(ADD_PIECE, n - at));
    }
}

// num / den where den > 0, else 0 (a sum without terms: 0/0), in place on num, elementwise.
// A NaN in num stays where den > 0.
template <typename T>
void ratio_where_positive(T* num, const T* den, int64_t count, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
    for (int64_t i = 0; i < count; ++i) {
        const T q = num[i] / den[i];
        num[i] = den[i] > T(0) ? q : T(0);
    }
}

// The scan that chooses a path: whether entries [0, count) hold a NaN or an infinity of
// sign `sign` (+1: +inf, -1: -inf, 0: either), a value the NaN-as-no-edge kernels would
// read differently from the torch formulas. One comparison with two bounds per entry.
template <typename T>
bool nan_or_inf(const T* x, int64_t count, int sign, int threads) {
    const T inf = std::numeric_limits<T>::infinity(), largest = std::numeric_limits<T>::max();
    const T low = sign > 0 ? -inf : -largest, high = sign < 0 ? inf : largest;
    int bad = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < count; ++i) bad |= !(x[i] >= low && x[i] <= high);
    return bad;
}

// Whether every row (n entries) of x has a term: its maximum is not `empty`, or, given y,
// the maximum of x - y is not below 0 (a signed pair's hi ≥ lo); a NaN counts as a term,
// as a NaN maximum does. A row's maximum is not `empty` when some entry is above it or NaN,
// or when every entry is below it; the first is what a row with a term usually shows in its
// first entries, so each row is read in chunks and left at the first such entry.
template <typename T>
bool all_rows_live(const T* x, const T* y, int64_t rows, int64_t n, T empty) {
    constexpr int64_t CHUNK = 64;
    for (int64_t row = 0; row < rows; ++row) {
        const T* xr = x + row * n;
        const T* yr = y ? y + row * n : nullptr;
        bool live = false, below = true;
        for (int64_t j0 = 0; j0 < n && !live; j0 += CHUNK) {
            const int64_t j1 = std::min(n, j0 + CHUNK);
            int above = 0, reaches = 0;
            if (yr) {
#pragma omp simd reduction(| : above)
                for (int64_t j = j0; j < j1; ++j) above |= !(xr[j] - yr[j] < T(0));
                reaches = 1;  // a pair's maximum is below 0 only where every entry is
            } else {
#pragma omp simd reduction(| : above, reaches)
                for (int64_t j = j0; j < j1; ++j) {
                    above |= !(xr[j] <= empty);  // above, or NaN
                    reaches |= !(xr[j] < empty);
                }
            }
            live = above;
            below = below && !reaches;
        }
        if (!live && !(below && !yr)) return false;
    }
    return true;
}

// Whether the shifted sums z (rows of n) of a log-space GEMM can be trusted: in every live
// row (live[row]; a row without terms has sums 0, rightly), none below tiny (where products
// may have underflowed; NaN fails too) and, when may_overflow, none +inf.
template <typename T>
bool gemm_exact(const T* z, const bool* live, int64_t rows, int64_t n, T tiny,
                bool may_overflow, int threads) {
    const T inf = std::numeric_limits<T>::infinity();
    int bad = 0;
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static) reduction(| : bad)
    for (int64_t row = 0; row < rows; ++row) {
        if (!live[row]) continue;
        const T* zr = z + row * n;
        int row_bad = 0;
#pragma omp simd reduction(| : row_bad)
        for (int64_t j = 0; j < n; ++j) row_bad |= !(zr[j] >= tiny) | (may_overflow & (zr[j] == inf));
        bad |= row_bad;
    }
    return !bad;
}

// The two GEMM operands of a lifted weight in the Entropy semiring, for entries [i0, i1) of
// w (count entries per batch) in the batches [b0, b1): |w| and |w|·(-log|w|) (0 at w = 0
// and for NaN, whose Z sums are NaN anyway; -inf at |w| = inf), stacked per batch as
// out[bt] = [|w|; -|w|log|w|] (2·count entries).
//
// The elementwise kernels open `parallel` and `for simd` as two constructs: under one combined
// `parallel for simd if (...)`, GCC's serial copy of the loop (threads = 1) is not vectorised
// (measured 3.5x slower).
template <typename T>
inline void entropy_weight_entry(T w, T* mag, T* weighted) {
    const T a = std::fabs(w);
    const bool positive = a > T(0);                 // false at 0 and NaN
    const T l = log_positive(positive ? a : T(1));  // (finite at +inf)
    const T product = -(a * l);
    *mag = a;
    *weighted = positive ? product : T(0);
}

template <typename T>
void entropy_weights(const T* w, T* out, int64_t count, int64_t i0, int64_t i1, int64_t b0,
                     int64_t b1, int threads) {
    (void)threads;
    for (int64_t bt = b0; bt < b1; ++bt) {
        const T* src = w + bt * count;
        T* mag = out + bt * 2 * count;
        T* weighted = mag + count;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>) {
            const int64_t vectors = (i1 - i0) / 16, tail = i0 + 16 * vectors;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
            for (int64_t v = 0; v < vectors; ++v) {
                const int64_t i = i0 + 16 * v;
                const __m512 x = _mm512_loadu_ps(src + i), a = _mm512_abs_ps(x);
                const __mmask16 positive = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
                const __m512 product = _mm512_mul_ps(a, log_abs16(a));
                _mm512_storeu_ps(mag + i, a);
                _mm512_storeu_ps(weighted + i,
                                 _mm512_maskz_sub_ps(positive, _mm512_setzero_ps(), product));
            }
            for (int64_t i = tail; i < i1; ++i)
                entropy_weight_entry(src[i], mag + i, weighted + i);
            continue;
        }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
        for (int64_t i = i0; i < i1; ++i) entropy_weight_entry(src[i], mag + i, weighted + i);
    }
}

// log|w|: -inf at ±0, +inf at ±inf, NaN at NaN (entropy_mul_lift's and log_entries.h's).
template <typename T>
inline T log_abs_entry(T w) {
    const T x = std::fabs(w);
    const bool finite = (x > T(0)) & (x <= std::numeric_limits<T>::max());
    const T l = log_positive(finite ? x : T(1));
    return finite ? l : (x == T(0) ? -T(__builtin_inf()) : x);
}

// The Entropy value (la, r) times lift(w), elementwise: log|w| (-inf at w = 0, +inf at
// |w| = inf, NaN at NaN) is added to la and subtracted from r, and r is 0 where the new la
// is -inf (no path). A NaN in r stays.
template <typename T>
inline void entropy_mul_lift_entry(T la, T r, T w, T* la_out, T* r_out) {
    const T inf = __builtin_inf();
    const T log_w = log_abs_entry(w);
    const T sum = la + log_w, rest = r - log_w;
    *la_out = sum;
    *r_out = sum == -inf ? T(0) : rest;
}

template <typename T>
void entropy_mul_lift(const T* la, const T* r, const T* w, T* la_out, T* r_out, int64_t count,
                      int threads) {
    (void)threads;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
        const int64_t vectors = count / 16;
        const __m512 none = _mm512_set1_ps(-__builtin_inff());
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t v = 0; v < vectors; ++v) {
            const int64_t i = 16 * v;
            const __m512 log_w = log_abs16(_mm512_loadu_ps(w + i));
            const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(la + i), log_w);
            const __m512 rest = _mm512_sub_ps(_mm512_loadu_ps(r + i), log_w);
            const __mmask16 path = _mm512_cmp_ps_mask(sum, none, _CMP_NEQ_UQ);
            _mm512_storeu_ps(la_out + i, sum);
            _mm512_storeu_ps(r_out + i, _mm512_maskz_mov_ps(path, rest));
        }
        for (int64_t i = 16 * vectors; i < count; ++i)
            entropy_mul_lift_entry(la[i], r[i], w[i], la_out + i, r_out + i);
        return;
    }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
#pragma omp for simd schedule(static)
    for (int64_t i = 0; i < count; ++i)
        entropy_mul_lift_entry(la[i], r[i], w[i], la_out + i, r_out + i);
}

// entropy_mul_lift with w broadcast over the value: lw holds log|w| (log_abs_entry) per entry
// of w; row `row` of n entries reads lw[w_at[row] + j * w_step] (rows [0, rows)).
template <typename T>
void entropy_mul_lift_spread(const T* la, const T* r, const T* lw, const int64_t* w_at,
                             int64_t w_step, T* la_out, T* r_out, int64_t n, int64_t rows,
                             int threads) {
    const T none = -T(__builtin_inf());
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t at = row * n;
        const T* lws = lw + w_at[row];
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
            const T l = lws[j * w_step], sum = la[at + j] + l, rest = r[at + j] - l;
            la_out[at + j] = sum;
            r_out[at + j] = sum == none ? T(0) : rest;
        }
    }
}

// log v for a finite v ≥ 0: -inf at 0.
template <typename T>
inline T log_nonnegative(T v) {
    const T l = log_positive(v > T(0) ? v : T(1));
    return v > T(0) ? l : -T(__builtin_inf());
}

// Row sums in the row kernels: vector sums over chunks of this many entries, the chunks'
// sums added in double, so a long row (2^20 entries) keeps float32 sums within a few ulp.
constexpr int64_t SUM_CHUNK = 1024;

// The largest of n entries (-inf for none), and in *nan whether any is NaN.
template <typename T>
inline T row_top(const T* xs, int64_t n, bool* nan) {
    T top = -T(__builtin_inf());
    int any_nan = 0;
#pragma omp simd reduction(max : top) reduction(| : any_nan)
    for (int64_t j = 0; j < n; ++j) {
        const T v = xs[j];
        top = v > top ? v : top;
        any_nan |= v != v;
    }
    *nan = any_nan != 0;
    return top;
}

// The first position of top (the row's largest entry, row_top's, not NaN) in *at, and the
// largest of the other entries (-inf for none).
template <typename T>
inline T row_runner_up(const T* xs, int64_t n, T top, int64_t* at) {
    const T inf = __builtin_inf();
    int64_t first = 0;
    while (xs[first] != top) ++first;
    T second = -inf;
#pragma omp simd reduction(max : second)
    for (int64_t j = 0; j < n; ++j) {
        const T v = j == first ? -inf : xs[j];
        second = v > second ? v : second;
    }
    *at = first;
    return second;
}

// The widest gap between a row's two largest entries over which loo_row sums the argmax's
// others in the frame of the largest: a term it flushes to 0 there (below e^-87 in float,
// e^-708 in double) is then under e^-27 (e^-208) of that sum, the second largest's term.
template <typename T>
constexpr T LOO_SHARED_GAP = std::is_same_v<T, float> ? T(60) : T(500);

// The smallest nonzero probability the softmax messages take in the frame of a row's
// largest term (softmax_linear_row, entropy_softmax_linear_row): their products p·(Σ terms)
// stay normal, and a term e^(t - top) they flush to 0 is below e^-(87 - 44) (float) or
// e^-(708 - 347) (double) of the term p·(Σ_{j≠i} …) beside it.
template <typename T>
constexpr T LINEAR_MIN_P = std::is_same_v<T, float> ? T(0x1p-64) : T(0x1p-500);

// Whether |p| is nonzero and below LINEAR_MIN_P: a row holding one is left to log space.
template <typename T>
inline bool below_linear_min(T p) {
    const T size = p < T(0) ? -p : p;
    return (size > T(0)) & (size < LINEAR_MIN_P<T>);
}

#if defined(__AVX512F__)
// below_linear_min of 16 floats, as lanes.
inline __mmask16 below_linear_min16(__m512 p) {
    const __m512 size = _mm512_abs_ps(p);
    return _mm512_cmp_ps_mask(size, _mm512_setzero_ps(), _CMP_GT_OQ) &
           _mm512_cmp_ps_mask(size, _mm512_set1_ps(LINEAR_MIN_P<float>), _CMP_LT_OQ);
}
#endif

// A row's largest term *top of its n terms t, and in *at the first position of it, where
// the frame of the largest term takes the row: false where t holds NaN or ±inf at its top,
// or its two largest lie more than LOO_SHARED_GAP apart (one term or none: the argmax's sum
// of the others would flush).
template <typename T>
inline bool linear_frame_top(const T* t, int64_t n, T* top, int64_t* at) {
    const T inf = __builtin_inf();
    bool nan;
    *top = row_top(t, n, &nan);
    if (nan || *top == inf || *top == -inf) return false;
    return *top - row_runner_up(t, n, *top, at) <= LOO_SHARED_GAP<T>;
}

// The leave-one-out ⊕ in log space along one row of n contiguous entries xs: ls[i] =
// log Σ_{j≠i} e^{x_j} and, with r (Entropy), qs[i] = Σ_{j≠i} e^{x_j}·r_j / Σ_{j≠i} e^{x_j},
// 0 where that sum is 0. Shifted by the row's maximum, every entry but the (first) argmax
// keeps the maximum's term 1 in its sum, so the total minus its own term loses no
// precision; the argmax sums the others apart: in the same pass and frame where the
// second largest entry is within LOO_SHARED_GAP of the largest, else afresh, shifted by
// the second largest, so a gap between the two never underflows. The argmax's own term
// enters that sum as 0·r, so a NaN or inf r there still shows. A row holding NaN or +inf
// is not computed: false.
template <typename T, bool with_r>
bool loo_row(const T* xs, const T* rs, T* ls, T* qs, int64_t n) {
    const T inf = __builtin_inf();
    bool nan;
    const T top = row_top(xs, n, &nan);
    if (nan || top == inf) return false;
    int64_t at;
    const T second = row_runner_up(xs, n, top, &at);
    const T s1 = top == -inf ? T(0) : top;
    const bool shared = top - second <= LOO_SHARED_GAP<T>;  // false for second = -inf
    double total = 0, total_r = 0, total2 = 0, total2_r = 0;
    for (int64_t c = 0; c < n; c += SUM_CHUNK) {  // chunk sums added in double: long rows
        const int64_t end = std::min(n, c + SUM_CHUNK);
        T part = 0, part_r = 0, part2 = 0, part2_r = 0;
#pragma omp simd reduction(+ : part, part_r, part2, part2_r)
        for (int64_t j = c; j < end; ++j) {
            const T e = exp_nonpositive(xs[j] - s1), e2 = j == at ? T(0) : e;
            ls[j] = e;
            part += e;
            part2 += e2;
            if constexpr (with_r) {
                const T er = e * rs[j];
                qs[j] = er;
                part_r += er;
                part2_r += e2 * rs[j];
            }
        }
        total += part, total_r += part_r, total2 += part2, total2_r += part2_r;
    }
    T s2 = s1;
    if (!shared) {  // the argmax's others afresh, in the second largest's frame
        s2 = second == -inf ? T(0) : second;
        total2 = 0, total2_r = 0;
        for (int64_t c = 0; c < n; c += SUM_CHUNK) {
            const int64_t end = std::min(n, c + SUM_CHUNK);
            T part2 = 0, part2_r = 0;
#pragma omp simd reduction(+ : part2, part2_r)
            for (int64_t j = c; j < end; ++j) {
                const T e2 = exp_nonpositive(j == at ? -inf : xs[j] - s2);
                part2 += e2;
                if constexpr (with_r) part2_r += e2 * rs[j];
            }
            total2 += part2, total2_r += part2_r;
        }
    }
    const T sum = T(total), sum_r = T(total_r), sum2 = T(total2), sum2_r = T(total2_r);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
        const T d = sum - ls[j], den = d > T(0) ? d : T(0);
        ls[j] = log_nonnegative(den) + s1;
        if constexpr (with_r) {
            const T q = (sum_r - qs[j]) / den;
            qs[j] = den > T(0) ? q : T(0);
        }
    }
    ls[at] = log_nonnegative(sum2) + s2;
    if constexpr (with_r) qs[at] = sum2 > T(0) ? sum2_r / sum2 : T(0);
    return true;
}

// loo_row over rows [r0, r1) of x (and r, out_r: Entropy; null for Log); bad[row] = 1 where
// a row was not computed (NaN or +inf in it), else 0.
template <typename T>
void loo_log(const T* x, const T* r, T* out_l, T* out_r, uint8_t* bad, int64_t n, int64_t r0,
             int64_t r1, int threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t row = r0; row < r1; ++row) {
        const int64_t at = row * n;
        const bool done = r ? loo_row<T, true>(x + at, r + at, out_l + at, out_r + at, n)
                            : loo_row<T, false>(x + at, nullptr, out_l + at, nullptr, n);
        bad[row] = !done;
    }
}

// The Entropy value (l, r) times lift(w) given log|w| (lw): (l + lw, r - lw), r = 0 where
// the new l is -inf (no path; a NaN in r stays).
template <typename T>
inline void entropy_times_log(T l, T r, T lw, T* l_out, T* r_out) {
    const T sum = l + lw;
    *l_out = sum;
    *r_out = sum == -T(__builtin_inf()) ? T(0) : r - lw;
}

// Entropy's softmax message along one row in the frame of the row's largest term, for rows
// where that loses nothing (else false): with t_j = (gl_j + log|p_j|, gr_j - log|p_j|) = (l_j,
// r_j) (r_j = 0 where l_j = -inf), top = max l, e_j = e^(l_j - top), D_i = Σ_{j≠i} e_j and
// R_i = Σ_{j≠i} e_j·r_j (the totals less the entry's own term; the argmax's summed apart,
// within LOO_SHARED_GAP of the second largest), the paths through p_i(1 - p_i) weigh
// a_i = e_i·|1 - p_i| and those through -p_j·p_i weigh b_i = D_i·|p_i|, so
// out_l_i = top + log(a_i + b_i) and
// out_r_i = (a_i·(r_i - log|1 - p_i|) + |p_i|·(R_i - D_i·log|p_i|)) / (a_i + b_i),
// 0 where a_i + b_i is 0: three logs and one exp an entry, where the log-space combination
// (loo_row, then ⊗ and ⊕ entry by entry) takes five logs and two exps. Declines a row as
// softmax_linear_row does (a nonzero |p| below LINEAR_MIN_P, a gap over LOO_SHARED_GAP
// between its two largest terms, NaN or ±inf at the top). out_l and out_r may be written
// when it declines; lp: n entries of scratch.
template <typename T>
bool entropy_softmax_linear_row(const T* gl, const T* gr, const T* p, T* out_l, T* out_r,
                                T* lp, int64_t n) {
    const T inf = __builtin_inf();
    int tiny = 0;
    int64_t j0 = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        const __m512 none = _mm512_set1_ps(-__builtin_inff());
        __mmask16 small = 0;
        for (; j0 + 16 <= n; j0 += 16) {
            const __m512 pv = _mm512_loadu_ps(p + j0);
            small |= below_linear_min16(pv);
            const __m512 l = log_abs16(pv), sum = _mm512_add_ps(_mm512_loadu_ps(gl + j0), l);
            const __m512 rest = _mm512_sub_ps(_mm512_loadu_ps(gr + j0), l);
            _mm512_storeu_ps(lp + j0, l);
            _mm512_storeu_ps(out_l + j0, sum);
            const __mmask16 path = _mm512_cmp_ps_mask(sum, none, _CMP_NEQ_UQ);
            _mm512_storeu_ps(out_r + j0, _mm512_maskz_mov_ps(path, rest));
        }
        tiny = small != 0;
    }
#endif
#pragma omp simd reduction(| : tiny)
    for (int64_t j = j0; j < n; ++j) {
        tiny |= below_linear_min(p[j]);
        const T l = log_abs_entry(p[j]), sum = gl[j] + l;
        lp[j] = l;
        out_l[j] = sum;
        out_r[j] = sum == -inf ? T(0) : gr[j] - l;
    }
    T top;
    int64_t at;
    if (tiny || !linear_frame_top(out_l, n, &top, &at)) return false;
    double total = 0, total_at = 0, total_r = 0, total_r_at = 0;
    for (int64_t c = 0; c < n; c += SUM_CHUNK) {  // chunk sums added in double: long rows
        const int64_t end = std::min(n, c + SUM_CHUNK);
        T part = 0, part_at = 0, part_r = 0, part_r_at = 0;
        int64_t j1 = c;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>) {
            const __m512 shift = _mm512_set1_ps(top);
            __m512 sum = _mm512_setzero_ps(), sum_at = sum, sum_r = sum, sum_r_at = sum;
            for (; j1 + 16 <= end; j1 += 16) {
                const __m512 e =
                    exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(out_l + j1), shift));
                const __m512 er = _mm512_mul_ps(e, _mm512_loadu_ps(out_r + j1));
                _mm512_storeu_ps(out_l + j1, e);
                sum = _mm512_add_ps(sum, e);
                sum_r = _mm512_add_ps(sum_r, er);
                const int64_t lane = at - j1;
                const __mmask16 others =
                    lane >= 0 && lane < 16 ? __mmask16(~(1u << lane)) : __mmask16(0xFFFF);
                sum_at = _mm512_mask_add_ps(sum_at, others, sum_at, e);
                sum_r_at = _mm512_mask_add_ps(sum_r_at, others, sum_r_at, er);
            }
            part = _mm512_reduce_add_ps(sum), part_at = _mm512_reduce_add_ps(sum_at);
            part_r = _mm512_reduce_add_ps(sum_r), part_r_at = _mm512_reduce_add_ps(sum_r_at);
        }
#endif
#pragma omp simd reduction(+ : part, part_at, part_r, part_r_at)
        for (int64_t j = j1; j < end; ++j) {
            const T e = exp_nonpositive(out_l[j] - top), er = e * out_r[j];
            out_l[j] = e;
            part += e;
            part_r += er;
            part_at += j == at ? T(0) : e;
            part_r_at += j == at ? T(0) : er;
        }
        total += part, total_at += part_at, total_r += part_r, total_r_at += part_r_at;
    }
    const T sum = T(total), sum_at = T(total_at), sum_r = T(total_r), sum_r_at = T(total_r_at);
    int64_t j2 = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {  // the loop below, 16 entries at a time
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        const __m512 total_v = _mm512_set1_ps(sum), total_r_v = _mm512_set1_ps(sum_r);
        const __m512 shift = _mm512_set1_ps(top);
        for (; j2 + 16 <= n; j2 += 16) {
            const __m512 e = _mm512_loadu_ps(out_l + j2), r = _mm512_loadu_ps(out_r + j2);
            const __m512 pv = _mm512_loadu_ps(p + j2), size = _mm512_abs_ps(pv);
            __m512 den = _mm512_max_ps(_mm512_sub_ps(total_v, e), zero);
            __m512 rest_r = _mm512_fnmadd_ps(e, r, total_r_v);
            const int64_t lane = at - j2;
            if (lane >= 0 && lane < 16) {
                den = _mm512_mask_mov_ps(den, __mmask16(1u << lane), _mm512_set1_ps(sum_at));
                rest_r = _mm512_mask_mov_ps(rest_r, __mmask16(1u << lane),
                                            _mm512_set1_ps(sum_r_at));
            }
            const __m512 u = _mm512_sub_ps(one, pv);
            const __mmask16 nonzero = _mm512_cmp_ps_mask(u, zero, _CMP_NEQ_UQ);
            const __m512 error = _mm512_add_ps(_mm512_sub_ps(u, one), pv);  // (u - 1) + p
            const __m512 fix = _mm512_maskz_div_ps(nonzero, error, u);
            const __m512 log_u = _mm512_sub_ps(log_abs16(u), fix);
            const __m512 own = _mm512_mul_ps(e, _mm512_abs_ps(u));
            const __m512 weight = _mm512_fmadd_ps(den, size, own);
            const __mmask16 owned = _mm512_cmp_ps_mask(own, zero, _CMP_GT_OQ);
            const __mmask16 kept = _mm512_cmp_ps_mask(size, zero, _CMP_GT_OQ);
            const __m512 a = _mm512_maskz_mul_ps(owned, own, _mm512_sub_ps(r, log_u));
            const __m512 lpv = _mm512_loadu_ps(lp + j2);
            const __m512 b = _mm512_maskz_mul_ps(kept, size, _mm512_fnmadd_ps(den, lpv, rest_r));
            const __mmask16 live = _mm512_cmp_ps_mask(weight, zero, _CMP_GT_OQ);
            _mm512_storeu_ps(out_l + j2, _mm512_add_ps(log_abs16(weight), shift));
            _mm512_storeu_ps(out_r + j2, _mm512_maskz_div_ps(live, _mm512_add_ps(a, b), weight));
        }
    }
#endif
#pragma omp simd
    for (int64_t j = j2; j < n; ++j) {
        const T e = out_l[j], r = out_r[j], pj = p[j], size = pj < T(0) ? -pj : pj;
        const T d = sum - e, den = j == at ? sum_at : (d > T(0) ? d : T(0));
        const T rest_r = j == at ? sum_r_at : sum_r - e * r;
        const T u = T(1) - pj, fix = u != T(0) ? ((u - T(1)) + pj) / u : T(0);
        const T log_u = log_abs_entry(u) - fix;
        const T own = e * (u < T(0) ? -u : u), weight = own + den * size;
        const T a = own > T(0) ? own * (r - log_u) : T(0);
        const T b = size > T(0) ? size * (rest_r - den * lp[j]) : T(0);
        out_l[j] = log_nonnegative(weight) + top;
        out_r[j] = weight > T(0) ? (a + b) / weight : T(0);
    }
    return true;
}

// Entropy's message at softmax's input from (gl, gr) at its output p = softmax(s), along
// rows of n contiguous entries (rows [r0, r1)): with t = g ⊗ lift(p) and its leave-one-out
// ⊕ L (loo_row), out_i = t_i ⊗ lift(1 - p_i) ⊕ L_i ⊗ lift(p_i), the ⊕ of the paths through
// ∂p_i/∂s_i = p_i(1 - p_i) and through ∂p_j/∂s_i = -p_j p_i (j ≠ i); log|1 - p| with the
// rounding of u = 1 - p corrected (log|u| - ((u - 1) + p) / u): in the frame of the row's
// largest term where that loses nothing (entropy_softmax_linear_row), else in log space, t
// into (out_l, out_r), then L into (tl, tr), the row's scratch. bad[row] = 1 where t held
// NaN or +inf and the row was left uncomputed, else 0.
template <typename T>
void entropy_softmax_backward_rows(const T* gl, const T* gr, const T* p, T* out_l, T* out_r,
                                   uint8_t* bad, int64_t n, int64_t r0, int64_t r1,
                                   int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> scratch(2 * n);
        T* tl = scratch.data();
        T* tr = tl + n;
#pragma omp for schedule(static)
        for (int64_t row = r0; row < r1; ++row) {
            const int64_t at = row * n;
            T* ol = out_l + at;
            T* orr = out_r + at;
            bad[row] = 0;
            if (entropy_softmax_linear_row(gl + at, gr + at, p + at, ol, orr, tl, n)) continue;
            for (int64_t j = 0; j < n; ++j)
                entropy_mul_lift_entry(gl[at + j], gr[at + j], p[at + j], ol + j, orr + j);
            bad[row] = !loo_row<T, true>(ol, orr, tl, tr, n);
            if (bad[row]) continue;
            for (int64_t j = 0; j < n; ++j) {
                const T pj = p[at + j], u = T(1) - pj;
                const T fix = u != T(0) ? ((u - T(1)) + pj) / u : T(0);
                const T x = std::fabs(u);
                const T log_u = (x > T(0) ? log_positive(x) : -T(__builtin_inf())) - fix;
                const T y = std::fabs(pj);
                const T log_p = y > T(0) ? log_positive(y) : -T(__builtin_inf());
                T own_l, own_r, rest_l, rest_r;
                entropy_times_log(ol[j], orr[j], log_u, &own_l, &own_r);
                entropy_times_log(tl[j], tr[j], log_p, &rest_l, &rest_r);
                entropy_add_entry(own_l, own_r, rest_l, rest_r, ol + j, orr + j);
            }
        }
    }
}

// The message operands of a shift-and-GEMM in log space, for rows [r0, r1) of a (k
// contiguous entries per row): shift[row] = the row's maximum where finite, else 0; live[row]
// = whether that maximum is finite; e = e^(a - shift) into out[row·2k + k + j] and, given r
// (Entropy), e·r into out[row·2k + j] (the stacked [e·r | e]; without r, e alone at
// out[row·k + j]). A row whose maximum is +inf or NaN takes std::exp, as its shifted entries
// may be positive.
template <typename T>
void log_space_rows(const T* a, const T* r, T* out, T* shift, uint8_t* live, int64_t k,
                    int64_t r0, int64_t r1, int threads) {
    const T inf = __builtin_inf();
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t row = r0; row < r1; ++row) {
        const T* as = a + row * k;
        const T* rs = r ? r + row * k : nullptr;
        T* es = r ? out + row * 2 * k + k : out + row * k;
        T* ers = r ? out + row * 2 * k : nullptr;
        bool nan;
        const T top = row_top(as, k, &nan);
        const bool finite = !nan && top > -inf && top < inf;
        const T s = finite ? top : T(0);
        shift[row] = s;
        live[row] = finite;
        if (!nan && top < inf) {
#pragma omp simd
            for (int64_t j = 0; j < k; ++j) es[j] = exp_nonpositive(as[j] - s);
        } else {
            for (int64_t j = 0; j < k; ++j) es[j] = std::exp(as[j] - s);
        }
        if (rs) {
#pragma omp simd
            for (int64_t j = 0; j < k; ++j) ers[j] = es[j] * rs[j];
        }
    }
}

// The ⊕-reduction of Entropy values (x = log Z, r) along rows of n contiguous entries (rows
// [r0, r1)): out_l[row] = log Σ_j e^{x_j}, out_r[row] = Σ_j e^{x_j}·r_j / Σ_j e^{x_j} (0
// where no entry has weight), each term shifted by the row's maximum. A row holding NaN or
// +inf is not computed: bad[row] = 1 (0 for every other row), for the caller's formula.
template <typename T>
void entropy_reduce_rows(const T* x, const T* r, T* out_l, T* out_r, uint8_t* bad, int64_t n,
                         int64_t r0, int64_t r1, int threads) {
    const T inf = __builtin_inf();
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t row = r0; row < r1; ++row) {
        const T* xs = x + row * n;
        const T* rs = r + row * n;
        bool nan;
        const T top = row_top(xs, n, &nan);
        bad[row] = nan || top == inf;
        if (bad[row]) continue;
        const T s = top == -inf ? T(0) : top;
        double total = 0, total_r = 0;
        for (int64_t c = 0; c < n; c += SUM_CHUNK) {
            const int64_t end = std::min(n, c + SUM_CHUNK);
            T part = 0, part_r = 0;
#pragma omp simd reduction(+ : part, part_r)
            for (int64_t j = c; j < end; ++j) {
                const T e = exp_nonpositive(xs[j] - s);
                part += e;
                part_r += e * rs[j];
            }
            total += part, total_r += part_r;
        }
        const T sum = T(total), sum_r = T(total_r);
        out_l[row] = log_nonnegative(sum) + s;
        out_r[row] = sum > T(0) ? sum_r / sum : T(0);
    }
}

}  // namespace
