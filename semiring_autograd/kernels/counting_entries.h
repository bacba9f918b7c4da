// Counting's product of a value by lift(w) in one pass, as a CPU operator:
//
//   where_zero(w, fill, y)   where(w == 0, fill, y): fill (of no dimension) where w = 0,
//                            y elsewhere
//
// Counting keeps path counts in log space, lift(w) = 0 where w ≠ 0 and -inf where w = 0, so
// y ⊗ lift(w) is where(w == 0, -inf, y): two torch operators (the comparison, which makes
// its number a tensor and converts it on every call, then the select) and a bool
// temporary. For w and y contiguous, of one shape and one dtype (float32 or float64), and
// fill of that dtype, one loop writes a contiguous result; other operands take torch's
// where(eq(w, 0), fill, y) inside the operator: the same values and layout either way.
//
// Part of semiring_autograd; included by operators.cpp.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace counting_entries {

// one thread below this many entries (log_entries.h's PARALLEL_ENTRIES)
constexpr int64_t WHERE_ZERO_GRAIN = int64_t(1) << 15;

// out = fill where w = 0 (±0), else y, entries [0, count); a NaN w is not 0.
template <typename T>
void where_zero(const T* w, T fill, const T* y, T* out, int64_t count) {
    at::parallel_for(0, count, WHERE_ZERO_GRAIN, [&](int64_t begin, int64_t end) {
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) out[i] = w[i] == T(0) ? fill : y[i];
    });
}

// Whether the one loop takes the operands: CPU, float32/float64 of one dtype, w and y
// contiguous of one shape, fill of no dimension.
inline bool one_loop(const at::Tensor& w, const at::Tensor& fill, const at::Tensor& y) {
    const auto dtype = y.scalar_type();
    return (dtype == at::kFloat || dtype == at::kDouble) && w.scalar_type() == dtype &&
           fill.scalar_type() == dtype && fill.dim() == 0 && w.sizes() == y.sizes() &&
           w.is_contiguous() && y.is_contiguous() && w.is_cpu() && y.is_cpu() &&
           fill.is_cpu();
}

inline at::Tensor where_zero_op(const at::Tensor& w, const at::Tensor& fill,
                                const at::Tensor& y) {
    if (!one_loop(w, fill, y)) return at::where(at::eq(w, 0), fill, y);
    auto out = at::empty_like(y, at::MemoryFormat::Contiguous);
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "where_zero", [&] {
        where_zero<scalar_t>(w.const_data_ptr<scalar_t>(), fill.item<scalar_t>(),
                             y.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             out.numel());
    });
    return out;
}

}  // namespace counting_entries
