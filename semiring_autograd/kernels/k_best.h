// The k-best matmul for the CPU (semirings/k_best.py): for lists of non-negative weights
//   a: ka components, each (batch, m, l), and b: kb components, each (batch or 1, l, n),
//   out[t][bt, i, j] = the t-th largest (best first, t < k) of a[r][bt, i, q] · b[s][bt, q, j]
//   over (q, r, s), 0 where fewer than k products are above 0,
// with |b| in place of b when `abs_b`. Every product is the same floating-point multiply as
// the torch formula's and the k largest are kept by comparisons only, so the values are
// the formula's to the bit (ties keep equal values, whichever term they came from).
//
// Bounds: am[i, q] = max_r a[r][i, q] and bm[q, j] = max_s b[s][q, j]; rounding is monotone,
// so every product of (i, q, j) is at most am·bm. One vector multiply and compare per (i, q)
// and column vector tests those bounds against the k-th best so far; where some lane's
// bound passes it, (i, q)'s terms are formed one vector per (r, s) and each vector that beats
// some lane's k-th best enters the lists of all lanes at once (a compare-exchange down the
// k entries, insert_lanes: a lane whose term does not beat its k-th is left as it was);
// with kb = 1 and descending lists, a row's terms stop at the first vector that beats no
// lane. A row takes its indices q by am descending (with few column blocks the
// K_BEST_SORTED largest, then the others, each no larger, in no order), and stops where
// am · (the strip's largest bm per column) passes no k-th best: every later term is below
// it. An index q where the row has no weight above 0 has only zero products, which never
// enter a list: it is skipped, and so is a strip row q where no row of a has one.
//
// Strips or in place: a strip gathers b's column block for every q, read down b's columns.
// With kb = 1 and at most K_BEST_IN_PLACE_ROWS rows per batch entry (a prompt's tokens)
// the rows read b where they visit it instead (few q each, by the bounds), and bm comes from
// one pass along b's rows (column_bounds); the terms and comparisons are the same. With
// strips and few column blocks the rows run in tiles (k_best_tiled): each tile of
// K_BEST_TASK_ROWS rows reads its lists where they lie, at any strides, and makes its own
// bounds, order and strips.
//
// Non-finite operands (NaN, ±inf) are not computed: the torch formula gives NaN for
// NaN and ∞·0 terms, which a list of comparisons would not. Where an entry of a, or of b
// at a live index q (at any q when `dead_count`), is not finite, *nonfinite is set and
// out is left unspecified (the operator fills it with NaN; the caller takes its formula).

#pragma once

#include <array>
#include <cstdlib>
#include <functional>

#include "extreme_matmul.h"

namespace {

// The lanes where p > t, as bits.
template <typename T, typename V = typename Vec<T>::type>
inline uint32_t greater_lanes(V p, V t) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>)
        return _mm512_cmp_ps_mask((__m512)p, (__m512)t, _CMP_GT_OQ);
    else
        return _mm512_cmp_pd_mask((__m512d)p, (__m512d)t, _CMP_GT_OQ);
#else
    uint32_t bits = 0;
    for (int c = 0; c < Vec<T>::lanes; ++c) bits |= uint32_t(p[c] > t[c]) << c;
    return bits;
#endif
}

// Insert the lanes of p into the descending per-lane lists top[0..k): where p[c] beats
// top[t][c] it takes that place and the displaced entry moves on down; an entry that is not
// greater than the k-th (ties included) changes nothing.
template <typename T, typename V = typename Vec<T>::type>
inline V insert_lanes(V* top, int64_t k, V p) {
    for (int64_t t = 0; t < k; ++t) {
        const V old = top[t];
        const auto wins = p > old;
        top[t] = wins ? p : old;
        p = wins ? old : p;
    }
    return top[k - 1];
}

// am (batch, m, l) = max over a's components a[r] (each batch × m × l); live[bt * l + q]:
// some row of batch bt has am > 0; *sorted: every list of a is in descending order (as the
// semiring keeps them). False where an entry of a is not finite.
template <typename T>
bool k_best_bounds(const T* const* a, int64_t ka, int64_t batch, int64_t m, int64_t l,
                   T* am, uint8_t* live, bool* sorted) {
    const int64_t count = batch * m * l;
    T check = T(0);
    int disorder = 0;
    T* __restrict__ big = am;
    const T* __restrict__ x0 = a[0];
#pragma omp simd reduction(+ : check)
    for (int64_t e = 0; e < count; ++e) {
        big[e] = x0[e];
        check += x0[e] * T(0);
    }
    for (int64_t r = 1; r < ka; ++r) {
        const T* __restrict__ x = a[r];
        const T* __restrict__ prev = a[r - 1];
#pragma omp simd reduction(+ : check) reduction(| : disorder)
        for (int64_t e = 0; e < count; ++e) {
            const T v = x[e];
            check += v * T(0);
            disorder |= !(v <= prev[e]);
            big[e] = v > big[e] ? v : big[e];
        }
    }
    *sorted = !disorder;
    if (check != T(0)) return false;
    for (int64_t bt = 0; bt < batch; ++bt) {
        uint8_t* lv = live + bt * l;
        std::fill(lv, lv + l, uint8_t(0));
        for (int64_t i = 0; i < m; ++i) {
            const T* row = am + (bt * m + i) * l;
#pragma omp simd
            for (int64_t q = 0; q < l; ++q) lv[q] |= row[q] > T(0);
        }
    }
    return true;
}

// The indices q < l with x[q] > 0, in order: those with x[q] ≥ tau into high (how many
// returned), the others into low (*low_count of them, their largest in *low_max). high and
// low have room for l + 16 entries.
template <typename T>
int64_t split_indices(const T* x, int64_t l, T tau, int32_t* high, int32_t* low,
                      int64_t* low_count, T* low_max) {
    int64_t nh = 0, nl = 0, q = 0;
    T under = T(0);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                               14, 15);
        const __m512 zero = _mm512_setzero_ps(), t = _mm512_set1_ps(tau);
        __m512 most = zero;
        for (; q + 16 <= l; q += 16) {
            const __m512 v = _mm512_loadu_ps(x + q);
            const __mmask16 live = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
            const __mmask16 up = live & _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ);
            const __mmask16 down = live & ~up;
            const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(q)));
            _mm512_storeu_si512(high + nh, _mm512_maskz_compress_epi32(up, at));
            _mm512_storeu_si512(low + nl, _mm512_maskz_compress_epi32(down, at));
            nh += __builtin_popcount(up);
            nl += __builtin_popcount(down);
            most = _mm512_mask_max_ps(most, down, most, v);
        }
        under = _mm512_reduce_max_ps(most);
    }
#endif
    for (; q < l; ++q) {
        const T v = x[q];
        if (!(v > T(0))) continue;
        if (v >= tau) {
            high[nh++] = static_cast<int32_t>(q);
        } else {
            low[nl++] = static_cast<int32_t>(q);
            under = v > under ? v : under;
        }
    }
    *low_count = nl;
    *low_max = under;
    return nh;
}

// With fewer column blocks than this, row_order sorts a row's K_BEST_SORTED largest indices
// q only: sorting all of a long row then costs more than the few column blocks' loops, which
// mostly stop within the first few (their bounds pass no k-th best); with more, every index
// is sorted once for all the blocks.
constexpr int64_t K_BEST_FEW_BLOCKS = 8, K_BEST_SORTED = 32, K_BEST_TASK_ROWS = 64;
constexpr int64_t K_BEST_GROUP_BLOCKS = 8;

// Per row of am (rows × l, finite; rows across threads): its indices q with am > 0, how many
// into count[row], into order[row * l, ...): the `sort` largest first, by am descending
// (ties by q), then the others in no order, each at most the last sorted one. With
// 2·sort ≤ l the others come in two parts: first those at least a threshold tau (at most
// the sort-th largest), then from low[row] on those below it, the largest of which is
// low_max[row] (0 where there are none). tau is the sort-th largest of the maxima of 2·sort
// groups (q's group: q mod 2·sort): they are sort entries of the row, so the sort largest
// are all at least tau, and only the indices at least tau are selected and sorted.
// Float rows sort as 64-bit keys (bits of am, then ~q): the bits of a positive float order
// as the float does.
template <typename T>
void row_order(const T* am, int64_t rows, int64_t l, int64_t sort, int32_t* order,
               int64_t* count, int64_t* low, T* low_max, int threads) {
    const int64_t groups = 2 * sort;
    const bool split = groups <= l;
    at::parallel_for(0, rows, threads > 1 ? 1 : INT64_MAX, [&](int64_t row0, int64_t row1) {
        std::vector<uint64_t> keys(std::is_same_v<T, float> ? l : 0);
        std::vector<int32_t> above(l + 16), below(l + 16);
        std::vector<T> top(split ? groups : 0);
        for (int64_t row = row0; row < row1; ++row) {
            const T* ar = am + row * l;
            int32_t* qs = order + row * l;
            T tau = T(0);
            if (split) {
                T* big = top.data();
                std::copy(ar, ar + groups, big);
                int64_t q = groups;
                for (; q < l; q += groups) {
                    const int64_t width = std::min(groups, l - q);
#pragma omp simd
                    for (int64_t g = 0; g < width; ++g)
                        big[g] = ar[q + g] > big[g] ? ar[q + g] : big[g];
                }
                // the sort-th largest maximum: the largest with at least sort maxima at least it
                for (int64_t g = 0; g < groups; ++g) {
                    if (!(big[g] > tau)) continue;
                    int64_t at_least = 0;
#pragma omp simd reduction(+ : at_least)
                    for (int64_t h = 0; h < groups; ++h) at_least += big[h] >= big[g];
                    if (at_least >= sort) tau = big[g];
                }
            }
            // the indices at least tau (all above 0 where tau is 0), to select from; the others
            // above 0 into `below`
            int64_t nb;
            T under;
            const int64_t c = split_indices(ar, l, tau, above.data(), below.data(), &nb, &under);
            if constexpr (std::is_same_v<T, float>) {
                for (int64_t u = 0; u < c; ++u) {
                    uint32_t bits;
                    std::memcpy(&bits, ar + above[u], sizeof bits);
                    keys[u] = uint64_t(bits) << 32 | ~uint32_t(above[u]);
                }
                const auto first = keys.begin(), head = first + std::min(c, sort);
                if (head < first + c)
                    std::nth_element(first, head - 1, first + c, std::greater<uint64_t>());
                std::sort(first, head, std::greater<uint64_t>());
                for (int64_t u = 0; u < c; ++u) qs[u] = static_cast<int32_t>(~uint32_t(keys[u]));
            } else {
                std::copy(above.begin(), above.begin() + c, qs);
                const auto before = [ar](int32_t x, int32_t y) {
                    return ar[x] > ar[y] || (ar[x] == ar[y] && x < y);
                };
                int32_t* head = qs + std::min(c, sort);
                if (head < qs + c) std::nth_element(qs, head - 1, qs + c, before);
                std::sort(qs, head, before);
            }
            std::copy(below.begin(), below.begin() + nb, qs + c);
            low[row] = c;
            low_max[row] = under;
            count[row] = c + nb;
        }
    });
}

// One row i of a against one column strip (see k_best_times): its indices q (qs, the first
// `sorted_count` by am descending, from `low` on each at most low_max: row_order's), their
// bounds am, its lists (component r's entry q at x[r][at + q]), and the strip's rows (the
// bound bm, then for kb > 1 the kb components, rs entries per q).
template <typename T, typename V = typename Vec<T>::type>
struct Row {
    const T* am;
    const int32_t* qs;
    int64_t count, sorted_count, low;
    T low_max;
    const T* const* x;
    int64_t at, ka, kb;
    bool sorted;
    const T* strip;
    int64_t rs, first;
    V colmax;
    // kb = 1 read in place: strip points at b's column j, rs = n, |b| taken per load, the
    // first `valid` lanes read
    bool direct, abs_b;
    int64_t valid;
};

// The k best terms of row r per lane of the strip, best first, into top[0..k). K > 0: k is
// K, and the lists stay in registers; K = 0: any k.
template <typename T, int K, typename V = typename Vec<T>::type>
void best_of_row(const Row<T>& r, int64_t k, V* top) {
    constexpr int L = Vec<T>::lanes;
    V local[K > 0 ? K : 1];
    V* lists = K > 0 ? local : top;
    const int64_t kk = K > 0 ? K : k;
    for (int64_t t = 0; t < kk; ++t) lists[t] = V{} + T(0);
    V kth = V{} + T(0);
    for (int64_t u = 0; u < r.count; ++u) {
        const int64_t q = r.qs[u];
        const T s = r.am[q];
        // every later term is at most bound · colmax (past the sorted indices, bound is the
        // last sorted one's am, from `low` on low_max): none can enter a list
        const bool in_order = u < r.sorted_count;
        const T bound = in_order ? s : u < r.low ? r.am[r.qs[r.sorted_count - 1]] : r.low_max;
        if (!greater_lanes<T>(r.colmax * bound, kth)) break;
        if (!in_order && !greater_lanes<T>(r.colmax * s, kth)) continue;
        const T* row = r.strip + q * r.rs;
        const int64_t xq = r.at + q;
        if (r.kb == 1) {
            V y;
            if (r.direct) {
                y = load_part<T>(row, r.valid);
                if (r.abs_b) y = y < T(0) ? -y : y;
            } else {
                y = load<V>(row);
            }
            for (int64_t c = 0; c < r.ka; ++c) {
                const V p = y * r.x[c][xq];
                if (greater_lanes<T>(p, kth))
                    kth = insert_lanes<T>(lists, kk, p);
                else if (r.sorted)  // descending terms: the later ones fail too
                    break;
            }
        } else {
            if (!greater_lanes<T>(load<V>(row) * s, kth)) continue;
            for (int64_t c = 0; c < r.ka; ++c)
                for (int64_t d = 0; d < r.kb; ++d) {
                    const V p = load<V>(row + r.first + d * L) * r.x[c][xq];
                    if (greater_lanes<T>(p, kth)) kth = insert_lanes<T>(lists, kk, p);
                }
        }
    }
    if (K > 0)
        for (int64_t t = 0; t < K; ++t) top[t] = local[t];
}

// best_of_row with the lists in registers for k ≤ K.
template <typename T, int K = 8, typename V = typename Vec<T>::type>
void best_of_row_k(int64_t k, const Row<T>& r, V* top) {
    if constexpr (K == 0)
        best_of_row<T, 0>(r, k, top);
    else if (k == K)
        best_of_row<T, K>(r, k, top);
    else
        best_of_row_k<T, K - 1>(k, r, top);
}

// Up to this many rows per batch entry, kb = 1 runs in place: the rows visit few indices q
// (their am descending, cut by the bounds), so reading b where they visit costs less than
// a strip of all l indices read down b's columns.
constexpr int64_t K_BEST_IN_PLACE_ROWS = 64;

// For kb = 1 in place: bm (batch, n) = the largest |b| (b when !abs_b) per column over the
// indices q live in that batch entry, from passes along b's rows; false where an entry of b
// that counts (live q, any q when dead_count) is not finite.
template <typename T>
bool column_bounds(const T* b, int64_t b_batch, int64_t batch, int64_t l, int64_t n,
                   const uint8_t* live, bool abs_b, bool dead_count, T* bm, int threads) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, C = 8;  // C vectors of columns per task
    const int64_t chunks = (n + C * L - 1) / (C * L);
    int bad = 0;
    at::parallel_for(0, batch * chunks, threads > 1 ? 1 : INT64_MAX,
                     [&](int64_t first, int64_t last) {
        for (int64_t task = first; task < last; ++task) {
            const int64_t bt = task / chunks, j0 = (task % chunks) * C * L;
            const T* bb = b + bt * b_batch;
            const uint8_t* lv = live + bt * l;
            V big[C], check = V{} + T(0);
            for (int c = 0; c < C; ++c) big[c] = V{} + T(0);
            for (int64_t q = 0; q < l; ++q) {
                if (!lv[q] && !dead_count) continue;
                for (int c = 0; c < C; ++c) {
                    const int64_t j = j0 + c * L;
                    if (j >= n) break;
                    V v = load_part<T>(bb + q * n + j, n - j);
                    check += v * T(0);
                    if (abs_b) v = v < T(0) ? -v : v;
                    if (lv[q]) big[c] = vmax(v, big[c]);
                }
            }
            if (!finite_lanes<T>(check)) __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
            for (int c = 0; c < C && j0 + c * L < n; ++c) {
                const int64_t j = j0 + c * L, valid = std::min<int64_t>(L, n - j);
                std::memcpy(bm + bt * n + j, &big[c], valid * sizeof(T));
            }
        }
    });
    return !bad;
}

// Whether k_best_times takes a's rows in tiles (K_BEST_TASK_ROWS rows a task, across every
// column block): with fewer column blocks than K_BEST_FEW_BLOCKS, where the rows do not run
// in place. A tile reads its rows' lists where they lie (any strides) and keeps them in cache
// from one column block to the next; the other paths take a's rows contiguous.
template <typename T>
bool k_best_tiled(int64_t m, int64_t n, int64_t kb) {
    const int64_t blocks = (n + Vec<T>::lanes - 1) / Vec<T>::lanes;
    return blocks < K_BEST_FEW_BLOCKS && !(kb == 1 && m <= K_BEST_IN_PLACE_ROWS);
}

// A thread's storage for the tiles it takes: their rows' lists where gathered, bounds,
// orders and strips.
template <typename T>
struct RowTile {
    Buffer<T> lists, am, strips, top;
    std::vector<const T*> x;
    std::vector<int32_t> order;
    std::vector<int64_t> count, low;
    std::vector<T> low_max;
    std::vector<uint8_t> live;
};

// Rows [i0, i0 + rows) of batch entry bt of a (component r's entry (i, q) at
// a[r][bt * sb + i * si + q * sq]) as rows of l: where they lie if they are such rows, else
// copied into tile.lists (16 indices q at a time, so both sides stay in cache). Into tile.x.
template <typename T>
void tile_rows(const std::vector<const T*>& a, int64_t sb, int64_t si, int64_t sq,
               int64_t bt, int64_t i0, int64_t rows, int64_t l, RowTile<T>& tile) {
    const int64_t ka = int64_t(a.size());
    tile.x.resize(ka);
    if (sq == 1 && si == l) {
        for (int64_t r = 0; r < ka; ++r) tile.x[r] = a[r] + bt * sb + i0 * l;
        return;
    }
    tile.lists.resize(ka * rows * l);
    for (int64_t r = 0; r < ka; ++r) tile.x[r] = tile.lists.data() + r * rows * l;
    for (int64_t q0 = 0; q0 < l; q0 += 16) {
        const int64_t width = std::min<int64_t>(16, l - q0);
        for (int64_t r = 0; r < ka; ++r) {
            const T* from = a[r] + bt * sb + i0 * si + q0 * sq;
            T* to = tile.lists.data() + r * rows * l + q0;
#if defined(__AVX512F__)
            if constexpr (std::is_same_v<T, float>) {
                if (width == 16 && std::abs(sq) < (int64_t(1) << 26)) {  // 16 · |sq| fits int32
                    const __m512i at = _mm512_mullo_epi32(
                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                        _mm512_set1_epi32(int32_t(sq)));
                    for (int64_t i = 0; i < rows; ++i)
                        _mm512_storeu_ps(to + i * l, _mm512_i32gather_ps(at, from + i * si, 4));
                    continue;
                }
            }
#endif
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t q = 0; q < width; ++q) to[i * l + q] = from[i * si + q * sq];
        }
    }
}

// b's column blocks [c0, c1) as strips for rows that read them (see k_best_times): per q
// where live[q] (every q when dead_count), the bounds bm, then for kb > 1 the kb components
// (|b| when abs_b), rs entries per q; colmax[cb - c0] the largest bm over the live q. False
// where an entry read is not finite.
template <typename T, typename V = typename Vec<T>::type>
bool column_strips(const std::vector<const T*>& b, int64_t b_at, int64_t l, int64_t n,
                   int64_t c0, int64_t c1, const uint8_t* live, bool abs_b, bool dead_count,
                   int64_t rs, int64_t first, T* strips, V* colmax) {
    constexpr int L = Vec<T>::lanes;
    const int64_t kb = int64_t(b.size());
    V check = V{} + T(0);
    for (int64_t cb = c0; cb < c1; ++cb) {
        const int64_t j = cb * L, valid = std::min<int64_t>(L, n - j);
        T* strip = strips + (cb - c0) * l * rs;
        V most = V{} + T(0);
        for (int64_t q = 0; q < l; ++q) {
            if (!live[q] && !dead_count) continue;
            V big = V{} + T(0);
            for (int64_t s = 0; s < kb; ++s) {
                V v = load_part<T>(b[s] + b_at + q * n + j, valid);
                check += v * T(0);
                if (abs_b) v = v < T(0) ? -v : v;
                big = vmax(v, big);
                if (kb > 1) store(&strip[q * rs + first + s * L], v);
            }
            store(&strip[q * rs], big);
            if (live[q]) most = vmax(big, most);
        }
        colmax[cb - c0] = most;
    }
    return finite_lanes<T>(check);
}

// a: ka components (batch, m, l), component r's entry (bt, i, q) at
// a[r][bt * sb + i * si + q * sq]; rows of l (sq = 1, si = l, sb = m·l) unless
// k_best_tiled(m, n, kb).
template <typename T>
void k_best_times(const std::vector<const T*>& a, int64_t sb, int64_t si, int64_t sq,
                  const std::vector<const T*>& b, int64_t b_batch, T* out, int64_t k,
                  int64_t batch, int64_t m, int64_t l, int64_t n, bool abs_b, bool dead_count,
                  int threads, int* nonfinite) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const int64_t ka = int64_t(a.size()), kb = int64_t(b.size()), out_comp = batch * m * n;
    const int64_t blocks = (n + L - 1) / L;
    const int64_t sort = blocks < K_BEST_FEW_BLOCKS ? K_BEST_SORTED : l;
    const int64_t rs = (kb == 1 ? 1 : kb + 1) * L, first = kb == 1 ? 0 : L;
    // best_of_row over rows [i0, i1) of batch bt (row bt·m + i of the output, its bounds,
    // order and lists at tile row i - i0) and column blocks [c0, c1), reading the strips (or
    // b in place)
    auto run_rows = [&](int64_t bt, int64_t i0, int64_t i1, int64_t c0, int64_t c1,
                        const T* am, const int32_t* order, const int64_t* count,
                        const int64_t* low, const T* low_max, const T* const* x,
                        const T* strips, bool sorted, bool direct, const V* colmax,
                        Buffer<T>& lists) {
        lists.resize(k * L);
        V* top = reinterpret_cast<V*>(lists.data());
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t t_row = i - i0, row = bt * m + i;
            for (int64_t cb = c0; cb < c1; ++cb) {
                const int64_t j = cb * L, valid = std::min<int64_t>(L, n - j);
                const Row<T> r{am + t_row * l,
                               order + t_row * l,
                               count[t_row],
                               std::min(count[t_row], sort),
                               low[t_row],
                               low_max[t_row],
                               x,
                               t_row * l,
                               ka,
                               kb,
                               sorted,
                               direct ? b[0] + bt * b_batch + j : strips + (cb - c0) * l * rs,
                               direct ? n : rs,
                               first,
                               colmax[cb - c0],
                               direct,
                               direct && abs_b,
                               direct ? valid : L};
                best_of_row_k<T>(k, r, top);
                for (int64_t t = 0; t < k; ++t)
                    std::memcpy(out + t * out_comp + row * n + j, &top[t], valid * sizeof(T));
            }
        }
    };
    if (k_best_tiled<T>(m, n, kb)) {
        const int64_t tiles = (m + K_BEST_TASK_ROWS - 1) / K_BEST_TASK_ROWS;
        for_blocks<RowTile<T>>(0, batch, 0, tiles, threads,
                               [&](int64_t bt, int64_t tile_at, RowTile<T>& tile) {
            if (__atomic_load_n(nonfinite, __ATOMIC_RELAXED)) return;
            const int64_t i0 = tile_at * K_BEST_TASK_ROWS;
            const int64_t rows = std::min(m, i0 + K_BEST_TASK_ROWS) - i0;
            tile_rows(a, sb, si, sq, bt, i0, rows, l, tile);
            tile.am.resize(rows * l);
            tile.live.resize(l);
            bool sorted = false;
            if (!k_best_bounds(tile.x.data(), ka, 1, rows, l, tile.am.data(), tile.live.data(),
                               &sorted)) {
                __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
                return;
            }
            tile.order.resize(rows * l);
            tile.count.resize(rows);
            tile.low.resize(rows);
            tile.low_max.resize(rows);
            row_order(tile.am.data(), rows, l, sort, tile.order.data(), tile.count.data(),
                      tile.low.data(), tile.low_max.data(), 1);
            // the strips of this tile's live indices: together the tiles read every live
            // index of b
            tile.strips.resize(blocks * l * rs);
            std::array<V, K_BEST_FEW_BLOCKS> colmax;
            if (!column_strips(b, bt * b_batch, l, n, 0, blocks, tile.live.data(), abs_b,
                               dead_count, rs, first, tile.strips.data(), colmax.data())) {
                __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
                return;
            }
            run_rows(bt, i0, i0 + rows, 0, blocks, tile.am.data(), tile.order.data(),
                     tile.count.data(), tile.low.data(), tile.low_max.data(), tile.x.data(),
                     tile.strips.data(), sorted, false, colmax.data(), tile.top);
        });
        return;
    }
    std::vector<T> am(batch * m * l);
    std::vector<uint8_t> live(batch * l);
    bool sorted = false;
    if (!k_best_bounds(a.data(), ka, batch, m, l, am.data(), live.data(), &sorted)) {
        *nonfinite = 1;
        return;
    }
    std::vector<int32_t> order(batch * m * l);
    std::vector<int64_t> count(batch * m), low(batch * m);
    std::vector<T> low_max(batch * m);
    row_order(am.data(), batch * m, l, sort, order.data(), count.data(), low.data(),
              low_max.data(), threads);
    const bool direct = kb == 1 && m <= K_BEST_IN_PLACE_ROWS;
    std::vector<T> bounds(direct ? batch * n : 0);
    if (direct && !column_bounds(b[0], b_batch, batch, l, n, live.data(), abs_b, dead_count,
                                 bounds.data(), threads)) {
        *nonfinite = 1;
        return;
    }
    // A task: with strips, a run of K_BEST_TASK_ROWS rows across a group of
    // K_BEST_GROUP_BLOCKS column blocks (a row's lists stay in cache from one block to the
    // next, the group's strips from one row to the next); in place, every row on one column
    // block (the rows' reads of b's column stay in cache from one row to the next).
    const int64_t row_runs = direct ? 1 : (m + K_BEST_TASK_ROWS - 1) / K_BEST_TASK_ROWS;
    const int64_t group_blocks = direct ? 1 : K_BEST_GROUP_BLOCKS;
    const int64_t groups = (blocks + group_blocks - 1) / group_blocks;
    for_blocks(0, batch, 0, row_runs * groups, threads,
               [&](int64_t bt, int64_t task, Scratch& scratch) {
        if (__atomic_load_n(nonfinite, __ATOMIC_RELAXED)) return;
        Buffer<T>* buffers = scratch.get(static_cast<T*>(nullptr));
        const int64_t i0 = task / groups * K_BEST_TASK_ROWS;
        const int64_t i1 = direct ? m : std::min(m, i0 + K_BEST_TASK_ROWS);
        const int64_t c0 = task % groups * group_blocks;
        const int64_t c1 = std::min(blocks, c0 + group_blocks);
        std::array<V, K_BEST_GROUP_BLOCKS> colmax;
        const T* strips = nullptr;
        if (direct) {
            for (int64_t cb = c0; cb < c1; ++cb)
                colmax[cb - c0] = load_part<T>(bounds.data() + bt * n + cb * L,
                                               std::min<int64_t>(L, n - cb * L));
        } else {
            buffers[0].resize((c1 - c0) * l * rs);
            if (!column_strips(b, bt * b_batch, l, n, c0, c1, live.data() + bt * l, abs_b,
                               dead_count, rs, first, buffers[0].data(), colmax.data())) {
                __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
                return;
            }
            strips = buffers[0].data();
        }
        const int64_t at = bt * m + i0;
        std::vector<const T*> x(a);
        for (auto& p : x) p += at * l;
        run_rows(bt, i0, i1, c0, c1, am.data() + at * l, order.data() + at * l,
                 count.data() + at, low.data() + at, low_max.data() + at, x.data(), strips,
                 sorted, direct, colmax.data(), buffers[1]);
    });
}

// k-best ⊕ (semirings/k_best.py's add): for lists a[t], b[t] (t < k, each `count` entries,
// best first), out[t] = the t-th largest of the 2k entries a[.][e], b[.][e] per entry e.
// The t-th largest of two descending lists is max over splits i + j = t + 1 of
// min(a[i - 1], b[j - 1]) (a[-1] = b[-1] = +inf): a selection of entries by comparisons,
// so the values are torch.topk's on the stacked lists to the bit. Entries are taken in
// blocks held in L1, each split one vector min/max pass. Where a list is not descending
// or holds a NaN (topk orders NaN first), *declined is set and out is unspecified.
template <typename T>
void k_best_add(const std::vector<const T*>& a, const std::vector<const T*>& b, T* out,
                int64_t count, int threads, int* declined) {
    const int64_t k = int64_t(a.size());
    constexpr int64_t BLOCK = 256;
    at::parallel_for(0, (count + BLOCK - 1) / BLOCK, threads > 1 ? 1 : INT64_MAX,
                     [&](int64_t first, int64_t last) {
        for (int64_t blk = first; blk < last; ++blk) {
            const int64_t e0 = blk * BLOCK, n = std::min(BLOCK, count - e0);
            int bad = 0;  // an int: GCC vectorises an | reduction into an int, not a bool
            for (int64_t t = 0; t < k; ++t) {  // descending, no NaN (t = k - 1: x == x)
                const T* __restrict__ at_ = a[t] + e0;
                const T* __restrict__ bt = b[t] + e0;
                const T* __restrict__ an = a[t + 1 < k ? t + 1 : t] + e0;
                const T* __restrict__ bn = b[t + 1 < k ? t + 1 : t] + e0;
                for (int64_t e = 0; e < n; ++e)
                    bad |= int(!(at_[e] >= an[e])) | int(!(bt[e] >= bn[e]));
            }
            if (bad) {
                __atomic_store_n(declined, 1, __ATOMIC_RELAXED);
                return;
            }
            for (int64_t t = 0; t < k; ++t) {
                T* __restrict__ o = out + t * count + e0;
                const T* __restrict__ at_ = a[t] + e0;
                const T* __restrict__ bt = b[t] + e0;
                for (int64_t e = 0; e < n; ++e) o[e] = at_[e] < bt[e] ? bt[e] : at_[e];
                for (int64_t i = 1; i <= t; ++i) {
                    const T* __restrict__ x = a[i - 1] + e0;
                    const T* __restrict__ y = b[t - i] + e0;
                    for (int64_t e = 0; e < n; ++e) {
                        const T m = x[e] < y[e] ? x[e] : y[e];
                        o[e] = o[e] < m ? m : o[e];
                    }
                }
            }
        }
    });
}

// The 2k best entries of one row's n lists (entry(t, j): list j's t-th, best first, k each)
// with their lists, best first, into value and list; how many (fewer where the lists hold
// fewer). A list whose best entry cannot enter is skipped whole; else it is read until an
// entry cannot enter: the rest of it is no larger.
template <typename T, typename Entry>
int64_t keep_best_of_row(const Entry& entry, int64_t k, int64_t n, T* value, int64_t* list) {
    const int64_t keep = 2 * k;
    int64_t size = 0;
    for (int64_t j = 0; j < n; ++j) {
        if (size == keep && !(entry(0, j) > value[keep - 1])) continue;
        for (int64_t t = 0; t < k; ++t) {
            const T v = entry(t, j);
            if (size == keep && !(v > value[keep - 1])) break;
            int64_t p = size < keep ? size++ : keep - 1;
            for (; p > 0 && value[p - 1] < v; --p) {
                value[p] = value[p - 1];
                list[p] = list[p - 1];
            }
            value[p] = v;
            list[p] = j;
        }
    }
    return size;
}

// The k best of the kept entries (keep_best_of_row's) that are not list j's own, into
// others[0..k), 0 past them. With j = -1: the first k.
template <typename T>
inline void others_of(const T* value, const int64_t* list, int64_t size, int64_t j, int64_t k,
                      T* others) {
    int64_t t = 0;
    for (int64_t p = 0; p < size && t < k; ++p)
        if (list[p] != j) others[t++] = value[p];
    for (; t < k; ++t) others[t] = T(0);
}

// KBest's leave-one-out ⊕ along the last dim (semirings/k_best.py's loo): for lists a[t]
// (t < k, each rows × n, best first), out[t][row, j] = the t-th largest of the entries of the
// row's lists j' ≠ j, 0 where they hold fewer. The k best of the others are among the 2k
// best of all (keep_best_of_row), of which at most k are list j's own: every j takes the
// first k kept entries, but for the few lists among the kept, which take the first k kept
// entries not their own. Values are selected by comparisons: the prefix and suffix scans'
// of ⊕ to the bit. Where a list is not descending or holds a NaN, *declined is set and out
// is unspecified.
template <typename T>
void k_best_loo(const std::vector<const T*>& a, T* out, int64_t rows, int64_t n, int threads,
                int* declined) {
    const int64_t k = int64_t(a.size()), keep = 2 * k, plane = rows * n;
    at::parallel_for(0, rows, threads > 1 ? 1 : INT64_MAX, [&](int64_t first, int64_t last) {
        std::vector<T> value(keep), others(k);
        std::vector<int64_t> list(keep);
        for (int64_t row = first; row < last; ++row) {
            const int64_t base = row * n;
            int bad = 0;  // a NaN, or a list not descending
            for (int64_t t = 0; t < k; ++t) {
                const T* __restrict__ x = a[t] + base;
                const T* __restrict__ above = a[t > 0 ? t - 1 : 0] + base;
#pragma omp simd reduction(| : bad)
                for (int64_t j = 0; j < n; ++j) bad |= !(x[j] == x[j]) | (x[j] > above[j]);
            }
            if (bad) {
                __atomic_store_n(declined, 1, __ATOMIC_RELAXED);
                return;
            }
            const auto entry = [&](int64_t t, int64_t j) { return a[t][base + j]; };
            const int64_t size = keep_best_of_row<T>(entry, k, n, value.data(), list.data());
            others_of(value.data(), list.data(), size, -1, k, others.data());
            for (int64_t t = 0; t < k; ++t) {  // every j whose list holds no kept entry
                T* __restrict__ o = out + t * plane + base;
                const T v = others[t];
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) o[j] = v;
            }
            for (int64_t u = 0; u < size; ++u) {  // the kept entries' lists (twice for two)
                const int64_t j = list[u];
                others_of(value.data(), list.data(), size, j, k, others.data());
                for (int64_t t = 0; t < k; ++t) out[t * plane + base + j] = others[t];
            }
        }
    });
}

// The t-th best (t < k) of two descending lists x and y of k entries: the largest over the
// splits i + j = t + 1 of min(x[i - 1], y[j - 1]) (x[-1] = y[-1] = +inf), as k_best_add.
template <typename T>
inline T best_of_two(const T* x, const T* y, int64_t t) {
    T o = x[t] < y[t] ? y[t] : x[t];
    for (int64_t i = 1; i <= t; ++i) {
        const T m = x[i - 1] < y[t - i] ? x[i - 1] : y[t - i];
        o = o < m ? m : o;
    }
    return o;
}

// KBest's message at softmax's input s from lists a[t] (t < k, each rows × n, best first) at
// its output p (rows × n, last dim), Semiring.softmax_backward's formula in one pass per
// row: with own_i = a_i·|p_i(1 − p_i)| and t_j = a_j·|p_j|, out_i = the k best of own_i and
// L_i·|−p_i|, L_i the k best entries of the lists t_j, j ≠ i (k_best_loo's selection). The
// same products (p(1 − p) rounded first) and selections as the formula: its values to the
// bit. Where a list of a is not descending, or t or own holds a NaN, *declined is set and
// out is unspecified.
template <typename T>
void k_best_softmax_backward(const std::vector<const T*>& a, const T* p, T* out, int64_t rows,
                             int64_t n, int threads, int* declined) {
    const int64_t k = int64_t(a.size()), keep = 2 * k, plane = rows * n;
    constexpr int64_t BLOCK = 256;  // positions per merge, their lists held in L1
    at::parallel_for(0, rows, threads > 1 ? 1 : INT64_MAX, [&](int64_t first, int64_t last) {
        std::vector<T> value(keep), others(k), own(k * BLOCK), rest(k * BLOCK);
        std::vector<int64_t> list(keep);
        for (int64_t row = first; row < last; ++row) {
            const int64_t base = row * n;
            const T* __restrict__ pr = p + base;
            int bad = 0;
            for (int64_t t = 0; t < k; ++t) {
                const T* __restrict__ x = a[t] + base;
                const T* __restrict__ above = a[t > 0 ? t - 1 : 0] + base;
#pragma omp simd reduction(| : bad)
                for (int64_t j = 0; j < n; ++j) {
                    const T w = std::fabs(pr[j]), v = x[j] * w;
                    const T o = x[j] * std::fabs(pr[j] * (T(1) - pr[j]));
                    bad |= !(v == v) | !(o == o) | (x[j] > above[j]);
                }
            }
            if (bad) {
                __atomic_store_n(declined, 1, __ATOMIC_RELAXED);
                return;
            }
            const auto entry = [&](int64_t t, int64_t j) {
                return a[t][base + j] * std::fabs(pr[j]);
            };
            const int64_t size = keep_best_of_row<T>(entry, k, n, value.data(), list.data());
            others_of(value.data(), list.data(), size, -1, k, others.data());
            for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {  // every j as if its list kept nothing
                const int64_t count = std::min(BLOCK, n - j0);
                for (int64_t t = 0; t < k; ++t) {
                    const T* __restrict__ x = a[t] + base + j0;
                    const T* __restrict__ pj = pr + j0;
                    T* __restrict__ ow = own.data() + t * BLOCK;
                    T* __restrict__ re = rest.data() + t * BLOCK;
                    const T l = others[t];
#pragma omp simd
                    for (int64_t e = 0; e < count; ++e) {
                        ow[e] = x[e] * std::fabs(pj[e] * (T(1) - pj[e]));
                        re[e] = l * std::fabs(-pj[e]);
                    }
                }
                for (int64_t t = 0; t < k; ++t) {
                    T* __restrict__ o = out + t * plane + base + j0;
                    const T* __restrict__ ox = own.data() + t * BLOCK;
                    const T* __restrict__ ry = rest.data() + t * BLOCK;
#pragma omp simd
                    for (int64_t e = 0; e < count; ++e) o[e] = ox[e] < ry[e] ? ry[e] : ox[e];
                    for (int64_t i = 1; i <= t; ++i) {
                        const T* __restrict__ x = own.data() + (i - 1) * BLOCK;
                        const T* __restrict__ y = rest.data() + (t - i) * BLOCK;
#pragma omp simd
                        for (int64_t e = 0; e < count; ++e) {
                            const T m = x[e] < y[e] ? x[e] : y[e];
                            o[e] = o[e] < m ? m : o[e];
                        }
                    }
                }
            }
            for (int64_t u = 0; u < size; ++u) {  // the lists among the kept, their own L
                const int64_t j = list[u];
                others_of(value.data(), list.data(), size, j, k, others.data());
                T* x = own.data();
                T* y = rest.data();
                const T w = std::fabs(pr[j] * (T(1) - pr[j])), q = std::fabs(-pr[j]);
                for (int64_t t = 0; t < k; ++t) x[t] = a[t][base + j] * w, y[t] = others[t] * q;
                for (int64_t t = 0; t < k; ++t) out[t * plane + base + j] = best_of_two(x, y, t);
            }
        }
    });
}

}  // namespace
