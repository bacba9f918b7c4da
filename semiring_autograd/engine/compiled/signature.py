"""The signature of a recorded graph for ``sa.grad(..., compile=True)``: what a captured
backward program depends on, and the tensors it reads.

The graph is walked from the outputs in a fixed order: each node's type, its edges, its
non-tensor state (a generated Function's ctx attributes: op arguments, shapes; a torch
node's ``_saved_*`` values) and the shape, strides, storage offset, dtype and device of
every tensor it saved — those tensors are the program's inputs (its slots), in walk order
— then the inputs' and outputs' places in the graph and the seeds' metadata. Two graphs with one
signature run the same operators on tensors of the same metadata: a model run on inputs of
one shape gives one signature; another shape, another module path or a changed argument
gives another.

The key of a compiled step adds what its forward reads from Python (``step.py``):
``Identities`` keys immutable values by value and any other object by its ``id()``, holding
the object with the key (``ProgramKey.held``) so that no other object takes the id while the key
lives; ``context`` is torch's thread state an operator reads besides its arguments.
"""

from __future__ import annotations

import dis
import functools
import numbers
import types
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ...ops.message import Message
from ...semirings.base import Semiring


class Uncapturable(Exception):
    """The backward cannot be captured exactly; the message says why."""


#: values a key holds as they are (equal exactly when the backward sees the same value)
_PLAIN = frozenset(
    {
        type(None),
        type(Ellipsis),
        bool,
        int,
        str,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,  # a shape attribute is a Size in every call (the same code sets it)
    }
)
_SEQUENCES = frozenset({tuple, list})


class Signature:
    """Walks the graph: the hashable ``key`` and the saved tensors (``slots``) in walk order."""

    def __init__(self) -> None:
        self.slots: list[Tensor] = []

    def tensor(self, t: Tensor) -> tuple:
        self.slots.append(t)
        return ("T", t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)

    def describe(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind in _SEQUENCES:
            for v in value:
                if type(v) not in _PLAIN:
                    return (kind, tuple(self.describe(v) for v in value))
            return (list, tuple(value)) if kind is list else value
        if isinstance(value, Tensor):
            return self.tensor(value)
        if kind is float:
            return ("f", value.hex())  # -0.0 and 0.0 apart, NaN equal to NaN
        if isinstance(value, Semiring):
            return ("S", value)
        if kind is dict:
            return (dict, tuple((k, self.describe(v)) for k, v in value.items()))
        if kind is slice:
            return ("slice", self.describe((value.start, value.stop, value.step)))
        if isinstance(value, numbers.Number):
            return ("n", kind, repr(value))
        raise Uncapturable(
            f"a backward node holds a {kind.__name__}, which a captured program cannot tell "
            "apart from one call to the next"
        )


@functools.cache
def _saved_fields(node_type: type) -> tuple[str, ...]:
    return tuple(sorted(a for a in dir(node_type) if a.startswith("_saved_")))


def _node_state(node: Any, sig: Signature) -> tuple:
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        saved = tuple([sig.describe(t) for t in node.saved_tensors])
        state = vars(node)  # set in the same order by the same forward
        attrs = tuple([sig.describe(v) for v in state.values()])
        return (node._forward_cls, tuple(state), saved, attrs, node.needs_input_grad)
    if type(node).__name__ == "AccumulateGrad":
        v = node.variable
        return ("leaf", tuple(v.shape), v.dtype, v.device)
    return (node.name(), tuple(sig.describe(getattr(node, f)) for f in _saved_fields(type(node))))


def signature(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], seeds: Sequence[Any]
) -> tuple[tuple, list[Tensor]]:
    """The key of the graph behind ``outputs`` for a backward to ``inputs`` seeded with
    ``seeds`` (messages or tensors), and the tensors a program reads: the seeds'
    components, then every node's saved tensors in walk order."""
    sig = Signature()
    seed_part = tuple(_seed_meta(s, sig) for s in seeds)
    order: list[Any] = []
    index: dict[Any, int] = {}
    stack = [o.grad_fn for o in reversed(outputs)]
    while stack:
        node = stack.pop()
        if node is None or node in index:
            continue
        index[node] = len(order)
        order.append(node)
        stack.extend(n for n, _ in reversed(node.next_functions) if n is not None)
    nodes = []
    for node in order:
        edges = tuple((index.get(n), nr) for n, nr in node.next_functions)
        nodes.append((edges, _node_state(node, sig)))
    outs = tuple((index.get(o.grad_fn), o.output_nr, tuple(o.shape)) for o in outputs)
    ins = []
    for x in inputs:
        edge = torch.autograd.graph.get_gradient_edge(x)
        ins.append((index.get(edge.node), edge.output_nr, tuple(x.shape), x.dtype))
    return (tuple(nodes), outs, tuple(ins), seed_part), sig.slots


def _seed_meta(seed: Any, sig: Signature) -> tuple:
    if isinstance(seed, Message):
        return (
            "M",
            seed.semiring,
            tuple(seed.shape),
            seed.dtype,
            tuple(map(sig.tensor, seed.value)),
        )
    return sig.describe(seed)


class ProgramKey:
    """A signature with its hash computed once (a key is a deep tuple). ``held``: the
    objects whose ``id()`` the parts name, kept alive with the key, so that while the cache
    holds a key no other object can take one of its ids (equal ids mean the same objects)."""

    __slots__ = ("parts", "hash", "held")

    def __init__(self, parts: tuple, held: Sequence[Any] = ()) -> None:
        self.parts = parts
        self.hash = hash(parts)
        self.held = held

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ProgramKey) and self.hash == other.hash and self.parts == other.parts
        )


# ----- Python state a program depends on -----------------------------------------------------

#: immutable values a key holds by value (a float by its bits); any other object is named by
#: its identity
IMMUTABLE = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        str,
        bytes,
        torch.dtype,
        torch.device,
        torch.Size,
        type(Ellipsis),
    }
)
_MISSING = object()


class Identities:
    """The objects a key names by ``id()``, collected to be held with the key
    (``ProgramKey(parts, identities.held)``)."""

    def __init__(self) -> None:
        self.held: list[Any] = []

    def of(self, obj: Any) -> int:
        self.held.append(obj)
        return id(obj)

    def value(self, value: Any) -> Any:
        """``value`` itself when immutable (numbers, strings, dtypes, tuples of them; a
        float by its bits), else its identity."""
        kind = type(value)
        if kind is float:
            return ("f", value.hex())  # -0.0 and 0.0 apart, NaN equal to NaN
        if kind in IMMUTABLE:
            return value
        if kind is tuple:
            return ("t", tuple([self.value(v) for v in value]))
        return ("id", self.of(value))

    def callable(self, fn: Any) -> tuple:
        """What decides what ``fn`` runs: its identity; for a Python function also its
        code, defaults, closure cells' contents and the module globals its code names; for
        a ``functools.partial`` its function and arguments; for a bound method its function
        and object. Immutable values are keyed by value, other objects by identity."""
        if isinstance(fn, functools.partial):
            args = tuple([self.value(a) for a in fn.args])
            keywords = tuple([(k, self.value(v)) for k, v in fn.keywords.items()])
            return ("partial", self.of(fn), self.callable(fn.func), args, keywords)
        if isinstance(fn, types.MethodType):
            return ("method", self.of(fn.__self__), self.callable(fn.__func__))
        if not isinstance(fn, types.FunctionType):
            return ("object", self.of(fn))
        code = fn.__code__
        cells = tuple([self.value(_cell_contents(c)) for c in fn.__closure__ or ()])
        found = fn.__globals__
        names = tuple([(n, self.value(found[n])) for n in _global_names(code) if n in found])
        return (
            "function",
            self.of(fn),
            self.of(code),
            self.value(fn.__defaults__),
            self.value(tuple(sorted((fn.__kwdefaults__ or {}).items()))),
            cells,
            names,
        )


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not bound yet
        return _MISSING


_GLOBAL_READS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code objects nested in it (lambdas, comprehensions) may
    read as globals."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_READS]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


def context() -> tuple:
    """The thread's torch state an operator reads besides its arguments: grad and inference
    mode, the default dtype, deterministic algorithms, autocast (per device type, its dtype,
    its cache) and the active torch function and dispatch modes (by type; a default-device
    mode with its device)."""
    autocast: tuple = ()
    if torch._C._is_any_autocast_enabled():
        autocast = tuple(
            [
                (device, torch.get_autocast_dtype(device))
                for device in AUTOCAST_DEVICES
                if torch.is_autocast_enabled(device)
            ]
        ) + (torch.is_autocast_cache_enabled(),)
    modes: tuple = ()
    if torch._C._len_torch_function_stack():
        modes = tuple([_mode_key(m) for m in _get_current_function_mode_stack()])
    if torch._C._len_torch_dispatch_stack():
        modes += tuple([type(m) for m in _get_current_dispatch_mode_stack()])
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        autocast,
        modes,
    )


#: the device types autocast may be on for
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")


def _mode_key(mode: Any) -> Any:
    """A torch function mode by type; the default-device mode (``torch.device`` as a
    context, ``torch.set_default_device``) with the device it puts factories on."""
    device = getattr(mode, "device", None)
    return (type(mode), device) if isinstance(device, torch.device) else type(mode)
