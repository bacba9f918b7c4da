// Max-times and signed max/min-times matrix products for the CPU, in register blocks.
//
// Part of semiring_autograd. Compiled on first use by kernels/__init__.py with the system
// C++ compiler (-O3 -march=native, -fopenmp where it builds) and loaded with ctypes; no
// Python or torch headers.
//
// Every function works on contiguous row-major operands with a batch dimension:
//   a: (batch, m, k), b: (batch, k, n), out: (batch, m, n), where n is a multiple of the
//   block width W (the caller pads b), and fills out[bt, :, columns c0*W .. c1*W) for the
//   batches bt in [b0, b1), on `threads` OpenMP threads (without OpenMP, the caller runs
//   disjoint (batch, column) ranges on threads of its own).
//
// A NaN operand entry means "no edge" (the semiring zero): NaN products never win a max or
// a min, because an update is `p > acc ? p : acc`, false for NaN.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

template <typename V>
inline V vmax(V x, V y) {
    return x > y ? x : y;
}

template <typename V>
inline V vmin(V x, V y) {
    return x < y ? x : y;
}

constexpr int C = 2;  // vectors per row in a block: W = C * lanes columns

// out[i, j] = max(start, max_q a[i, q] * b[q, j]) for R rows from i, W columns from j and
// q < kc, where start is `init`, or out's current value when `resume` (a later k block).
// a has row stride lda; b is a packed strip (row stride W); out has row stride ldo.
template <typename T, int R>
void max_block(const T* a, int64_t lda, const T* b, T* out, int64_t ldo, int64_t kc, T init,
               bool resume) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    V acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            acc[r][c] = resume ? load<V>(out + r * ldo + c * L) : V{} + init;
    for (int64_t q = 0; q < kc; ++q) {
        V bv[C];
        for (int c = 0; c < C; ++c) bv[c] = load<V>(b + q * W + c * L);
        for (int r = 0; r < R; ++r) {
            const T s = a[r * lda + q];
            for (int c = 0; c < C; ++c) acc[r][c] = vmax(bv[c] * s, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) store(out + r * ldo + c * L, acc[r][c]);
}

// Signed pairs: a is (ahi, alo), b is (bhi, blo), or a single point b (bhi == blo) when
// POINT. hi[i, j] = max_q of the largest corner product, lo = min_q of the smallest; empty
// (every q NaN) gives (-inf, +inf). Strides and `resume` as in max_block.
template <typename T, int R, bool POINT>
void signed_block(const T* ahi, const T* alo, int64_t lda, const T* bhi, const T* blo, T* hi,
                  T* lo, int64_t ldo, int64_t kc, bool resume) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    const T inf = __builtin_inf();
    V acc_hi[R][C], acc_lo[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            acc_hi[r][c] = resume ? load<V>(hi + r * ldo + c * L) : V{} - inf;
            acc_lo[r][c] = resume ? load<V>(lo + r * ldo + c * L) : V{} + inf;
        }
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
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            store(hi + r * ldo + c * L, acc_hi[r][c]);
            store(lo + r * ldo + c * L, acc_lo[r][c]);
        }
}

constexpr int ROWS = 4;
constexpr int64_t KC = 256;  // k block: a packed strip block (KC x W) stays in L1

// How pack() maps b's entries: unchanged, |b| (max-times of a lifted real derivative), or
// 0 -> NaN (a lifted signed point, where a zero derivative is no edge).
enum PackMode { PACK_COPY = 0, PACK_ABS = 1, PACK_ZERO_EMPTY = 2 };

// Copy columns [j, j + W) of the k x n matrix b into a contiguous k x W strip, so the
// kernel's loads are unit-stride whatever n is (large power-of-two row strides would
// otherwise map every row of the strip onto the same cache sets), mapped by `mode`.
template <typename T>
void pack(const T* b, int64_t k, int64_t n, int64_t j, std::vector<T>& strip, int mode) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, W = C * L;
    strip.resize(k * W);
    if (mode == PACK_COPY) {
        for (int64_t q = 0; q < k; ++q) std::memcpy(&strip[q * W], b + q * n + j, W * sizeof(T));
        return;
    }
    const V zero = V{} + T(0), nan = V{} + T(__builtin_nan(""));
    for (int64_t q = 0; q < k; ++q)
        for (int c = 0; c < C; ++c) {
            V v = load<V>(b + q * n + j + c * L);
            v = mode == PACK_ABS ? (v < zero ? -v : v) : (v == zero ? nan : v);
            store(&strip[q * W + c * L], v);
        }
}

// Run body(bt, cb, scratch) for every batch bt in [b0, b1) and column block cb in [c0, c1):
// on `threads` OpenMP threads when built with OpenMP. The library then shares the OpenMP
// runtime torch already loaded (same soname), so the team is torch's own intra-op threads,
// not a second pool competing with them for the cores.
struct Scratch {
    std::vector<float> f32[2];
    std::vector<double> f64[2];
    std::vector<float>* get(float*) { return f32; }
    std::vector<double>* get(double*) { return f64; }
};

template <typename Body>
void for_blocks(int64_t b0, int64_t b1, int64_t c0, int64_t c1, int threads, Body body) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Scratch scratch;
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = b0; bt < b1; ++bt)
            for (int64_t cb = c0; cb < c1; ++cb) body(bt, cb, scratch);
    }
#else
    (void)threads;
    Scratch scratch;
    for (int64_t bt = b0; bt < b1; ++bt)
        for (int64_t cb = c0; cb < c1; ++cb) body(bt, cb, scratch);
#endif
}

template <typename T>
void max_times(const T* a, const T* b, T* out, int64_t m, int64_t k, int64_t n, int64_t b0,
               int64_t b1, int64_t c0, int64_t c1, T init, int mode, int threads) {
    constexpr int W = C * Vec<T>::lanes;
    for_blocks(b0, b1, c0, c1, threads, [&](int64_t bt, int64_t cb, Scratch& scratch) {
        std::vector<T>& strip = scratch.get(static_cast<T*>(nullptr))[0];
        const T* ab = a + bt * m * k;
        T* ob = out + bt * m * n;
        const int64_t j = cb * W;
        pack(b + bt * k * n, k, n, j, strip, mode);
        for (int64_t q0 = 0; q0 < k; q0 += KC) {
            const int64_t kc = std::min(KC, k - q0);
            const T* sb = strip.data() + q0 * W;
            int64_t i = 0;
            for (; i + ROWS <= m; i += ROWS)
                max_block<T, ROWS>(ab + i * k + q0, k, sb, ob + i * n + j, n, kc, init, q0);
            for (; i < m; ++i)
                max_block<T, 1>(ab + i * k + q0, k, sb, ob + i * n + j, n, kc, init, q0);
        }
    });
}

template <typename T, bool POINT>
void signed_times(const T* ahi, const T* alo, const T* bhi, const T* blo, T* hi, T* lo,
                  int64_t m, int64_t k, int64_t n, int64_t b0, int64_t b1, int64_t c0,
                  int64_t c1, int mode, int threads) {
    constexpr int W = C * Vec<T>::lanes;
    for_blocks(b0, b1, c0, c1, threads, [&](int64_t bt, int64_t cb, Scratch& scratch) {
        std::vector<T>* strips = scratch.get(static_cast<T*>(nullptr));
        const int64_t ao = bt * m * k, bo = bt * k * n, oo = bt * m * n;
        const int64_t j = cb * W;
        pack(bhi + bo, k, n, j, strips[0], mode);
        if (!POINT) pack(blo + bo, k, n, j, strips[1], mode);
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

}  // namespace

extern "C" {

int block_width_f32() { return C * Vec<float>::lanes; }
int block_width_f64() { return C * Vec<double>::lanes; }

#ifdef _OPENMP
int uses_openmp() { return 1; }
#else
int uses_openmp() { return 0; }
#endif

void max_times_f32(const float* a, const float* b, float* out, int64_t m, int64_t k, int64_t n,
                   int64_t b0, int64_t b1, int64_t c0, int64_t c1, float init, int mode,
                   int threads) {
    max_times<float>(a, b, out, m, k, n, b0, b1, c0, c1, init, mode, threads);
}

void max_times_f64(const double* a, const double* b, double* out, int64_t m, int64_t k,
                   int64_t n, int64_t b0, int64_t b1, int64_t c0, int64_t c1, double init,
                   int mode, int threads) {
    max_times<double>(a, b, out, m, k, n, b0, b1, c0, c1, init, mode, threads);
}

void signed_times_f32(const float* ahi, const float* alo, const float* bhi, const float* blo,
                      float* hi, float* lo, int64_t m, int64_t k, int64_t n, int64_t b0,
                      int64_t b1, int64_t c0, int64_t c1, int mode, int threads) {
    if (blo)
        signed_times<float, false>(ahi, alo, bhi, blo, hi, lo, m, k, n, b0, b1, c0, c1, mode,
                                   threads);
    else
        signed_times<float, true>(ahi, alo, bhi, blo, hi, lo, m, k, n, b0, b1, c0, c1, mode,
                                  threads);
}

void signed_times_f64(const double* ahi, const double* alo, const double* bhi,
                      const double* blo, double* hi, double* lo, int64_t m, int64_t k,
                      int64_t n, int64_t b0, int64_t b1, int64_t c0, int64_t c1, int mode,
                      int threads) {
    if (blo)
        signed_times<double, false>(ahi, alo, bhi, blo, hi, lo, m, k, n, b0, b1, c0, c1, mode,
                                    threads);
    else
        signed_times<double, true>(ahi, alo, bhi, blo, hi, lo, m, k, n, b0, b1, c0, c1, mode,
                                   threads);
}

}  // extern "C"
