// Counting's product of a value by lift(w) in one pass, as a CPU operator:
//
//   where_zero(w, fill, y)   where(w == 0, fill, y): fill (of no dimension) where w = 0,
//                            y elsewhere
//
// Counting keeps path counts in log space, lift(w) = 0 where w ≠ 0 and -inf where w = 0, so
// y ⊗ lift(w) is where(w == 0, -inf, y): two torch operators (the comparison, which makes
// its number a tensor and converts it on every call, then the select) and a bool
// temporary. For y contiguous, w contiguous of y's shape or broadcast to it (a norm's
// weight over rows, a column, a scalar), both of one dtype (float32 or float64), and fill
// of that dtype, one loop over rows writes a contiguous result (torch's layout for such
// operands); other operands take torch's where(eq(w, 0), fill, y) inside the operator:
// the same values and layout either way. On devices other than the CPU the operator is
// that torch formula (operators.cpp registers it for CompositeExplicitAutograd).
//
// Part of semiring_autograd; included by operators.cpp.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

namespace counting_entries {

// one thread below this many entries (log_entries.h's PARALLEL_ENTRIES)
constexpr int64_t WHERE_ZERO_GRAIN = int64_t(1) << 15;

// Along rows of n entries of y (rows × n, contiguous): out = fill where w = 0 (±0), else
// y; w's entries for a row start at w + offset(row), one per entry (w_step 1) or one for
// the whole row (w_step 0). A NaN w is not 0.
template <typename T, typename Offset>
void where_zero_rows(const T* w, int64_t w_step, Offset offset, T fill, const T* y, T* out,
                     int64_t rows, int64_t n) {
    const int64_t grain = std::max<int64_t>(1, WHERE_ZERO_GRAIN / std::max<int64_t>(n, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        const T f = fill;  // a local: the captured reference could alias out, which kept
                           // the loop below scalar
        for (int64_t row = begin; row < end; ++row) {
            const T* wr = w + offset(row);
            const T* yr = y + row * n;
            T* o = out + row * n;
            if (w_step) {
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) o[j] = wr[j] == T(0) ? f : yr[j];
            } else if (*wr == T(0)) {
                for (int64_t j = 0; j < n; ++j) o[j] = f;
            } else {
                std::copy(yr, yr + n, o);
            }
        }
    });
}

// Whether the loop takes the operands: CPU, float32/float64 of one dtype, y contiguous of
// the shape w broadcasts to, w contiguous, fill of no dimension.
inline bool one_loop(const at::Tensor& w, const at::Tensor& fill, const at::Tensor& y) {
    const auto dtype = y.scalar_type();
    if (!((dtype == at::kFloat || dtype == at::kDouble) && w.scalar_type() == dtype &&
          fill.scalar_type() == dtype && fill.dim() == 0 && w.is_contiguous() &&
          y.is_contiguous() && w.is_cpu() && y.is_cpu() && fill.is_cpu() &&
          w.dim() <= y.dim()))
        return false;
    const int64_t skip = y.dim() - w.dim();
    for (int64_t d = 0; d < w.dim(); ++d)
        if (w.size(d) != 1 && w.size(d) != y.size(skip + d)) return false;
    return true;
}

inline at::Tensor where_zero_op(const at::Tensor& w, const at::Tensor& fill,
                                const at::Tensor& y) {
    if (!one_loop(w, fill, y)) return at::where(at::eq(w, 0), fill, y);
    auto out = at::empty_like(y, at::MemoryFormat::Contiguous);
    if (out.numel() == 0) return out;
    const int64_t d = y.dim(), n = d ? y.size(d - 1) : 1, rows = out.numel() / n;
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "where_zero", [&] {
        const scalar_t* wp = w.const_data_ptr<scalar_t>();
        const scalar_t* yp = y.const_data_ptr<scalar_t>();
        scalar_t* op = out.data_ptr<scalar_t>();
        const scalar_t f = *fill.const_data_ptr<scalar_t>();
        if (w.sizes() == y.sizes()) {
            where_zero_rows(wp, 1, [n](int64_t row) { return row * n; }, f, yp, op, rows, n);
            return;
        }
        const auto sizes = y.sizes().vec();
        const int64_t skip = d - w.dim();
        std::vector<int64_t> strides(d, 0);  // w's along y's dims, 0 where it broadcasts
        for (int64_t k = skip; k < d; ++k)
            if (w.size(k - skip) != 1) strides[k] = w.stride(k - skip);
        const int64_t w_step = d ? strides[d - 1] : 0;
        auto offset = [&](int64_t row) {  // w's offset for row (y's leading indices)
            int64_t at = 0;
            for (int64_t k = d - 2; k >= 0; --k) {
                at += (row % sizes[k]) * strides[k];
                row /= sizes[k];
            }
            return at;
        };
        where_zero_rows(wp, w_step, offset, f, yp, op, rows, n);
    });
    return out;
}

}  // namespace counting_entries
