"""The hand-written half of every generated Function: recording a call and running a rule.

A generated module holds, per op, a rule ``<op>_vjp``: the op's backward formulas in one
semiring, a function of the incoming message, a ``need_<input>`` flag per input (where the
op has several) and the values the op's :class:`Plan` keeps (one plan per op, emitted in
``generated/ops_table.py``). :meth:`SemiringFunction.functions` makes one
``torch.autograd.Function`` per op of a module from its plan and its rule; the base does
what is the same for every op: the call, saving what the plan says (a tensor only when a
formula that reads it will run), unwrapping the incoming message, asking which inputs the
running backward uses (:func:`.demand.input_demand`), calling the rule and wrapping each
result as a message with its input's metadata. Saving and the backward are written out per
op from its plan (:func:`_setup_source`, :func:`_backward_source`), compiled on the op's
first use. A structural rule (views, reshapes,
permutes: no ⊕, ⊗ or lift, ``generated/structural.py``) is written once, on one component
tensor; each module's base runs it on every component of a value. Inside ``torch.func``
transforms each op runs as its :meth:`~SemiringFunction.transformed` Function (forward and
``setup_context`` apart, ``transforms.py``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import linecache
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from ..semirings.base import Semiring
from ..errors import SemiringAutogradError
from . import transforms
from .attention_helpers import blocked_rule
from .demand import LEAF, REQUESTED, input_demand
from .message import Message, unwrap, unwrap_plain, wrap_meta, wrap_one

#: plan sources that are not parameters: the op's output and a forward helper's extra output
OUTPUT, AUX = -1, -2
#: a tensor a ``torch.func`` transform left wrapped after it ended, as its plain tensor
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
#: ``map(isinstance, values, _TENSOR)``: which of ``values`` are tensors, without a call per
#: value in Python
_TENSOR = itertools.repeat(Tensor)
_graph_task_id = torch._C._current_graph_task_id
#: a CPU tensor's device: ``t.device`` makes a new object per read (about 1 µs), ``t.is_cpu``
#: reads a flag
_CPU = torch.device("cpu")
_will_execute = torch._C._will_engine_execute_node


@dataclass(frozen=True)
class Plan:
    """What one op's Function records, read by the bases below.

    ``params`` are the signature's parameters in order; the one at ``list_at`` (if any) is a
    tensor list, passed to ``apply`` unpacked after the others. ``targets`` are the inputs
    with a formula, in the order the rule returns their messages, each as its parameter's
    index. ``saved`` lists the tensors to save as (source, the targets reading it): a
    parameter's index, :data:`OUTPUT` or :data:`AUX`. ``kept`` lists the other values the
    rule reads, after the saved tensors: ``("meta", i, attr)`` an attribute of tensor
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
        """Each target's position among ``apply``'s arguments after the leading ones (the
        tensor list: the position of its first element)."""
        if self.list_at is None:
            return self.targets
        return tuple(
            len(self.params) - 1 if t == self.list_at else t - (t > self.list_at)
            for t in self.targets
        )

    @functools.cached_property
    def single(self) -> int | None:
        """The position of the one input with a formula, when there is one and it is not a
        tensor list (most ops: their backward takes the shortest path)."""
        if len(self.targets) == 1 and self.targets[0] != self.list_at:
            return self.positions[0]
        return None

    @functools.cached_property
    def saved_list_at(self) -> int | None:
        """The index in ``saved`` of the tensor list, if it is saved."""
        sources = [source for source, _ in self.saved]
        return sources.index(self.list_at) if self.list_at in sources else None


def _values(plan: Plan, args: tuple) -> tuple:
    """The op's arguments in its signature's order (``apply`` passes a tensor list
    unpacked after the others)."""
    list_at = plan.list_at
    if list_at is None:
        return args
    n = len(plan.params) - 1
    return (*args[:list_at], list(args[n:]), *args[list_at:n])


class SemiringFunction(torch.autograd.Function):
    """The base of every generated Function. ``apply`` takes the semiring (generic modules
    only), the unpatched call and the op's arguments; :meth:`record` takes them as the
    dispatcher binds them (by name, a tensor list as one list).

    The forward (:meth:`outputs`, then :meth:`setup`: ``setup_context``) and the backward
    run for every recorded op: ``setup`` and ``backward`` are each op's own, their source
    written out from its plan on first use (what the plan fixes is decided once, not per
    call). Inside ``torch.func`` transforms an op runs as :meth:`transformed`."""

    plan: ClassVar[Plan]
    #: ``torch._C._FunctionBase.apply``: records the call (``Function.apply`` without its
    #: checks for ``setup_context`` and transforms, which :meth:`record` makes itself)
    _apply = torch._C._FunctionBase.__dict__["apply"]
    #: the op's backward rule (see :meth:`functions`; torch's ``Function.vjp`` is its
    #: ``backward``) and whether the rule reads the output's (dtype, device)
    rule: ClassVar[Callable[..., Any]]
    takes_ref: ClassVar[bool]
    #: the semiring a specialised module is bound to (None: ``apply`` takes it first)
    semiring: ClassVar[Semiring | None] = None
    #: how many arguments ``apply`` takes before the op's: (call,) or (semiring, call)
    lead: ClassVar[int] = 1
    #: whether messages are Message wrappers (False: ordinary gradients, Real's module)
    messages: ClassVar[bool] = True
    #: whether a rule reads a message's one component (``unwrap`` gives the value's tuple)
    one_component: ClassVar[bool] = False

    @classmethod
    def record(cls, leading: tuple, bound: dict[str, Any]) -> Any:
        """Record the op: ``leading`` is (call,) or (semiring, call), ``bound`` the op's
        arguments by name (a tensor list as one list)."""
        plan = cls.plan
        values = list(map(bound.__getitem__, plan.params))
        if plan.list_at is not None:
            values += values.pop(plan.list_at)
        if torch._C._are_functorch_transforms_active():  # torch.func.grad, vjp, vmap …
            S = cls.semiring if cls.lead == 1 else leading[0]
            call = _Rebound(leading[-1], values)
            values = transforms.through_boundary(S, plan.name, values)
            out = cls.transformed().apply(*leading[:-1], call, *values)
        else:
            for i, v in enumerate(values):  # what ``Function.apply`` does outside transforms
                if isinstance(v, Tensor):
                    values[i] = _unwrap_if_dead(v)
            out = cls._apply(*leading, *values)
        if not plan.has_aux:
            return out
        if plan.returns_aux is None or not plan.returns_aux(**bound):
            return out[0]
        return out if plan.aux_type is None else plan.aux_type(out)

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        """The op's outputs, with what its plan says saved on ``ctx``. ``args``: the
        semiring (generic modules only), the unpatched call, the op's arguments."""
        cls = ctx._forward_cls
        outputs = cls.outputs(args, args[cls.lead - 1])
        cls.setup(ctx, args, outputs)
        return outputs

    @classmethod
    def outputs(cls, args: tuple, call: Callable[[], Any]) -> Any:
        """The op's outputs of ``apply``'s ``args``, computed by ``call`` (the unpatched
        call) unless the plan has a forward of its own."""
        plan = cls.plan
        args = args[cls.lead :]
        if plan.forward is not None:
            return plan.forward(*(args if plan.list_at is None else _values(plan, args)))
        if plan.multi_output:
            return tuple(call())
        out = call()
        # a custom Function may not hand back one of its inputs unchanged: a view instead. A
        # view of a tensor the call made inside (``F.linear`` of a batch is a view of its 2-D
        # product) is detached from that tensor: torch refuses in-place writes into a custom
        # Function's view outputs, and torch's own output of the call takes them
        # (``nn.ReLU(inplace=True)`` after a linear layer). A view of an input stays a view.
        for t in args:
            if out is t:
                return out.view_as(out)
        base = getattr(out, "_base", None)
        if base is not None:
            for t in args:
                if isinstance(t, Tensor) and (base is t or base is t._base):
                    return out
            return out.detach()
        return out

    @classmethod
    def setup(cls, ctx: Any, args: tuple, outputs: Any) -> None:
        """Save on ``ctx`` what the plan says the backward reads (``setup_context``): the
        semiring, which arguments are tensors, the tensors read by a formula that will run
        (None for the others), the kept values and each target's metadata. Each op's
        Function runs its own copy, written out for its plan (:func:`_setup_source`), made
        on its first call."""
        setup = _specialised_setup(cls)
        cls.setup = staticmethod(setup)
        setup(ctx, args, outputs)

    @classmethod
    def transformed(cls) -> type[SemiringFunction]:
        """This op's Function inside ``torch.func`` transforms: its forward and
        ``setup_context`` apart (what transforms require), the vmap rule torch generates
        from them, the forward computed from the operands the transform hands it (unwrapped
        or batched), and a real cotangent reaching it lifted into the semiring
        (:func:`.transforms.lifted`)."""
        variant = cls.__dict__.get("_transformed")
        if variant is not None:
            return variant

        def forward(*args: Any) -> Any:
            return variant.outputs(args, args[cls.lead - 1].on(args[cls.lead :]))

        def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
            ctx.function = variant
            variant.setup(ctx, *transforms.below_level((inputs, output)))

        def backward(ctx: Any, *grads: Tensor | None) -> tuple:
            transforms.refuse(ctx.semiring, cls.plan.name)
            with transforms.below():
                grads = transforms.lifted(ctx.semiring, grads) if cls.messages else grads
                return SemiringFunction.backward(ctx, *grads)

        def jvp(ctx: Any, *tangents: Any) -> Any:
            raise SemiringAutogradError(f"{cls.plan.name}: {transforms.FORWARD_MODE}")

        body = {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
            "generate_vmap_rule": True,
            "__module__": cls.__module__,
        }
        variant = type(f"{cls.__name__}Transformed", (cls,), body)
        cls._transformed = variant
        return variant

    @staticmethod
    def _listed(plan: Plan, saved: tuple) -> tuple:
        """The saved tensors with the tensor list's gathered into one list."""
        at = plan.saved_list_at
        end = len(saved) - (len(plan.saved) - at - 1)
        return (*saved[:at], list(saved[at:end]), *saved[end:])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple:
        """The op's backward, written out for its plan (:func:`_backward_source`), made on
        the op's first backward: the engine runs it directly from then on."""
        cls = ctx._forward_cls
        if not issubclass(cls, SemiringFunction):  # torch.func's Function around ours
            cls = ctx.function
        run = cls.__dict__.get("written_backward")
        if run is None:
            run = cls.written_backward = _specialised_backward(cls)
            nodes = cls._backward_cls
            if nodes.__dict__.get("apply") is SemiringFunction.backward:  # see functions()
                nodes.apply = run
        return run(ctx, *grads)

    @staticmethod
    def unwrap(S: Semiring, grad: Tensor | None, op: str) -> Any:
        """The value inside an incoming message (None stays None), checked to be ``S``'s."""
        raise NotImplementedError

    @staticmethod
    def wrap(S: Semiring, value: Any, meta: Any) -> Any:
        """The message of ``value`` with metadata ``meta`` (modules with messages)."""
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
            vjp = blocked_rule(name, vjp, cls.semiring)
            body = {
                "plan": plan,
                "rule": staticmethod(vjp),
                "takes_ref": "_ref" in inspect.signature(vjp).parameters,
                "__module__": cls.__module__,
            }
            function = type(_class_name(name), (cls,), body)
            # the engine runs a node as ``ctx.apply(*grads)``: torch's ``apply`` picks
            # between ``backward`` and ``vjp`` on every call; this goes to ``backward``
            function._backward_cls.apply = SemiringFunction.backward
            table[name] = function.record
        return table

    @staticmethod
    def componentwise(rule: Callable) -> Callable:
        """A structural rule of one component tensor as this module's rule."""
        return rule


def _specialised_setup(cls: type[SemiringFunction]) -> Callable[[Any, tuple, Any], None]:
    """``cls.setup`` written out for ``cls``'s plan: no loop over the plan's entries and no
    test of what the plan fixes, per recorded op."""
    namespace = {"S": cls.semiring, "_CPU": _CPU, "_TENSOR": _TENSOR}
    source = _setup_source(cls.plan, cls.lead, cls.takes_ref, cls.messages)
    return _defined(source, f"{cls.__module__}.{cls.__qualname__}.setup", namespace)["setup"]


def _setup_source(plan: Plan, lead: int, takes_ref: bool, messages: bool) -> str:
    """The source of ``setup(ctx, args, outputs)`` for ``plan``: ``args`` are ``apply``'s,
    ``lead`` of them before the op's (the semiring first where ``lead`` is 2)."""
    value = functools.partial(_value_source, plan, lead)
    output = "outputs[0]" if plan.has_aux else "outputs"
    lines = [
        "ctx.materialize_grads = False",  # ctx.set_materialize_grads(False), without its call
        f"ctx.semiring = {'S' if lead == 1 else 'args[0]'}",
        f"ctx._tensor_args = {(False,) * lead} + tuple(map(isinstance, args[{lead}:], _TENSOR))",
    ]
    if plan.has_aux:
        lines.append("ctx.mark_non_differentiable(outputs[1])")
    if takes_ref:
        first = f"{output}[0]" if plan.multi_output else output
        lines += [
            f"first = {first}",
            "ctx._ref = (first.dtype, _CPU if first.is_cpu else first.device)",
        ]
    if plan.saved:
        lines.append("needs = ctx.needs_input_grad")
        saved = []
        for source, readers in plan.saved:
            tensor = (
                output if source == OUTPUT else "outputs[1]" if source == AUX else value(source)
            )
            live = " or ".join(_need_source(plan, lead, r) for r in readers)
            if source != plan.list_at:
                saved.append(f"({tensor} if {live} else None),")
            else:
                saved.append(f"*({tensor} if {live} else [None] * len({tensor})),")
        lines.append(f"ctx.to_save = ({' '.join(saved)})")  # save_for_backward, without its call
    kept = []
    for kind, source, attr in plan.kept:
        item = output if source == OUTPUT else value(source)
        if kind == "meta":
            item = f"(None if {item} is None else {item}.{attr})"
        elif kind == "shapes":
            item = f"[t.shape for t in {item}]"
        kept.append(f"{item},")
    lines.append(f"ctx.kept = ({' '.join(kept)})")
    if messages:
        metas = []
        for t in plan.targets:
            item = value(t)
            if t == plan.list_at:
                metas.append(
                    f"[(v.shape, v.dtype, _CPU if v.is_cpu else v.device) for v in {item}],"
                )
            else:
                metas.append(
                    f"(None if {item} is None else ({item}.shape, {item}.dtype, "
                    f"_CPU if {item}.is_cpu else {item}.device)),"
                )
        lines.append(f"ctx.metas = ({' '.join(metas)})")
    body = "".join(f"    {line}\n" for line in lines)
    return f"def setup(ctx, args, outputs):\n{body}"


def _value_source(plan: Plan, lead: int, i: int) -> str:
    """The expression of parameter ``i``'s value among ``apply``'s ``args`` (a tensor list,
    which ``apply`` takes unpacked after the others, as a list)."""
    list_at = plan.list_at
    if list_at is None or i < list_at:
        return f"args[{lead + i}]"
    if i == list_at:
        return f"list(args[{lead + len(plan.params) - 1}:])"
    return f"args[{lead + i - 1}]"


def _need_source(plan: Plan, lead: int, r: int) -> str:
    """The expression of whether target ``r``'s input needs a message (a tensor list: any
    of its tensors), read from ``needs``, the ``ctx.needs_input_grad`` of ``apply``."""
    at = lead + plan.positions[r]
    return f"any(needs[{at}:])" if plan.targets[r] == plan.list_at else f"needs[{at}]"


def _specialised_backward(cls: type[SemiringFunction]) -> Callable[..., tuple]:
    """The backward of ``cls``'s op written out for its plan: no loop over the plan's
    targets and no test of what the plan fixes, per node."""
    namespace = {
        "Message": Message,
        "LEAF": LEAF,
        "REQUESTED": REQUESTED,
        "_graph_task_id": _graph_task_id,
        "_will_execute": _will_execute,
        "input_demand": input_demand,
        "unwrap": cls.unwrap,
        "wrap": cls.wrap,
        "rule": cls.rule,
        "listed": functools.partial(cls._listed, cls.plan),
    }
    return _defined(
        _backward_source(cls), f"{cls.__module__}.{cls.__qualname__}.backward", namespace
    )["backward"]


def _defined(source: str, name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``namespace`` with ``source`` run in it, its lines kept in ``linecache`` under
    ``<semiring_autograd NAME>`` so that a traceback through it shows them."""
    filename = f"<semiring_autograd {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _backward_source(cls: type[SemiringFunction]) -> str:
    """The source of ``backward(ctx, *grads)`` for ``cls``: the incoming message unwrapped,
    None for every input when none that has a formula is used, else the rule's results
    wrapped as messages (their inputs' metadata) where their inputs are used."""
    plan, lead = cls.plan, cls.lead
    name = repr(plan.name)
    if plan.list_at is None:
        lines = [f"none = {(None,) * (lead + len(plan.params))}"]
    else:
        lines = ["none = (None,) * len(ctx._tensor_args)"]
    lines.append("S = ctx.semiring")
    if plan.multi_output:
        lines.append(f"incoming = [unwrap(S, g, {name}) for g in grads]")
        if cls.one_component:
            lines.append("incoming = [None if g is None else g[0] for g in incoming]")
        lines += ["if all(g is None for g in incoming):", "    return none"]
    else:
        lines += [
            "grad = grads[0]",
            "if type(grad) is Message and grad.semiring is S and not S.settles:",
            "    incoming = grad.value",  # unwrap's common case, inline
            "else:",
            f"    incoming = unwrap(S, grad, {name})",
            "    if incoming is None:",
            "        return none",
        ]
        if cls.one_component:
            lines.append("incoming = incoming[0]")
    single = plan.single
    if single is not None:
        lines += _single_demand(lead + single)
    else:
        lines.append("needs = input_demand(ctx, ctx._tensor_args)")
        lines += [f"need{k} = {_need_source(plan, lead, k)}" for k in range(len(plan.targets))]
        lines += [f"if not ({' or '.join(f'need{k}' for k in range(len(plan.targets)))}):"]
        lines.append("    return none")
    saved = "listed(ctx.saved_tensors)" if plan.saved_list_at is not None else "ctx.saved_tensors"
    rule_args = ["S"] if cls.semiring is None else []
    rule_args.append("incoming")
    if len(plan.targets) > 1:
        rule_args += [f"need{k}" for k in range(len(plan.targets))]
    rule_args += [f"*{saved}", "*ctx.kept"] + (["ctx._ref"] if cls.takes_ref else [])
    lines.append(f"results = rule({', '.join(rule_args)})")
    lines += _wrapped_results(cls)
    body = "".join(f"    {line}\n" for line in lines)
    return f"def backward(ctx, *grads):\n{body}"


def _single_demand(position: int) -> list[str]:
    """Lines returning ``none`` when the running backward does not use the one input with
    a formula, argument ``position`` of ``apply`` (:func:`.demand.input_demand`'s test, of
    that input alone)."""
    return [
        f"if not ctx.needs_input_grad[{position}]:",
        "    return none",
        f"node = ctx.next_functions[ctx._tensor_args[:{position}].count(True)][0]",
        "if node is None:",
        "    return none",
        "if type(node) is LEAF:",
        "    if REQUESTED:",
        "        requested = REQUESTED.get(_graph_task_id())",
        "        if requested is not None and id(node.variable) not in requested:",
        "            return none",
        "elif not _will_execute(node):",
        "    return none",
    ]


def _wrapped_results(cls: type[SemiringFunction]) -> list[str]:
    """Lines returning the rule's ``results`` as the gradients of ``apply``'s arguments:
    each used input's result wrapped with its metadata, None elsewhere."""
    plan, lead = cls.plan, cls.lead
    several = len(plan.targets) > 1
    if plan.list_at is None:
        items = ["None"] * (lead + len(plan.params))
        for k, p in enumerate(plan.positions):
            value = f"results[{k}]" if several else "results"
            if cls.messages:
                value = f"wrap(S, {value}, ctx.metas[{k}])"
            # a single input is used (tested above); one of several where its need says so
            items[lead + p] = value if plan.single is not None else f"{value} if need{k} else None"
        return [f"return ({', '.join(f'({item})' for item in items)},)"]
    lines = ["out = list(none)"]
    for k, (t, p) in enumerate(zip(plan.targets, plan.positions)):
        value = f"results[{k}]" if several else "results"
        if t != plan.list_at:
            if cls.messages:
                value = f"wrap(S, {value}, ctx.metas[{k}])"
            if plan.single is not None:  # the input is used: tested above
                lines.append(f"out[{lead + p}] = {value}")
            else:
                lines += [f"if need{k}:", f"    out[{lead + p}] = {value}"]
            continue
        part = f"wrap(S, v, ctx.metas[{k}][j])" if cls.messages else "v"
        lines += [
            f"if need{k}:",
            f"    for j, v in enumerate({value}):",
            f"        if needs[{lead + p} + j]:",
            f"            out[{lead + p} + j] = {part}",
        ]
    return [*lines, "return tuple(out)"]


class _Rebound:
    """The unpatched call of an op recorded inside a transform, computed from the operands
    its forward receives: the transform hands the forward unwrapped or batched copies of
    the tensors the call was made with (``values``)."""

    __slots__ = ("call", "values")

    def __init__(self, call: Callable[[], Any], values: list) -> None:
        self.call = call
        self.values = values

    def on(self, operands: tuple) -> Callable[[], Any]:
        """``call`` with each of ``values`` swapped for its operand."""
        replace = {}
        for original, operand in zip(self.values, operands):
            if isinstance(original, Tensor) and original is not operand:
                replace[id(original)] = operand
        return lambda: self.call.substituted(replace)


def _class_name(op: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in op.replace(".", "_").split("_") if p)


class PlainFunction(SemiringFunction):
    """Real's Functions: messages are ordinary gradients in the primal's dtype."""

    messages = False
    unwrap = staticmethod(unwrap_plain)


class ComponentFunction(SemiringFunction):
    """A one-component semiring's Functions: a value is its component tensor."""

    one_component = True
    unwrap = staticmethod(unwrap)
    wrap = staticmethod(wrap_one)


class GenericFunction(SemiringFunction):
    """The generic module's Functions: ``apply`` takes the semiring, a value is a tuple of
    component tensors and a rule takes the semiring first."""

    lead = 2
    unwrap = staticmethod(unwrap)
    wrap = staticmethod(wrap_meta)

    @staticmethod
    def componentwise(rule: Callable) -> Callable:
        return _each(rule)


def _each(rule: Callable) -> Callable:
    """A structural rule of one component, run on every component of a value."""

    @functools.wraps(rule)
    def vjp(S: Semiring, grad: tuple, *args: Any) -> Any:
        per_component = []  # a loop, not a comprehension: this runs for every structural node
        for c in grad:
            per_component.append(rule(c, *args))
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
