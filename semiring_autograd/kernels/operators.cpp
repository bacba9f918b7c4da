// The CPU kernels of extreme_matmul.h and k_best.h as torch operators in the `semiring_autograd` namespace.
//
// Part of semiring_autograd. Built on first use by kernels/build.py through
// torch.utils.cpp_extension (-O3 -march=native -fno-trapping-math -fopenmp). The schemas are
// defined in Python (kernels/operators.py, with fake implementations and the CUDA kernels);
// this file registers the CPU kernels for them. Float32 and float64 only; the Python callers
// check dtypes, devices and shapes before they call.
//
// Threads: a call with less than PARALLEL_WORK multiply-reduce steps (an elementwise entry
// counts ENTRY_COST steps) runs on one thread, a larger one on torch's intra-op threads
// (at::get_num_threads()): built with OpenMP, the kernels share the OpenMP runtime torch
// loaded, so the team is torch's own threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <array>
#include <torch/library.h>

#include "extreme_matmul.h"
#include "k_best.h"
#include "log_entries.h"
#include "extreme_entries.h"
#include "counting_entries.h"
#include "standardize.h"
#include "attention_rows.h"

namespace {

constexpr int64_t PARALLEL_WORK = int64_t(1) << 18;
constexpr int64_t ENTRY_COST = 8;

int threads_for(int64_t work) {
    return work < PARALLEL_WORK ? 1 : std::max(1, at::get_num_threads());
}

// the column block of max_times and signed_times (operators.block_width states it for the
// fake implementations; tests/test_kernels.py checks that the two agree)
template <typename T>
constexpr int64_t width() {
    return C * Vec<T>::lanes;
}

int64_t block_width(at::ScalarType dtype) {
    return dtype == at::kDouble ? width<double>() : width<float>();
}

// b (batch, k, n) contiguous, its columns padded with `fill` to a multiple of the block width
at::Tensor pad_columns(const at::Tensor& b, int64_t w, double fill) {
    const int64_t n = b.size(-1), padded = (n + w - 1) / w * w;
    if (padded == n) return b.contiguous();
    auto out = at::full({b.size(0), b.size(1), padded}, fill, b.options());
    out.narrow(-1, 0, n).copy_(b);
    return out;
}

at::Tensor trim(const at::Tensor& out, int64_t n) {
    return out.size(-1) == n ? out : out.narrow(-1, 0, n);
}

// the matmul operands: 3-D, of a's dtype, with the leading sizes given (the kernels read
// them at those offsets)
void check_operands(const char* name, const at::Tensor& a, const std::vector<at::Tensor>& others,
                    std::vector<int64_t> leading) {
    TORCH_CHECK(a.dim() == 3, name, ": operands must be 3-D (batch, rows, cols), got ",
                a.sizes());
    for (const auto& t : others) {
        TORCH_CHECK(t.dim() == 3 && t.scalar_type() == a.scalar_type(), name,
                    ": operands must be 3-D of one dtype, got ", t.sizes(), " ",
                    t.scalar_type(), " beside ", a.sizes(), " ", a.scalar_type());
        for (size_t d = 0; d < leading.size(); ++d)
            TORCH_CHECK(t.size(d) == leading[d], name, ": an operand of shape ", t.sizes(),
                        " does not fit a of shape ", a.sizes(), " (size ", leading[d],
                        " expected in dim ", d, ")");
    }
}

// a 0-d bool tensor
at::Tensor flag(bool value) { return at::scalar_tensor(value, at::TensorOptions(at::kBool)); }

// The data of each tensor of `list`, contiguous: one that is not is copied, the copy kept
// in `keep` for the call.
template <typename T>
std::vector<const T*> contiguous_data(at::TensorList list, std::vector<at::Tensor>& keep) {
    std::vector<const T*> data;
    for (const auto& t : list) {
        if (t.is_contiguous()) {
            data.push_back(t.const_data_ptr<T>());
        } else {
            keep.push_back(t.contiguous());
            data.push_back(keep.back().const_data_ptr<T>());
        }
    }
    return data;
}

// (k, *shape) for KBest lists of k components each, all of one shape and dtype (float32 or
// float64), checked for operator `name`.
std::vector<int64_t> k_lists_shape(const char* name,
                                   std::initializer_list<at::TensorList> lists) {
    const auto& like = lists.begin()[0][0];
    for (const auto& list : lists)
        for (const auto& c : list)
            TORCH_CHECK(c.sizes() == like.sizes() && c.scalar_type() == like.scalar_type() &&
                            (c.scalar_type() == at::kFloat || c.scalar_type() == at::kDouble),
                        name, ": components of one shape and dtype (float32 or float64), got ",
                        c.sizes(), " ", c.scalar_type(), " beside ", like.sizes(), " ",
                        like.scalar_type());
    std::vector<int64_t> shape{int64_t(lists.begin()[0].size())};
    for (auto s : like.sizes()) shape.push_back(s);
    return shape;
}

#define FLOATING(dtype, ...)                                           \
    [&] {                                                              \
        if ((dtype) == at::kDouble) {                                  \
            using T = double;                                          \
            return __VA_ARGS__();                                      \
        }                                                              \
        TORCH_CHECK((dtype) == at::kFloat, "semiring_autograd kernels: float32 or float64, got ", \
                    (dtype));                                          \
        using T = float;                                               \
        return __VA_ARGS__();                                          \
    }()

// max_times of a (batch, m, k) and b (batch, k, n); given `nonfinite`, the operands'
// entries are tested as they are read, and out is all NaN where one is NaN or infinite.
static at::Tensor run_max_times(const char* name, const at::Tensor& a_, const at::Tensor& b_,
                                double init, bool abs_b, int* nonfinite) {
    const auto a = a_.contiguous();
    const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b_.size(-1);
    check_operands(name, a, {b_}, {batch, k});
    const auto b = b_.contiguous();  // packed with NaN past column n: no padded copy
    const int64_t w = block_width(a.scalar_type()), padded = (n + w - 1) / w * w;
    auto out = at::empty({batch, m, padded}, a.options());
    FLOATING(a.scalar_type(), [&] {
        const int64_t blocks = padded / width<T>();
        max_times<T>(a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), m, k, padded, 0, batch,
                     0, blocks, T(init), abs_b, threads_for(batch * m * k * padded), nonfinite,
                     n);
    });
    if (nonfinite && *nonfinite) out.fill_(NAN);
    return trim(out, n);
}

at::Tensor max_times_op(const at::Tensor& a_, const at::Tensor& b_, double init, bool abs_b) {
    return run_max_times("max_times", a_, b_, init, abs_b, nullptr);
}

// (out, nonfinite): max_times where every entry of a and b is finite; nonfinite (0-d bool)
// is true, and out all NaN, where one is NaN or infinite.
std::tuple<at::Tensor, at::Tensor> max_times_finite_op(const at::Tensor& a_, const at::Tensor& b_,
                                                       double init, bool abs_b) {
    int nonfinite = 0;
    auto out = run_max_times("max_times_finite", a_, b_, init, abs_b, &nonfinite);
    return {out, flag(nonfinite != 0)};
}

// (out, declined): k-best ⊕ of k_best.h for lists a, b of k components each (one shape and
// dtype, any strides: a component not contiguous is copied contiguous first); out
// (k, *shape); declined (0-d bool) true, and out all NaN, where
// a list is not descending or holds a NaN.
std::tuple<at::Tensor, at::Tensor> k_best_add_op(at::TensorList a, at::TensorList b) {
    TORCH_CHECK(!a.empty() && a.size() == b.size(),
                "k_best_add: lists a and b of one length k >= 1, got ", a.size(), " and ",
                b.size());
    const auto& like = a[0];
    auto out = at::empty(k_lists_shape("k_best_add", {a, b}), like.options());
    const int64_t count = like.numel();
    int declined = 0;
    FLOATING(like.scalar_type(), [&] {
        std::vector<at::Tensor> copies;
        const auto pa = contiguous_data<T>(a, copies), pb = contiguous_data<T>(b, copies);
        k_best_add<T>(pa, pb, out.data_ptr<T>(), count,
                      threads_for(count * int64_t(a.size())), &declined);
    });
    if (declined) out.fill_(NAN);
    return {out, flag(declined != 0)};
}

// (out, declined): KBest's leave-one-out ⊕ of k_best.h along the last dim of lists a of k
// components (one shape and dtype; copied contiguous where they are not); out (k, *shape);
// declined (0-d bool) true, and out all NaN, where a list is not descending or holds a NaN.
std::tuple<at::Tensor, at::Tensor> k_best_loo_op(at::TensorList a) {
    TORCH_CHECK(!a.empty() && a[0].dim() >= 1, "k_best_loo: lists a of k >= 1 components, "
                "each at least 1-D");
    const auto& like = a[0];
    auto out = at::empty(k_lists_shape("k_best_loo", {a}), like.options());
    const int64_t n = like.size(-1), rows = n ? like.numel() / n : 0;
    int declined = 0;
    FLOATING(like.scalar_type(), [&] {
        std::vector<at::Tensor> copies;
        const auto pa = contiguous_data<T>(a, copies);
        k_best_loo<T>(pa, out.data_ptr<T>(), rows, n,
                      threads_for(like.numel() * int64_t(a.size())), &declined);
    });
    if (declined) out.fill_(NAN);
    return {out, flag(declined != 0)};
}

// (out, declined): KBest's message at softmax's input (k_best.h) from lists a of k
// components and p along the last dim, all of one shape and dtype (copied contiguous where
// they are not); out (k, *shape); declined (0-d bool) true, and out all NaN, where a list is
// not descending or a product is NaN.
std::tuple<at::Tensor, at::Tensor> k_best_softmax_backward_op(at::TensorList a,
                                                               const at::Tensor& p_) {
    TORCH_CHECK(!a.empty() && a[0].dim() >= 1, "k_best_softmax_backward: lists a of k >= 1 "
                "components, each at least 1-D");
    const auto& like = a[0];
    auto out = at::empty(k_lists_shape("k_best_softmax_backward", {a}), like.options());
    TORCH_CHECK(p_.sizes() == like.sizes() && p_.scalar_type() == like.scalar_type(),
                "k_best_softmax_backward: p of the lists' shape and dtype, got ", p_.sizes(),
                " ", p_.scalar_type(), " beside ", like.sizes(), " ", like.scalar_type());
    const int64_t n = like.size(-1), rows = n ? like.numel() / n : 0;
    int declined = 0;
    FLOATING(like.scalar_type(), [&] {
        std::vector<at::Tensor> copies;
        const auto pa = contiguous_data<T>(a, copies);
        const auto p = p_.contiguous();
        k_best_softmax_backward<T>(pa, p.const_data_ptr<T>(), out.data_ptr<T>(), rows, n,
                                   threads_for(like.numel() * int64_t(a.size())), &declined);
    });
    if (declined) out.fill_(NAN);
    return {out, flag(declined != 0)};
}

// (out, nonfinite): the k-best matmul of k_best.h for lists a of ka components, each
// (batch, m, l), and b of kb components, each (batch or 1, l, n) (copied contiguous where
// they are not); out (k, batch, m, n); nonfinite (0-d bool) true, and out all NaN, where an
// entry that counts is NaN or infinite.
std::tuple<at::Tensor, at::Tensor> k_best_times_op(at::TensorList a_, at::TensorList b_,
                                                   int64_t k, bool abs_b, bool dead_count) {
    TORCH_CHECK(!a_.empty() && !b_.empty() && a_[0].dim() == 3 && b_[0].dim() == 3,
                "k_best_times: lists a of components (batch, m, l) and b of components "
                "(batch or 1, l, n)");
    const int64_t batch = a_[0].size(0), m = a_[0].size(1), l = a_[0].size(2);
    const int64_t n = b_[0].size(2);
    const auto dtype = a_[0].scalar_type();
    for (const auto& list : {a_, b_})
        for (const auto& c : list)
            TORCH_CHECK(c.sizes() == list[0].sizes() && c.scalar_type() == dtype,
                        "k_best_times: components of one shape and dtype per list, got ",
                        c.sizes(), " ", c.scalar_type(), " beside ", list[0].sizes(), " ",
                        dtype);
    TORCH_CHECK(k >= 1 && (b_[0].size(0) == batch || b_[0].size(0) == 1) && b_[0].size(1) == l,
                "k_best_times: an operand b of components of shape ", b_[0].sizes(),
                " does not fit a's components of shape ", a_[0].sizes(), " (k = ", k, ")");
    auto out = at::empty({k, batch, m, n}, a_[0].options());
    int nonfinite = 0;
    FLOATING(dtype, [&] {
        std::vector<at::Tensor> copies;
        // tiles read a's lists where they lie when its components share their strides; the
        // other paths take them as rows
        bool in_place = k_best_tiled<T>(m, n, int64_t(b_.size()));
        for (const auto& c : a_) in_place = in_place && c.strides() == a_[0].strides();
        std::vector<const T*> pa;
        if (in_place)
            for (const auto& c : a_) pa.push_back(c.const_data_ptr<T>());
        else
            pa = contiguous_data<T>(a_, copies);
        const auto pb = contiguous_data<T>(b_, copies);
        const int64_t b_batch = b_[0].size(0) == batch && batch > 1 ? l * n : 0;
        const int64_t sb = in_place ? a_[0].stride(0) : m * l;
        const int64_t si = in_place ? a_[0].stride(1) : l, sq = in_place ? a_[0].stride(2) : 1;
        k_best_times<T>(pa, sb, si, sq, pb, b_batch, out.data_ptr<T>(), k, batch, m, l, n,
                        abs_b, dead_count, threads_for(batch * m * l * n), &nonfinite);
    });
    if (nonfinite) out.fill_(NAN);
    return {out, flag(nonfinite != 0)};
}

std::tuple<at::Tensor, at::Tensor> signed_times_op(const at::Tensor& a_hi_,
                                                   const at::Tensor& a_lo_,
                                                   const at::Tensor& b_hi_,
                                                   const std::optional<at::Tensor>& b_lo_) {
    const auto a_hi = a_hi_.contiguous(), a_lo = a_lo_.contiguous();
    const int64_t batch = a_hi.size(0), m = a_hi.size(1), k = a_hi.size(2), n = b_hi_.size(-1);
    check_operands("signed_times", a_hi, {a_lo}, {batch, m, k});
    check_operands("signed_times", a_hi, b_lo_ ? std::vector<at::Tensor>{b_hi_, *b_lo_}
                                                : std::vector<at::Tensor>{b_hi_},
                   {batch, k, n});
    const int64_t w = block_width(a_hi.scalar_type());
    const auto b_hi = pad_columns(b_hi_, w, NAN);
    const auto b_lo = b_lo_ ? pad_columns(*b_lo_, w, NAN) : at::Tensor();
    const int64_t padded = b_hi.size(-1);
    auto hi = at::empty({batch, m, padded}, a_hi.options());
    auto lo = at::empty({batch, m, padded}, a_hi.options());
    FLOATING(a_hi.scalar_type(), [&] {
        const int64_t blocks = padded / width<T>();
        const int threads = threads_for(batch * m * k * padded * (b_lo.defined() ? 4 : 2));
        if (b_lo.defined())
            signed_times<T, false>(a_hi.data_ptr<T>(), a_lo.data_ptr<T>(), b_hi.data_ptr<T>(),
                                   b_lo.data_ptr<T>(), hi.data_ptr<T>(), lo.data_ptr<T>(), m, k,
                                   padded, 0, batch, 0, blocks, threads);
        else
            signed_times<T, true>(a_hi.data_ptr<T>(), a_lo.data_ptr<T>(), b_hi.data_ptr<T>(),
                                  nullptr, hi.data_ptr<T>(), lo.data_ptr<T>(), m, k, padded, 0,
                                  batch, 0, blocks, threads);
    });
    return {trim(hi, n), trim(lo, n)};
}

// Up to this many terms on one thread (with w read along its rows) lift_times runs its
// terms directly: packing, pruning and the transposed write-out cost more than they save
// (measured: 7.5 µs against 12.6 µs at 32K terms, 37 against 44 at 176K).
constexpr int64_t DIRECT_TERMS = int64_t(1) << 18;

// the signed pair a (B, m, k) times lift(w), w (B or 1, k, n), any strides: the kernel
// computes lift(wᵀ) ⊗ aᵀ and writes it transposed
std::tuple<at::Tensor, at::Tensor> lift_times_op(const at::Tensor& a_hi_, const at::Tensor& a_lo_,
                                                 const at::Tensor& w, bool zero_empty) {
    auto a_hi = a_hi_, a_lo = a_lo_;
    if (a_hi.strides() != a_lo.strides()) {
        a_hi = a_hi.contiguous();
        a_lo = a_lo.contiguous();
    }
    const int64_t batch = a_hi.size(0), m = a_hi.size(1), k = a_hi.size(2), n = w.size(-1);
    check_operands("lift_times", a_hi, {a_lo}, {batch, m, k});
    TORCH_CHECK(w.dim() == 3 && (w.size(0) == batch || w.size(0) == 1) && w.size(1) == k,
                "lift_times: w must be (", batch, " or 1, ", k, ", n), got ", w.sizes());
    auto hi = at::empty({batch, m, n}, w.options());
    auto lo = at::empty({batch, m, n}, w.options());
    const int64_t w_batch = w.size(0) > 1 ? w.stride(0) : 0;
    const int64_t terms = batch * m * k * n;
    const int threads = threads_for(terms * 2);
    if (threads == 1 && terms <= DIRECT_TERMS && w.stride(2) == 1) {
        FLOATING(w.scalar_type(), [&] {
            lift_times_direct<T>(w.const_data_ptr<T>(), w_batch, w.stride(1),
                                 a_hi.const_data_ptr<T>(), a_lo.const_data_ptr<T>(),
                                 a_hi.stride(0), a_hi.stride(1), a_hi.stride(2),
                                 hi.data_ptr<T>(), lo.data_ptr<T>(), batch, m, k, n,
                                 zero_empty);
        });
        return {hi, lo};
    }
    FLOATING(w.scalar_type(), [&] {
        const int64_t blocks = (m + width<T>() - 1) / width<T>();
        lift_times<T>(w.const_data_ptr<T>(), w_batch, w.stride(2),
                      w.stride(1), a_hi.const_data_ptr<T>(), a_lo.const_data_ptr<T>(),
                      a_hi.stride(0), a_hi.stride(2), a_hi.stride(1), hi.data_ptr<T>(),
                      lo.data_ptr<T>(), n, k, m, 0, batch, 0, blocks, zero_empty, threads);
    });
    return {hi, lo};
}

// inputs broadcast together (no broadcast when their shapes agree), contiguous
std::vector<at::Tensor> broadcast_contiguous(std::vector<at::Tensor> inputs) {
    bool same = true;
    for (const auto& t : inputs) same = same && t.sizes() == inputs[0].sizes();
    auto expanded = same ? std::move(inputs) : at::broadcast_tensors(inputs);
    for (auto& t : expanded) t = t.contiguous();
    return expanded;
}

int entry_threads(int64_t count) { return threads_for(count * ENTRY_COST); }

// An elementwise kernel with two outputs over its inputs broadcast together: kernel(the
// inputs' data, the outputs' data, the entry count, threads).
template <typename Kernel>
std::tuple<at::Tensor, at::Tensor> entries_to_pair(std::vector<at::Tensor> inputs,
                                                   Kernel kernel) {
    const auto in = broadcast_contiguous(std::move(inputs));
    auto x = at::empty_like(in[0]), y = at::empty_like(in[0]);
    FLOATING(x.scalar_type(), [&] {
        std::array<const T*, 4> data{};
        for (size_t i = 0; i < in.size(); ++i) data[i] = in[i].const_data_ptr<T>();
        kernel(data, x.data_ptr<T>(), y.data_ptr<T>(), x.numel(), entry_threads(x.numel()));
    });
    return {x, y};
}

std::tuple<at::Tensor, at::Tensor> signed_mul_lift_op(const at::Tensor& a_hi,
                                                      const at::Tensor& a_lo,
                                                      const at::Tensor& w) {
    return entries_to_pair({a_hi, a_lo, w}, [](auto in, auto* hi, auto* lo, int64_t n, int t) {
        signed_mul_lift(in[0], in[1], in[2], hi, lo, n, t);
    });
}

// A w smaller than the value (a scalar, a row or a column broadcast over it) takes log|w|
// of each entry of w once, then one pass over the value reading it broadcast: no w-sized
// copy of the value's size, no log per entry.
std::tuple<at::Tensor, at::Tensor> entropy_mul_lift_spread_op(const at::Tensor& la_,
                                                              const at::Tensor& r_,
                                                              const at::Tensor& w_) {
    const auto la = la_.contiguous(), r = r_.contiguous(), w = w_.contiguous();
    const auto spread = w.expand(la.sizes());
    const auto steps = spread.strides();  // 0 along the broadcast dims
    const int64_t d = la.dim(), n = d ? la.size(-1) : 1, rows = la.numel() / n;
    std::vector<int64_t> w_at(rows), index(std::max<int64_t>(d - 1, 0), 0);
    for (int64_t row = 0, at = 0; row < rows; ++row) {  // w's offset per row, an odometer
        w_at[row] = at;
        for (int64_t k = d - 2; k >= 0; --k) {
            at += steps[k];
            if (++index[k] < la.size(k)) break;
            at -= steps[k] * la.size(k);
            index[k] = 0;
        }
    }
    auto out_l = at::empty_like(la), out_r = at::empty_like(la);
    FLOATING(la.scalar_type(), [&] {
        std::vector<T> lw(w.numel());
        const T* ws = w.const_data_ptr<T>();
        for (size_t i = 0; i < lw.size(); ++i) lw[i] = log_abs_entry(ws[i]);
        entropy_mul_lift_spread<T>(la.const_data_ptr<T>(), r.const_data_ptr<T>(), lw.data(),
                                   w_at.data(), d ? steps[d - 1] : 0, out_l.data_ptr<T>(),
                                   out_r.data_ptr<T>(), n, rows, entry_threads(la.numel()));
    });
    return {out_l, out_r};
}

// whether w broadcasts to x's shape (each of w's dims 1 or x's)
bool spreads_into(const at::Tensor& w, const at::Tensor& x) {
    if (w.dim() > x.dim()) return false;
    for (int64_t d = 1; d <= w.dim(); ++d)
        if (w.size(-d) != 1 && w.size(-d) != x.size(-d)) return false;
    return true;
}

std::tuple<at::Tensor, at::Tensor> entropy_mul_lift_op(const at::Tensor& la, const at::Tensor& r,
                                                       const at::Tensor& w) {
    if (la.sizes() == r.sizes() && w.numel() < la.numel() && spreads_into(w, la))
        return entropy_mul_lift_spread_op(la, r, w);
    return entries_to_pair({la, r, w}, [](auto in, auto* l, auto* q, int64_t n, int t) {
        entropy_mul_lift(in[0], in[1], in[2], l, q, n, t);
    });
}

std::tuple<at::Tensor, at::Tensor> entropy_add_op(const at::Tensor& la, const at::Tensor& ra,
                                                  const at::Tensor& lb, const at::Tensor& rb) {
    return entries_to_pair({la, ra, lb, rb}, [](auto in, auto* l, auto* q, int64_t n, int t) {
        using T = std::remove_pointer_t<decltype(l)>;
        entropy_add_rows<T>({in[0], 0}, {in[1], 0}, {in[2], 0}, {in[3], 0}, {l, 0}, {q, 0}, 1, n,
                            t);
    });
}

// (out_l, out_r) = (la, ra) ⊕ (lb, rb) for operands of log_entries::check_add_rows; the
// outputs may be (la, ra) or (lb, rb) themselves (in place).
void entropy_add_rows_op(at::Tensor out_l, at::Tensor out_r, const at::Tensor& la,
                         const at::Tensor& ra, const at::Tensor& lb, const at::Tensor& rb) {
    using log_entries::rows_into, log_entries::rows_of;
    log_entries::check_add_rows("entropy_add_rows_", {&out_l, &out_r}, {&la, &ra, &lb, &rb});
    const int64_t rows = out_l.size(0), n = out_l.size(1);
    if (rows == 0 || n == 0) return;
    AT_DISPATCH_FLOATING_TYPES(out_l.scalar_type(), "entropy_add_rows_", [&] {
        entropy_add_rows<scalar_t>(rows_of<scalar_t>(la), rows_of<scalar_t>(ra),
                                   rows_of<scalar_t>(lb), rows_of<scalar_t>(rb),
                                   rows_into<scalar_t>(out_l), rows_into<scalar_t>(out_r), rows,
                                   n, threads_for(rows * n));
    });
}

void ratio_where_positive_op(at::Tensor num, const at::Tensor& den) {
    TORCH_CHECK(num.is_contiguous() && den.is_contiguous() && num.sizes() == den.sizes(),
                "ratio_where_positive_: num and den contiguous, of one shape");
    FLOATING(num.scalar_type(), [&] {
        ratio_where_positive<T>(num.data_ptr<T>(), den.data_ptr<T>(), num.numel(),
                                entry_threads(num.numel()));
    });
}

// per-row kernels: (x, r, two outputs, a flag per row, the row length, rows, threads)
template <typename Kernel>
void over_rows(Kernel kernel, const at::Tensor& x, const at::Tensor& r, at::Tensor& out,
               at::Tensor& out2, at::Tensor& flags) {
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
    FLOATING(x.scalar_type(), [&] {
        kernel((T*)nullptr, x.data_ptr<T>(), r.defined() ? r.data_ptr<T>() : nullptr,
               out.data_ptr<T>(), out2.defined() ? out2.data_ptr<T>() : nullptr,
               flags.data_ptr<uint8_t>(), n, rows, entry_threads(x.numel()));
    });
}

// (out_l, out_r, declined): declined is true when some row held NaN or +inf and was left
// uncomputed (the caller's torch formula then handles every row); out_r is empty without r
std::tuple<at::Tensor, at::Tensor, at::Tensor> loo_log_op(const at::Tensor& x_,
                                                          const std::optional<at::Tensor>& r_) {
    const auto x = x_.contiguous();
    const auto r = r_ ? r_->contiguous() : at::Tensor();
    auto out_l = at::empty_like(x);
    auto out_r = r.defined() ? at::empty_like(r) : at::empty({0}, x.options());
    auto no_r = r.defined() ? out_r : at::Tensor();
    auto bad = at::zeros({x.size(-1) ? x.numel() / x.size(-1) : 0}, x.options().dtype(at::kByte));
    over_rows(
        [](auto* tag, auto* xs, auto* rs, auto* ls, auto* qs, uint8_t* flags, int64_t n,
           int64_t rows, int threads) {
            using T = std::remove_pointer_t<decltype(tag)>;
            loo_log<T>(xs, rs, ls, qs, flags, n, 0, rows, threads);
        },
        x, r, out_l, no_r, bad);
    return {out_l, out_r, bad.any().to(at::kBool)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_reduce_rows_op(const at::Tensor& la_,
                                                                      const at::Tensor& r_) {
    const auto la = la_.contiguous(), r = r_.contiguous();
    auto shape = la.sizes().vec();
    shape.back() = 1;
    auto out_l = at::empty(shape, la.options()), out_r = at::empty(shape, la.options());
    auto bad = at::zeros({la.numel() / la.size(-1)}, la.options().dtype(at::kByte));
    over_rows(
        [](auto* tag, auto* xs, auto* rs, auto* ls, auto* qs, uint8_t* flags, int64_t n,
           int64_t rows, int threads) {
            using T = std::remove_pointer_t<decltype(tag)>;
            entropy_reduce_rows<T>(xs, rs, ls, qs, flags, n, 0, rows, threads);
        },
        la, r, out_l, out_r, bad);
    return {out_l, out_r, bad.any().to(at::kBool)};
}

// (shift, live), each (…, m, 1); e = exp(a - shift) (or [e·r | e]) written into out
std::tuple<at::Tensor, at::Tensor> log_space_rows_op(const at::Tensor& a,
                                                     const std::optional<at::Tensor>& r_,
                                                     at::Tensor out) {
    const auto r = r_ ? *r_ : at::Tensor();
    auto shape = a.sizes().vec();
    shape.back() = 1;
    auto shift = at::empty(shape, a.options());
    auto live = at::empty(shape, a.options().dtype(at::kBool));
    auto live_bytes = live.view(at::kByte);
    over_rows(
        [](auto* tag, auto* xs, auto* rs, auto* es, auto* shifts, uint8_t* flags, int64_t n,
           int64_t rows, int threads) {
            using T = std::remove_pointer_t<decltype(tag)>;
            log_space_rows<T>(xs, rs, es, shifts, flags, n, 0, rows, threads);
        },
        a, r, out, shift, live_bytes);
    return {shift, live};
}

// out (…, 2k, n) = [|w|; |w|·(-log|w|)] for w (…, k, n)
void entropy_weights_op(const at::Tensor& w_, at::Tensor out) {
    const auto w = w_.contiguous();
    const int64_t count = w.size(-2) * w.size(-1), batch = count ? w.numel() / count : 0;
    FLOATING(w.scalar_type(), [&] {
        entropy_weights<T>(w.data_ptr<T>(), out.data_ptr<T>(), count, 0, count, 0, batch,
                           entry_threads(w.numel()));
    });
}

// (out_l, out_r, declined): entropy_softmax_backward_rows along the last dim of gl, gr and p
// (contiguous, of one shape and dtype); declined (0-d bool) true when a row was left
// uncomputed (the caller's torch formula then handles every row)
std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_softmax_backward_op(const at::Tensor& gl,
                                                                           const at::Tensor& gr,
                                                                           const at::Tensor& p) {
    log_entries::check_entries("entropy_softmax_backward", gl, p);
    log_entries::check_entries("entropy_softmax_backward", gr, p);
    TORCH_CHECK(p.dim() >= 1, "entropy_softmax_backward: g and p must have a dim to work along");
    const int64_t n = p.size(-1), rows = n ? p.numel() / n : 0;
    auto out_l = at::empty_like(p), out_r = at::empty_like(p);
    std::vector<uint8_t> bad(rows);
    FLOATING(p.scalar_type(), [&] {
        entropy_softmax_backward_rows<T>(gl.const_data_ptr<T>(), gr.const_data_ptr<T>(),
                                         p.const_data_ptr<T>(), out_l.data_ptr<T>(),
                                         out_r.data_ptr<T>(), bad.data(), n, 0, rows,
                                         entry_threads(4 * p.numel()));
    });
    const bool declined = std::any_of(bad.begin(), bad.end(), [](uint8_t b) { return b != 0; });
    return {out_l, out_r, at::scalar_tensor(declined, p.options().dtype(at::kBool))};
}

// Tests that choose a fused path, one operator each: a captured program replays one call
// and one read where torch formulas take three per tensor. A float32/float64 tensor is
// scanned in memory order, once per distinct entry (a broadcast dim read at index 0; a
// layout that does not fill its memory copied first); integer and bool tensors hold no NaN
// or infinity; other dtypes go through the same tests as torch operators.

bool scanned(const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

bool exact_type(const at::Tensor& t) {
    return at::isIntegralType(t.scalar_type(), /*includeBool=*/true);
}

// t's distinct entries, filling their memory
at::Tensor distinct_dense(const at::Tensor& t) {
    auto u = t;
    for (int64_t d = 0; d < u.dim(); ++d)
        if (u.stride(d) == 0 && u.size(d) > 1) u = u.narrow(d, 0, 1);
    return u.is_non_overlapping_and_dense() ? u : u.contiguous();
}

// Whether some tensor holds a NaN or an infinity of the sign given for it (+1: +inf, -1:
// -inf, 0: either): its distinct float32/float64 entries scanned in C++, other floating
// dtypes through torch operators.
at::Tensor any_nan_or_inf_op(at::TensorList tensors, at::IntArrayRef signs) {
    TORCH_CHECK(signs.size() == tensors.size(), "any_nan_or_inf: ", tensors.size(),
                " tensors but ", signs.size(), " signs");
    for (size_t i = 0; i < tensors.size(); ++i) {
        const auto& t = tensors[i];
        const int sign = static_cast<int>(signs[i]);
        if (exact_type(t) || t.numel() == 0) continue;
        bool hit;
        if (scanned(t)) {
            const auto u = distinct_dense(t);
            hit = FLOATING(u.scalar_type(), [&] {
                return nan_or_inf(u.const_data_ptr<T>(), u.numel(), sign, entry_threads(u.numel()));
            });
        } else {
            hit = at::isnan(t).any().item<bool>() ||
                  (sign >= 0 && at::isposinf(t).any().item<bool>()) ||
                  (sign <= 0 && at::isneginf(t).any().item<bool>());
        }
        if (hit) return flag(true);
    }
    return flag(false);
}

// tensor_ops.on_live_rows: every row along the last dim of x has a term (x, y contiguous)
at::Tensor all_rows_live_op(const at::Tensor& x, const std::optional<at::Tensor>& y,
                            double empty) {
    TORCH_CHECK(x.is_contiguous() && (!y || (y->is_contiguous() && y->sizes() == x.sizes())),
                "all_rows_live: x (and y) contiguous, of one shape");
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
    if (n == 0) return flag(rows == 0);
    return flag(FLOATING(x.scalar_type(), [&] {
        return all_rows_live<T>(x.const_data_ptr<T>(), y ? y->const_data_ptr<T>() : nullptr, rows,
                                n, T(empty));
    }));
}

// log_space.LogSpaceGemm's last steps, when its shifted sums z (…, m, n) are exact
// (gemm_exact, with live (…, m, 1)): num = num / z (0 where z is 0), z = log z + shift
// (+ shift_b), in place, and true; otherwise nothing is written, and false.
at::Tensor log_gemm_finish_op(at::Tensor z, const std::optional<at::Tensor>& num,
                              const at::Tensor& shift, const std::optional<at::Tensor>& shift_b,
                              const at::Tensor& live, double tiny, bool may_overflow) {
    const int64_t n = z.size(-1), rows = n ? z.numel() / n : 0;
    TORCH_CHECK(z.is_contiguous() && live.is_contiguous() && live.numel() == rows &&
                    live.scalar_type() == at::kBool,
                "log_gemm_finish_: z contiguous, live a contiguous bool flag per row of z");
    TORCH_CHECK(!num || (num->is_contiguous() && num->sizes() == z.sizes()),
                "log_gemm_finish_: num contiguous, of z's shape");
    const bool exact = FLOATING(z.scalar_type(), [&] {
        return gemm_exact<T>(z.const_data_ptr<T>(), live.const_data_ptr<bool>(), rows, n,
                             T(tiny), may_overflow, entry_threads(z.numel()));
    });
    if (!exact) return flag(false);
    if (num) {
        FLOATING(z.scalar_type(), [&] {
            ratio_where_positive<T>(num->data_ptr<T>(), z.const_data_ptr<T>(), z.numel(),
                                    entry_threads(z.numel()));
        });
    }
    if (!log_entries::log_plus_shifts_(z, shift, shift_b)) {
        z.log_().add_(shift);
        if (shift_b) z.add_(*shift_b);
    }
    return flag(true);
}

}  // namespace

TORCH_LIBRARY_IMPL(semiring_autograd, CPU, m) {
    m.impl("any_nan_or_inf", &any_nan_or_inf_op);
    m.impl("log_gemm_finish_", &log_gemm_finish_op);
    m.impl("all_rows_live", &all_rows_live_op);
    m.impl("max_times", &max_times_op);
    m.impl("max_times_finite", &max_times_finite_op);
    m.impl("k_best_times", &k_best_times_op);
    m.impl("k_best_add", &k_best_add_op);
    m.impl("k_best_loo", &k_best_loo_op);
    m.impl("k_best_softmax_backward", &k_best_softmax_backward_op);
    m.impl("signed_times", &signed_times_op);
    m.impl("lift_times", &lift_times_op);
    m.impl("signed_mul_lift", &signed_mul_lift_op);
    m.impl("entropy_mul_lift", &entropy_mul_lift_op);
    m.impl("entropy_add", &entropy_add_op);
    m.impl("entropy_add_rows_", &entropy_add_rows_op);
    m.impl("ratio_where_positive_", &ratio_where_positive_op);
    m.impl("loo_log", &loo_log_op);
    m.impl("entropy_reduce_rows", &entropy_reduce_rows_op);
    m.impl("log_space_rows", &log_space_rows_op);
    m.impl("entropy_weights", &entropy_weights_op);
    m.impl("plus_log_abs", &log_entries::plus_log_abs_op);
    m.impl("log_add", &log_entries::log_add_op);
    m.impl("log_add_rows_", &log_entries::log_add_rows_op);
    m.impl("softmax_backward_log", &log_entries::softmax_backward_log_op);
    m.impl("log_space_columns", &log_entries::log_space_columns_op);
    m.impl("softmax_backward_max", &extreme_entries::softmax_backward_max_op);
    m.impl("softmax_backward_or", &extreme_entries::softmax_backward_or_op);
    m.impl("softmax_backward_signed", &extreme_entries::softmax_backward_signed_op);
    m.impl("entropy_softmax_backward", &entropy_softmax_backward_op);
    m.impl("standardize_max", &standardize::standardize_max_op);
    m.impl("standardize_log", &standardize::standardize_log_op);
    m.impl("entropy_standardize", &standardize::entropy_standardize_op);
    m.impl("where_zero", &counting_entries::where_zero_op);
    m.impl("softmax_rows_", &attention_rows::softmax_rows_op);
}

// where_zero on every other device: torch's where(eq(w, 0), fill, y) inside the operator (a
// compiled program may call it with a CPU number-like w and a y elsewhere).
TORCH_LIBRARY_IMPL(semiring_autograd, CompositeExplicitAutograd, m) {
    m.impl("where_zero", &counting_entries::where_zero_op);
}
