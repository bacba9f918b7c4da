"""The hand-written half of every generated Function: recording a call and running a rule.

A generated module holds, per op, a subclass of one of the bases here with the op's
:class:`Plan` (emitted once, in ``generated/ops_table.py``) and its ``vjp``: the op's
backward formulas in one semiring, a function of the incoming message, one ``need_<input>``
flag per differentiable input and the values the plan keeps. The base does what is the same
for every op: the call, saving what the plan says (a tensor only when a formula that reads it
will run), unwrapping the incoming message, asking which inputs the running backward uses
(:func:`.demand.input_demand`) and wrapping each result as a message with its input's
metadata. A structural rule (views, reshapes, permutes: no ⊕, ⊗ or lift) is one function
of one component tensor, run on every component by the base of each module.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from ..semirings.base import Semiring
from .demand import input_demand
from .message import check_plain, unwrap, unwrap_one, wrap_meta, wrap_one

#: plan sources that are not parameters: the op's output and a forward helper's extra output
OUTPUT, AUX = -1, -2


@dataclass(frozen=True)
class Plan:
    """What one op's Function records, read by the bases below.

    ``params`` are the signature's parameters in order; the one at ``list_at`` (if any) is a
    tensor list, passed to ``apply`` unpacked after the others. ``targets`` are the inputs
    with a formula, in the order ``vjp`` returns their messages, each as its parameter's
    index. ``saved`` lists the tensors to save as (source, the targets reading it): a
    parameter's index, :data:`OUTPUT` or :data:`AUX`. ``kept`` lists the other values
    ``vjp`` reads, after the saved tensors: ``("meta", i, attr)`` an attribute of tensor
    parameter i, ``("shapes", source, "")`` the shapes of a tensor list or of the outputs,
    ``("param", i, "")`` a non-tensor parameter.
    """

    name: str
    params: tuple[str, ...]
    targets: tuple[int, ...]
    saved: tuple[tuple[int, tuple[int, ...]], ...] = ()
    kept: tuple[tuple[str, int, str], ...] = ()
    list_at: int | None = None
    forward: Callable[..., tuple[Tensor, Tensor]] | None = None
    multi_output: bool = False
    has_aux: bool = False
    #: a condition on the arguments under which the op returns (output, aux), as torch's
    #: ``return_indices=True`` forms do, and the type of that pair
    returns_aux: Callable[..., bool] | None = None
    aux_type: Callable[[Any], Any] | None = None

    @functools.cached_property
    def positions(self) -> tuple[int, ...]:
        """Each target's position among ``apply``'s tensor arguments after the leading
        ones (the tensor list: the position of its first element)."""
        if self.list_at is None:
            return self.targets
        return tuple(
            len(self.params) - 1 if t == self.list_at else t - (t > self.list_at)
            for t in self.targets
        )


def _fresh(out: Any, inputs: tuple) -> Any:
    """A custom Function may not hand back one of its inputs unchanged: return a view."""
    for t in inputs:
        if out is t:
            return out.view_as(out)
    return out


def _kept(kind: str, source: int, attr: str, values: tuple, output: Any) -> Any:
    value = output if source == OUTPUT else values[source]
    if kind == "meta":
        return None if value is None else getattr(value, attr)
    if kind == "shapes":
        return [t.shape for t in value]
    return value


class SemiringFunction(torch.autograd.Function):
    """The base of every generated Function. ``apply`` takes the semiring (generic modules
    only), the unpatched call and the op's arguments; :meth:`call` takes them as the
    dispatcher binds them (by name, a tensor list as one list)."""

    plan: ClassVar[Plan]
    #: the op's backward rule (see :meth:`functions`; torch's ``Function.vjp`` is its
    #: ``backward``) and whether the rule reads the output's (dtype, device)
    rule: ClassVar[Callable[..., Any]]
    takes_ref: ClassVar[bool]
    #: the semiring a specialised module is bound to (None: ``apply`` takes it first)
    semiring: ClassVar[Semiring | None] = None
    #: whether messages are Message wrappers (False: ordinary gradients, Real's module)
    messages: ClassVar[bool] = True

    @classmethod
    def call(cls, *leading: Any, **bound: Any) -> Any:
        """Record the op: ``leading`` is (call,) or (semiring, call)."""
        plan = cls.plan
        values = [bound[p] for p in plan.params]
        if plan.list_at is not None:
            values += values.pop(plan.list_at)
        out = cls.apply(*leading, *values)
        if not plan.has_aux:
            return out
        if plan.returns_aux is None or not plan.returns_aux(**bound):
            return out[0]
        return out if plan.aux_type is None else plan.aux_type(out)

    @classmethod
    def record(cls, ctx: Any, S: Semiring, call: Callable, args: tuple) -> Any:
        """The forward: the op's outputs, with what the plan says saved on ``ctx``."""
        plan = cls.plan
        values = args
        if plan.list_at is not None:
            n = len(plan.params) - 1
            values = (*args[: plan.list_at], list(args[n:]), *args[plan.list_at : n])
        if plan.forward is not None:
            outputs = plan.forward(*values)
        elif plan.multi_output:
            outputs = tuple(call())
        else:
            outputs = _fresh(call(), args)
        ctx.set_materialize_grads(False)
        ctx.semiring = S
        ctx.op_name = plan.name
        lead = 2 if cls.semiring is None else 1
        ctx._tensor_args = (False,) * lead + tuple(isinstance(x, Tensor) for x in args)
        if plan.has_aux:
            output, aux = outputs
            ctx.mark_non_differentiable(aux)
        else:
            output, aux = outputs, None
        first = output[0] if plan.multi_output else output
        ctx._ref = (first.dtype, first.device)
        need = cls._need(plan, ctx.needs_input_grad, lead)
        if plan.saved:
            ctx.save_for_backward(*cls._to_save(plan, values, output, aux, need))
        ctx.kept = tuple([_kept(k, s, a, values, output) for k, s, a in plan.kept])
        if cls.messages:
            ctx.metas = tuple([_metas(values[t]) for t in plan.targets])
        return outputs

    @staticmethod
    def _need(plan: Plan, needs: tuple[bool, ...], lead: int) -> list[bool]:
        list_start = lead + len(plan.params) - 1
        return [
            any(needs[list_start:]) if t == plan.list_at else needs[lead + p]
            for t, p in zip(plan.targets, plan.positions)
        ]

    @staticmethod
    def _to_save(plan: Plan, values: tuple, output: Any, aux: Any, need: list[bool]) -> list:
        tensors = []
        for source, readers in plan.saved:
            value = output if source == OUTPUT else aux if source == AUX else values[source]
            live = any([need[r] for r in readers])
            if source == plan.list_at:
                tensors += value if live else [None] * len(value)
            else:
                tensors.append(value if live else None)
        return tensors

    @staticmethod
    def _saved(plan: Plan, tensors: tuple) -> tuple:
        """The saved tensors as ``vjp`` reads them (a tensor list's as one list)."""
        at = next((i for i, (s, _) in enumerate(plan.saved) if s == plan.list_at), None)
        if plan.list_at is None or at is None:
            return tensors
        after = len(plan.saved) - at - 1
        end = len(tensors) - after
        return (*tensors[:at], list(tensors[at:end]), *tensors[end:])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple:
        cls = ctx._forward_cls
        plan = cls.plan
        S = ctx.semiring
        none = (None,) * len(ctx.needs_input_grad)
        if plan.multi_output:
            incoming = [cls.unwrap(S, g, plan.name) for g in grads]
            if all(g is None for g in incoming):
                return none
        else:
            incoming = cls.unwrap(S, grads[0], plan.name)
            if incoming is None:
                return none
        lead = 2 if cls.semiring is None else 1
        needs = input_demand(ctx, ctx._tensor_args)
        need = cls._need(plan, needs, lead)
        if not any(need):
            return none
        args = (*cls._saved(plan, ctx.saved_tensors), *ctx.kept)
        if cls.takes_ref:
            args += (ctx._ref,)
        if len(need) > 1:
            results = cls.run(S, incoming, (*need, *args))
        else:
            results = (cls.run(S, incoming, args),)
        out = list(none)
        list_start = lead + len(plan.params) - 1
        for i, (t, p) in enumerate(zip(plan.targets, plan.positions)):
            if not need[i]:
                continue
            if t == plan.list_at:
                metas = ctx.metas[i] if cls.messages else [None] * len(results[i])
                out[list_start:] = [
                    cls.wrap(S, v, m) if n else None
                    for v, m, n in zip(results[i], metas, needs[list_start:])
                ]
            else:
                out[lead + p] = cls.wrap(S, results[i], ctx.metas[i] if cls.messages else None)
        return tuple(out)

    @classmethod
    def run(cls, S: Semiring, incoming: Any, args: tuple) -> Any:
        """The op's rule on the incoming message(s) and the rest of its arguments."""
        return cls.rule(incoming, *args)

    @staticmethod
    def unwrap(S: Semiring, grad: Tensor | None, op: str) -> Any:
        raise NotImplementedError

    @staticmethod
    def wrap(S: Semiring, value: Any, meta: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def functions(
        cls, plans: dict[str, Plan], namespace: dict[str, Any], structural: dict[str, Callable]
    ) -> dict[str, Callable]:
        """Op name → how the dispatcher records it, for a generated module whose ``Rule``
        base is ``cls``: one Function per op, made from the op's plan and its rule (the
        module's ``<op>_vjp``, else the structural rule on one component)."""
        table = {}
        for name, plan in plans.items():
            vjp = namespace.get(f"{name.replace('.', '_')}_vjp")
            if vjp is None:
                if name not in structural:
                    raise ImportError(f"{cls.__module__}: no rule for op {name!r}; run `generate`")
                vjp = cls.componentwise(structural[name])
            body = {
                "plan": plan,
                "rule": staticmethod(vjp),
                "takes_ref": "_ref" in inspect.signature(vjp).parameters,
                "__module__": cls.__module__,
            }
            table[name] = type(_class_name(name), (cls,), body).call
        return table

    @staticmethod
    def componentwise(rule: Callable) -> Callable:
        """A structural rule of one component tensor as this module's rule."""
        return rule


def _metas(value: Any) -> Any:
    """(shape, dtype, device) of a tensor (each tensor of a list), None for None."""
    if isinstance(value, list):
        return [(t.shape, t.dtype, t.device) for t in value]
    return None if value is None else (value.shape, value.dtype, value.device)


def _class_name(op: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in op.replace(".", "_").split("_") if p)


class SpecialisedFunction(SemiringFunction):
    """A Function of a module specialised to one semiring (``semiring``)."""

    @staticmethod
    def forward(ctx: Any, call: Callable, *args: Any) -> Any:
        cls = ctx._forward_cls
        return cls.record(ctx, cls.semiring, call, args)


class PlainFunction(SpecialisedFunction):
    """Real's Functions: messages are ordinary gradients in the primal's dtype."""

    messages = False

    @staticmethod
    def unwrap(S: Semiring, grad: Tensor | None, op: str) -> Tensor | None:
        check_plain(grad, op)
        return grad

    @staticmethod
    def wrap(S: Semiring, value: Tensor | None, meta: Any) -> Tensor | None:
        return value


class ComponentFunction(SpecialisedFunction):
    """A one-component semiring's Functions: a value is its component tensor."""

    unwrap = staticmethod(unwrap_one)
    wrap = staticmethod(wrap_one)


class GenericFunction(SemiringFunction):
    """The generic module's Functions: ``apply`` takes the semiring, a value is a tuple of
    component tensors and ``vjp`` takes the semiring first."""

    unwrap = staticmethod(unwrap)
    wrap = staticmethod(wrap_meta)

    @staticmethod
    def forward(ctx: Any, S: Semiring, call: Callable, *args: Any) -> Any:
        return ctx._forward_cls.record(ctx, S, call, args)

    @classmethod
    def run(cls, S: Semiring, incoming: Any, args: tuple) -> tuple:
        return cls.rule(S, incoming, *args)

    @staticmethod
    def componentwise(rule: Callable) -> Callable:
        return _each(rule)


def _each(rule: Callable) -> Callable:
    """A structural rule of one component, run on every component of a value."""

    @functools.wraps(rule)
    def vjp(S: Semiring, grad: tuple, *args: Any) -> Any:
        per_component = [rule(c, *args) for c in grad]
        if isinstance(per_component[0], tuple):  # several inputs' messages
            return tuple(_gather(parts) for parts in zip(*per_component))
        return _gather(per_component)

    return vjp


def _gather(parts: tuple) -> Any:
    """One target's message from its per-component results: None, a value, or a list."""
    if parts[0] is None:
        return None
    if isinstance(parts[0], (list, tuple)):
        return [tuple(p) for p in zip(*parts)]
    return tuple(parts)
