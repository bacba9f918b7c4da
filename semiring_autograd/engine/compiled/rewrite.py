"""Rewriting a recorded program before its source is generated, each rewrite giving the same
values bit for bit with fewer operator calls:

- a view of a view read nowhere else becomes one ``as_strided`` of the first one's base;
- every other view is one ``as_strided`` of its base (a call through torch's Python binding,
  cheaper than a view operator without one, ``slice``, and than ``view`` itself);
- a view taken twice (the same ``as_strided`` of the same base) is taken once;
- the one part of a ``split_with_sizes`` whose other parts are empty is its input;
- a copy into a fresh buffer from a fresh value of the same layout, neither read elsewhere,
  is that value; a copy into a fresh buffer read nowhere else, filling it, is a ``clone``;
- a clone of a fresh row-major value read nowhere else is that value;
- a new filled buffer (``full``, ``zeros``, ``ones``) into one part of which (a range
  along one dimension) a value is copied, read nowhere before the copy, is one ``cat``
  of that value and the filled parts around it, made once (the rotary embedding's
  backward pads each half of a gradient so);
- ``where(eq(w, 0), fill, y)`` on CPU float tensors is one ``where_zero(w, fill, y)``
  (Counting's product by a lifted value);
- a comparison of a float tensor with a number compares it with the number as a
  constant of the tensor's dtype (made once, not converted on every call);
- a tensor made from numbers alone (``full``, ``scalar_tensor``), and views of it, that the
  program only reads is made once, when the program is built: a constant;
- a view of a constant (a weight's transpose, a slice of a scratch buffer) that the program
  does not return is a ``ConstantView``, made once by the program (``program.py``: per
  thread for a scratch buffer it writes into, anew where the constant's storage changed);
- steps whose values nothing reads are dropped.

The layouts these rules compare are the recorded ones, the same in every replay: the
signature fixes the inputs', and the operators before a step are the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ... import kernels
from .steps import (
    SCALAR_COMPARISONS,
    Constant,
    _aten,
    _argument,
    _Ref,
    _refs,
    _Step,
    _traits,
    _written,
)

#: operators giving a buffer whose contents are not set
_ALLOCATIONS = frozenset(
    {
        _aten.new_empty.default,
        _aten.empty.memory_format,
        _aten.empty_like.default,
    }
)
#: operators giving a new buffer, its contents set or not
_FILLS = _ALLOCATIONS | {
    _aten.full.default,
    _aten.new_full.default,
    _aten.zeros.default,
    _aten.new_zeros.default,
    _aten.ones.default,
    _aten.new_ones.default,
    _aten.zeros_like.default,
    _aten.full_like.default,
}
#: operators making a tensor from numbers alone
_FACTORIES = frozenset(
    {
        _aten.full.default,
        _aten.scalar_tensor.default,
        _aten.zeros.default,
        _aten.ones.default,
    }
)
#: the most elements of a tensor made once for the program (it holds it)
HOISTED_NUMEL = 1 << 16


def rewrite(
    steps: list[_Step], results: list, constants: list[Tensor]
) -> tuple[list[_Step], list, list[Tensor]]:
    """The steps a replay runs, the results' layout and the constants (the recorded ones,
    then those made once) after the rewrites of the module docstring."""
    steps = _strided_views(_fold_views(steps, results))
    steps, results = _merge_views(steps, results)
    steps, results = _whole_splits(steps, results)
    steps, results = _fill_from_fresh(steps, results)
    steps, results = _clone_into_fresh(steps, results)
    steps, results = _clone_of_fresh(steps, results)
    steps, constants = _fill_in_part(_live_steps(steps, results), results, constants)
    steps, constants = _hoist(steps, results, constants)
    steps = _where_zero(steps, results, constants)
    steps, constants = _tensor_comparisons(steps, constants)
    steps, results, constants = _constant_views(steps, results, constants)
    return _live_steps(steps, results), results, constants


def _uses(steps: list[_Step], results: list) -> dict[int, int]:
    """How many times each value is read (by a step's arguments or as a result)."""
    uses: dict[int, int] = {}
    for index in _refs(results):
        uses[index] = uses.get(index, 0) + 1
    for step in steps:
        for index in step.reads:
            uses[index] = uses.get(index, 0) + 1
    return uses


def _swap(tree: Any, subst: dict[int, Any]) -> Any:
    """``tree`` (a template) with each value in ``subst`` replaced."""
    if isinstance(tree, _Ref):
        found = subst.get(tree.index)
        return tree if found is None else found
    if isinstance(tree, (list, tuple)):
        return type(tree)([_swap(x, subst) for x in tree])
    if isinstance(tree, dict):
        return {k: _swap(v, subst) for k, v in tree.items()}
    return tree


def _substitute(steps: list[_Step], results: list, subst: dict[int, Any]) -> tuple[list, list]:
    """Steps and results reading ``subst[v]`` (a value or a constant) where they read value
    ``v``; chains (``a -> b -> c``) followed to their end."""
    if not subst:
        return steps, results
    for index in list(subst):
        target = subst[index]
        while isinstance(target, _Ref) and target.index in subst:
            target = subst[target.index]
        subst[index] = target
    swapped = []
    for step in steps:
        if not subst.keys().isdisjoint(step.reads):
            args, kwargs = _swap(step.args, subst), _swap(step.kwargs, subst)
            step = dataclasses.replace(step, args=args, kwargs=kwargs, reads=_refs((args, kwargs)))
        swapped.append(step)
    layout = [None if r is None else (r[0], _swap(r[1], subst), *r[2:]) for r in results]
    return swapped, layout


def _outputs(step: _Step) -> list[int]:
    return [o.index for o in step.outputs if type(o) is _Ref]


def _fold_views(steps: list[_Step], results: list) -> list[_Step]:
    """A view of a view read nowhere else becomes one ``as_strided`` of the first one's
    base, with the recorded size, strides and storage offset: the same view of the same
    storage in one call."""
    uses = _uses(steps, results)
    producer: dict[int, _Step] = {}
    folded = []
    for step in steps:
        source = step.args[0] if step.view is not None and step.args else None
        before = producer.get(source.index) if isinstance(source, _Ref) else None
        if before is not None and before.view is not None and uses[source.index] == 1:
            size, stride, offset = step.view
            base = before.args[0]
            step = _Step(
                _aten.as_strided.default,
                (base, size, stride, offset),
                {},
                step.outputs,
                False,
                [base.index] if isinstance(base, _Ref) else [],
                view=step.view,
            )
        for out in _outputs(step):
            producer[out] = step
        folded.append(step)
    return folded


def _strided_views(steps: list[_Step]) -> list[_Step]:
    """Each view step as ``as_strided`` of its base with the recorded size, strides and
    storage offset: the same view of the same storage."""
    strided = []
    for step in steps:
        base = step.args[0] if step.view is not None and step.args else None
        if isinstance(base, (_Ref, Constant)) and step.func is not _aten.as_strided.default:
            step = _Step(
                _aten.as_strided.default,
                (base, *step.view),
                {},
                step.outputs,
                False,
                [base.index] if isinstance(base, _Ref) else [],
                view=step.view,
            )
        strided.append(step)
    return strided


def _reshaped(steps: list[_Step]) -> set[int]:
    """The values an operator changing a shape in place (``t_``) reads or gives."""
    reshaped: set[int] = set()
    for step in steps:
        if _traits(step.func).inplace_view:
            reshaped.update(step.reads)
            reshaped.update(_outputs(step))
    return reshaped


def _merge_views(steps: list[_Step], results: list) -> tuple[list, list]:
    """The same view (``as_strided`` with the same size, strides and offset) of the same
    base taken again (a view reads no data): its result is the first one's; a view of a
    view so merged is a view of the first one. Not where a view's shape is changed in
    place (``t_``): then every value such an operator touches keeps its own views."""
    reshaped = _reshaped(steps)
    returned = set(_refs(results))
    seen: dict[Any, int] = {}
    subst: dict[int, Any] = {}
    kept = []
    for step in steps:
        outs = _outputs(step) if step.func is _aten.as_strided.default else ()
        if (
            len(outs) == 1
            and not reshaped.intersection(step.reads)
            and outs[0] not in reshaped
            and outs[0] not in returned
        ):
            base = step.args[0]
            if isinstance(base, _Ref):
                base = subst.get(base.index, base)
            first = seen.setdefault((base, step.view), outs[0])
            if first != outs[0]:
                subst[outs[0]] = _Ref(first)
                continue
        kept.append(step)
    return _substitute(kept, results, subst)


def _whole_splits(steps: list[_Step], results: list) -> tuple[list, list]:
    """``split_with_sizes(x, sizes, d)`` with one size not 0: that part is ``x`` whole (the
    sizes add up to x's size along d, so it starts at 0 and spans d: x's size, strides and
    offset), its value is ``x``; the step stays only where its empty parts are read. Not
    where a part is returned or has its shape changed in place."""
    reshaped = _reshaped(steps)
    returned = set(_refs(results))
    subst: dict[int, Any] = {}
    for step in steps:
        if step.func is not _aten.split_with_sizes.default or not step.args:
            continue
        x, sizes = step.args[0], step.args[1]
        whole = [i for i, size in enumerate(sizes) if size != 0]
        if not isinstance(x, (_Ref, Constant)) or len(whole) != 1:
            continue
        part = step.outputs[whole[0]]
        if not isinstance(part, _Ref) or part.index in returned or part.index in reshaped:
            continue
        if isinstance(x, _Ref) and x.index in reshaped:
            continue
        subst[part.index] = x
    return _substitute(steps, results, subst)


def _producers(steps: list[_Step], funcs: frozenset) -> dict[int, _Step]:
    """The steps of ``funcs`` (and any step where ``funcs`` is empty) by value."""
    return {
        out: step for step in steps if not funcs or step.func in funcs for out in _outputs(step)
    }


def _copy_parts(step: _Step) -> tuple[_Ref, Any] | None:
    """A ``copy_``'s destination and source where the destination is a value and the
    source another value or a constant; None for any other step."""
    if step.func is not _aten.copy_.default or step.layouts is None or len(step.args) < 2:
        return None
    dst, src = step.args[0], step.args[1]
    if not isinstance(dst, _Ref) or not isinstance(src, (_Ref, Constant)) or src == dst:
        return None
    return dst, src


def _fill_from_fresh(steps: list[_Step], results: list) -> tuple[list, list]:
    """``copy_(b, a)`` with ``b`` a fresh buffer read only there and ``a`` a fresh value (an
    aten operator's new result) read only there, of the same dtype, device, shape, strides
    and offset: ``b`` after the copy is ``a`` itself; the buffer and the copy are dropped."""
    uses = _uses(steps, results)
    producer = _producers(steps, frozenset())
    dropped: set[int] = set()  # ids of steps
    subst: dict[int, Any] = {}
    for step in steps:
        parts = _copy_parts(step)
        if parts is None or not isinstance(parts[1], _Ref):
            continue
        dst, src = parts
        buffer, value = producer.get(dst.index), producer.get(src.index)
        if (
            buffer is not None
            and value is not None
            and buffer.func in _ALLOCATIONS
            and not buffer.sequence
            and not value.sequence
            and _traits(value.func).fresh
            and uses[dst.index] == 1
            and uses[src.index] == 1
            and step.layouts[0] == step.layouts[1]
            and not step.layouts[0][0].is_complex
        ):
            dropped.update((id(buffer), id(step)))
            subst[step.outputs[0].index] = src
    kept = [s for s in steps if id(s) not in dropped]
    return _substitute(kept, results, subst)


def _clone_of_fresh(steps: list[_Step], results: list) -> tuple[list, list]:
    """``clone(a)`` of a fresh value ``a`` (an aten operator's new result) read only there,
    row-major from offset 0, not complex: the clone (row-major in either memory format,
    the same elements) is ``a`` itself; the clone is dropped."""
    uses = _uses(steps, results)
    producer = _producers(steps, frozenset())
    dropped: set[int] = set()
    subst: dict[int, Any] = {}
    for step in steps:
        if step.func is not _aten.clone.default or step.layouts is None:
            continue
        source, made = step.args[0], None
        if isinstance(source, _Ref) and uses.get(source.index) == 1:
            made = producer.get(source.index)
        dtype, _, shape, stride, offset = step.layouts[0]
        if (
            made is not None
            and not made.sequence
            and _traits(made.func).fresh
            and step.kwargs.get("memory_format", torch.preserve_format)
            in (torch.preserve_format, torch.contiguous_format)
            and offset == 0
            and _contiguous(shape, stride)
            and not dtype.is_complex
        ):
            dropped.add(id(step))
            subst[step.outputs[0].index] = source
    kept = [s for s in steps if id(s) not in dropped]
    return _substitute(kept, results, subst)


def _contiguous(shape: tuple, stride: tuple) -> bool:
    """Whether ``stride`` is the row-major strides of ``shape`` (as ``torch.empty`` gives)."""
    expected, step = [], 1
    for size in reversed(shape):
        expected.append(step)
        step *= max(size, 1)
    return tuple(reversed(expected)) == tuple(stride)


def _clone_into_fresh(steps: list[_Step], results: list) -> tuple[list, list]:
    """``copy_(b, y)`` with ``b`` a new row-major buffer read only there, of ``y``'s dtype,
    device and shape: the copy fills all of ``b``, so the buffer and the copy are one
    ``clone(y)`` (row-major, the same elements)."""
    uses = _uses(steps, results)
    producer = _producers(steps, _FILLS)
    dropped: set[int] = set()
    replaced: dict[int, _Step] = {}
    for step in steps:
        parts = _copy_parts(step)
        if parts is None:
            continue
        dst, src = parts
        buffer = producer.get(dst.index)
        (dtype, device, shape, stride, offset), source = step.layouts
        if (
            buffer is not None
            and buffer.func in _FILLS
            and not buffer.sequence
            and uses[dst.index] == 1
            and source[:3] == (dtype, device, shape)
            and offset == 0
            and _contiguous(shape, stride)
            and not dtype.is_complex
        ):
            dropped.add(id(buffer))
            replaced[id(step)] = _Step(
                _aten.clone.default,
                (src,),
                {"memory_format": torch.contiguous_format},
                step.outputs,
                False,
                [src.index] if isinstance(src, _Ref) else [],
            )
    rewritten = [replaced.get(id(s), s) for s in steps if id(s) not in dropped]
    return rewritten, results


#: operators filling a new buffer of the size their first argument gives
_SIZED_FILLS = frozenset({_aten.full.default, _aten.zeros.default, _aten.ones.default})


def _fill_in_part(
    steps: list[_Step], results: list, constants: list[Tensor]
) -> tuple[list[_Step], list[Tensor]]:
    """``b = full(S, c)``, ``copy_(as_strided(b, part), y)`` with ``part`` a range along one
    dimension of ``b`` (row-major) and ``y`` of the part's shape, dtype and device; ``b``
    read nowhere between, the view only by the copy, the copy's result nowhere: ``b`` is
    ``cat([full(before), y, full(after)], d)`` (the same elements; row-major, as checked on
    meta tensors), the filled parts made once (constants, up to ``HOISTED_NUMEL``
    elements each)."""
    uses = _uses(steps, results)
    producer = _producers(steps, frozenset())
    position = {id(step): i for i, step in enumerate(steps)}
    first_read: dict[int, int] = {}  # value -> the position of its first reader
    for i, step in enumerate(steps):
        for index in step.reads:
            first_read.setdefault(index, i)
    constants = list(constants)
    dropped: set[int] = set()
    replaced: dict[int, _Step] = {}
    for i, step in enumerate(steps):
        parts = _copy_parts(step)
        if parts is None or uses.get(step.outputs[0].index, 0):
            continue
        view = producer.get(parts[0].index)
        if view is None or view.func is not _aten.as_strided.default or uses[parts[0].index] != 1:
            continue
        buffer = producer.get(view.args[0].index) if isinstance(view.args[0], _Ref) else None
        if buffer is None or buffer.func not in _SIZED_FILLS or buffer.reads or buffer.sequence:
            continue
        b = view.args[0].index
        if first_read[b] != position[id(view)] or _read_between(steps, b, position[id(view)], i):
            continue
        pieces = _pieces(buffer, view.view, step.layouts, parts[1], constants)
        if pieces is None:
            continue
        dropped.update((id(buffer), id(view)))
        args = (pieces[0], pieces[1])
        replaced[id(step)] = _Step(_aten.cat.default, args, {}, [_Ref(b)], False, _refs(args))
    kept = [replaced.get(id(s), s) for s in steps if id(s) not in dropped]
    return kept, constants


def _read_between(steps: list[_Step], value: int, start: int, stop: int) -> bool:
    """Whether a step after ``start`` and before ``stop`` reads ``value``."""
    return any(value in steps[j].reads for j in range(start + 1, stop))


def _pieces(
    buffer: _Step, view: tuple, layouts: tuple, source: Any, constants: list[Tensor]
) -> tuple[list, int] | None:
    """The tensors ``cat`` joins (the filled parts, as new constants, around ``source``)
    and the dimension it joins along, to make what ``buffer`` holds once ``source`` is
    copied into its ``view``; None where the copy is not of that form."""
    (dtype, device, shape, stride, offset), found = layouts
    full = buffer.args[0]
    if not isinstance(full, (list, tuple)) or len(full) != len(shape) or dtype.is_complex:
        return None
    full = tuple(full)
    if found[:3] != (dtype, device, shape) or view != (shape, stride, offset):
        return None
    dims = [d for d in range(len(full)) if full[d] != shape[d]]
    if len(dims) != 1:
        return None
    d = dims[0]
    start = offset // stride[d]
    if offset != start * stride[d]:  # (a view within the buffer, of its other sizes)
        return None
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
        fills = [
            buffer.func((*full[:d], size, *full[d + 1 :]), *buffer.args[1:], **buffer.kwargs)
            for size in (start, full[d] - start - shape[d])
        ]
        if any(f.numel() > HOISTED_NUMEL for f in fills):
            return None
        joined = [fills[0], source, fills[1]]
        joined = [t for t in joined if t is source or t.numel()]
        # the buffer's layout (row-major) is cat's where the part is a range along d
        probe = [
            torch.empty_strided(
                found[2] if t is source else t.shape,
                found[3] if t is source else t.stride(),
                dtype=dtype,
                device="meta",
            )
            for t in joined
        ]
        if torch.cat(probe, d).stride() != stride:
            return None
    tensors: list = []
    for t in joined:
        if t is not source:
            constants.append(t)
            t = Constant(len(constants) - 1)
        tensors.append(t)
    return tensors, d


#: dtypes whose comparisons with a number ``_tensor_comparisons`` rewrites
_COMPARED = (torch.float32, torch.float64)


def _tensor_comparisons(
    steps: list[_Step], constants: list[Tensor]
) -> tuple[list[_Step], list[Tensor]]:
    """A comparison of a CPU float32/float64 tensor with a number (``eq(x, 0)``) compares
    it with a constant of no dimension holding the number in x's dtype: the operator
    converts the number so on every call (a tensor made, converted and copied: three
    operators inside it), the constant is that conversion made once (the number as a
    tensor of its own type, int64 or float64, then ``to(x.dtype)``: the same value)."""
    constants = list(constants)
    made: dict[tuple, Constant] = {}
    rewritten = []
    for step in steps:
        tensor_form = SCALAR_COMPARISONS.get(step.func)
        number = step.args[1] if len(step.args) == 2 else None
        if (
            tensor_form is not None
            and step.layouts is not None
            and type(number) in (int, float)
            and step.layouts[0][0] in _COMPARED
            and step.layouts[0][1].type == "cpu"
        ):
            dtype = step.layouts[0][0]
            key = (type(number), number, dtype)
            if key not in made:
                own = torch.float64 if type(number) is float else torch.int64
                with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
                    constants.append(torch.tensor(number, dtype=own).to(dtype))
                made[key] = Constant(len(constants) - 1)
            args = (step.args[0], made[key])
            step = dataclasses.replace(step, func=tensor_form, args=args, layouts=None)
        rewritten.append(step)
    return rewritten, constants


def _where_zero(steps: list[_Step], results: list, constants: list[Tensor]) -> list[_Step]:
    """``m = eq(w, 0)`` read only by ``where(m, fill, y)``, with ``w`` a CPU float32/float64
    tensor, ``fill`` a constant of no dimension and no step between the two writing into a
    tensor: one ``where_zero(w, fill, y)`` (``kernels/counting_entries.h``, Counting's y ⊗
    lift(w): the same values and layout), where that kernel is ready for w's dtype."""
    uses = _uses(steps, results)
    masks: dict[int, tuple[int, _Step]] = {}  # mask value -> (position, its eq step)
    dropped: set[int] = set()
    replaced: dict[int, _Step] = {}
    last_write = -1
    for i, step in enumerate(steps):
        if _written(step.func):
            last_write = i
        elif _zero_test(step) and uses.get(step.outputs[0].index) == 1:
            masks[step.outputs[0].index] = (i, step)
        elif step.func is _aten.where.self and len(step.args) == 3:
            mask, fill, y = step.args
            found = masks.get(mask.index) if isinstance(mask, _Ref) else None
            if found is None or found[0] < last_write or mask in (fill, y):
                continue
            if not isinstance(fill, Constant) or constants[fill.index].dim() != 0:
                continue
            w = found[1].args[0]
            if not _where_zero_ready(found[1].layouts[0][0]):
                continue
            dropped.add(id(found[1]))
            args = (w, fill, y)
            replaced[id(step)] = _Step(_where_zero_op(), args, {}, step.outputs, False, _refs(args))
    return [replaced.get(id(s), s) for s in steps if id(s) not in dropped]


def _zero_test(step: _Step) -> bool:
    """Whether ``step`` is ``eq(w, 0)`` of a CPU float32/float64 tensor ``w``, one result."""
    return (
        step.func is _aten.eq.Scalar
        and len(step.args) == 2
        and type(step.args[1]) in (int, float)
        and step.args[1] == 0
        and step.layouts is not None
        and step.layouts[0][0] in _COMPARED
        and step.layouts[0][1].type == "cpu"
        and len(step.outputs) == 1
        and isinstance(step.outputs[0], _Ref)
    )


def _where_zero_op():
    return torch.ops.semiring_autograd.where_zero.default


def _where_zero_ready(dtype: torch.dtype) -> bool:
    """Whether the ``where_zero`` CPU kernel may run for ``dtype`` (built, on, checked)."""
    return kernels._cpu_ready("where_zero", torch.empty(0, dtype=dtype))


def _hoist(steps: list[_Step], results: list, constants: list[Tensor]) -> tuple[list, list]:
    """Tensors made from numbers alone (and views of them) that the program only reads
    (never writes, returns, or gives to an operator whose result aliases them) become
    constants, made here once."""
    made: dict[int, _Step] = {}  # value -> the step making it from numbers or a made value
    for step in steps:
        if step.func in _FACTORIES:
            if step.reads:
                continue
        elif step.view is None or len(step.reads) != 1 or step.reads[0] not in made:
            continue
        outs = _outputs(step)
        if len(outs) != 1 or step.sequence or _holds_constant((step.args, step.kwargs)):
            continue
        if step.reads and step.args[0] != _Ref(step.reads[0]):
            continue
        made[outs[0]] = step
    if not made:
        return steps, constants
    escapes = _escaping(steps, results, made)
    values: dict[int, Tensor] = {}
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
        for out, step in made.items():
            if out in escapes:
                continue
            if step.reads:
                if step.reads[0] not in values:  # its source too large to hold
                    continue
                value = step.func(values[step.reads[0]], *step.args[1:], **step.kwargs)
            else:
                value = step.func(*step.args, **step.kwargs)
            if value.numel() <= HOISTED_NUMEL:
                values[out] = value
    if not values:
        return steps, constants
    constants = list(constants)
    subst: dict[int, Any] = {}
    for out, value in values.items():
        subst[out] = Constant(len(constants))
        constants.append(value)
    kept = [
        s for s in steps if not (s.func in _FACTORIES or s.view) or _outputs(s)[0] not in values
    ]
    kept, _ = _substitute(kept, results, subst)
    return kept, constants


def _holds_constant(tree: Any) -> bool:
    if isinstance(tree, Constant):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_holds_constant(x) for x in tree)
    if isinstance(tree, dict):
        return any(_holds_constant(x) for x in tree.values())
    return False


def _escaping(steps: list[_Step], results: list, made: dict[int, _Step]) -> set[int]:
    """The values of ``made`` that a step may write or alias (the argument its schema says
    its result aliases: ``self`` of a view or in-place operator, ``out`` of an out variant),
    or a result is: those, the values they view, and the views of those, stay steps."""
    escapes = set(_refs(results)) & made.keys()
    for step in steps:
        read = made.keys() & set(step.reads)
        if not read or set(_outputs(step)) <= made.keys() and step.view is not None:
            continue
        traits = _traits(step.func)
        if traits.name == "aten::set_":  # its first argument takes another's storage
            escapes.update(read)
        for i, _ in traits.written:
            if i < len(step.args):
                escapes.update(made.keys() & set(_refs(step.args[i])))
        for name in (n for _, n in traits.written if n in step.kwargs):
            escapes.update(made.keys() & set(_refs(step.kwargs[name])))
        if traits.aliases and traits.alias_of is None:  # aliases an argument it does not name
            escapes.update(read)
        aliased = _argument((step.args, step.kwargs), traits.alias_of)
        if isinstance(aliased, _Ref) and aliased.index in made:
            escapes.add(aliased.index)
    for out in reversed(list(made)):  # a view's escape is its source's
        step = made[out]
        if out in escapes and step.reads:
            escapes.add(step.reads[0])
    for out, step in made.items():  # a view of a value that stays a step stays a step
        if step.reads and step.reads[0] in escapes:
            escapes.add(out)
    return escapes


@dataclass(frozen=True, slots=True)
class ConstantView:
    """A constant of the program that is ``as_strided(k<base>, *view)``: the view
    ``(size, stride, storage offset)`` of the storage of constant ``base`` (a tensor)."""

    base: int
    view: tuple


#: operators changing a tensor's storage in place (besides those tagged ``inplace_view``,
#: which change its shape or strides)
_STORAGE_CHANGING = frozenset({"aten::set_", "aten::resize_", "aten::resize_as_"})


def _constant_views(
    steps: list[_Step], results: list, constants: list
) -> tuple[list[_Step], list, list]:
    """Each view (``as_strided``) of a constant, or of such a view, that is not a result:
    a ``ConstantView`` of the constant (a view reads no data: taken once, it sees every
    write into the storage, as the view a replay takes would). Not where a step changes
    a tensor's shape, strides or storage in place, nor of a tensor without storage."""
    if any(
        _traits(s.func).inplace_view or _traits(s.func).name in _STORAGE_CHANGING for s in steps
    ):
        return steps, results, constants
    kept_apart = set(_refs(results)) | _outputs_given(steps)
    constants = list(constants)
    subst: dict[int, Any] = {}
    kept = []
    for step in steps:
        base = step.args[0] if step.func is _aten.as_strided.default and step.args else None
        if isinstance(base, _Ref):
            base = subst.get(base.index, base)
        outs = _outputs(step)
        if isinstance(base, Constant) and len(outs) == 1 and outs[0] not in kept_apart:
            root = constants[base.index]
            index = root.base if isinstance(root, ConstantView) else base.index
            if _has_storage(constants[index]):
                subst[outs[0]] = Constant(len(constants))
                constants.append(ConstantView(index, step.view))
                continue
        kept.append(step)
    steps, results = _substitute(kept, results, subst)
    return steps, results, constants


def _outputs_given(steps: list[_Step]) -> set[int]:
    """The values given as an operator's ``out`` argument that it resized."""
    given: set[int] = set()
    for step in steps:
        if step.resized:
            for name in _traits(step.func).outs:
                given.update(_refs(step.kwargs.get(name)))
    return given


def _has_storage(t: Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor over storage of at least one byte (whose
    address tells it from any other storage alive)."""
    return (
        type(t) in (Tensor, torch.nn.Parameter)
        and t.layout is torch.strided
        and t.untyped_storage().nbytes() > 0
    )


def _live_steps(steps: list[_Step], results: list) -> list[_Step]:
    """The steps a replay must run: those whose values are read later or returned, that
    write into a tensor, or that hold a guard; the others are dropped."""
    used = set(_refs(results))
    kept = []
    for step in reversed(steps):
        outputs = _outputs(step)
        guarded = step.shapes is not None or any(isinstance(o, tuple) for o in step.outputs)
        if guarded or _written(step.func) or any(o in used for o in outputs):
            kept.append(step)
            used.update(step.reads)
    kept.reverse()
    return kept
