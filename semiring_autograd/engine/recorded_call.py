"""A recorded op call that can be re-run: local Jacobian columns for path recovery.

Recorded by ``sa.patch(..., paths=True)`` on each backward node
(``sa.node_info(grad_fn).recorded``). Its inputs are numbered as the node's
``next_functions`` are (the op's tensor arguments in the order the generated Function
receives them), so position ``p`` of the node is input ``p`` here, even when one tensor is
passed twice (``x * x`` has two inputs, two edges).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

#: inputs up to this size (or the differentiated input's) carry zero tangents in ``column``
ZERO_TANGENT_ELEMENTS = 1 << 16


@dataclass
class RecordedCall:
    """One op call as recorded: the function and its arguments, rerun on substituted inputs."""

    func: Callable[..., Any]
    leaves: list[Any]  # the call's flattened (args, kwargs)
    spec: TreeSpec
    input_leaf: tuple[int, ...]  # for each node input position, its index in ``leaves``
    rng_state: Tensor | None  # the CPU RNG state before the call, for ops that draw noise
    parameter_names: tuple[str | None, ...] = ()  # per node input: its name in the model

    @classmethod
    def record(
        cls,
        func: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        op,
        bound: dict,
        name_of: Callable[[Tensor], str | None] | None = None,
    ):
        """The record of ``func(*args, **kwargs)``, bound to the YAML entry ``op`` as
        ``bound``; ``name_of`` gives a parameter's qualified name in the model (or None)."""
        leaves, spec = tree_flatten((args, kwargs))
        ordered = [bound[p.name] for p in op.params if not p.is_tensor_list]
        ordered += [t for p in op.params if p.is_tensor_list for t in bound[p.name]]
        taken: set[int] = set()
        positions = []
        for value in ordered:
            if not isinstance(value, Tensor):
                continue
            i = next(i for i, leaf in enumerate(leaves) if leaf is value and i not in taken)
            taken.add(i)
            positions.append(i)
        rng = torch.get_rng_state() if op.forward_helper else None
        named = name_of or (lambda tensor: None)
        parameters = tuple(
            named(leaves[i]) if isinstance(leaves[i], torch.nn.Parameter) else None
            for i in positions
        )
        return cls(func, leaves, spec, tuple(positions), rng, parameters)

    def inputs(self) -> list[Tensor]:
        """The op's tensor inputs, in node input order."""
        return [self.leaves[i] for i in self.input_leaf]

    def rerun(self, substitute: dict[int, Any] | None = None, fn: Callable | None = None) -> Any:
        """Re-run the call (or ``fn`` with the same arguments), replacing node inputs
        ``{position: value}``; noise-drawing ops draw the same noise again."""
        leaves = list(self.leaves)
        for position, value in (substitute or {}).items():
            leaves[self.input_leaf[position]] = value
        args, kwargs = tree_unflatten(leaves, self.spec)
        with self._same_noise():
            return (fn or self.func)(*args, **kwargs)

    def column(self, position: int, element: int) -> tuple[Tensor, ...]:
        """∂out/∂x[element] for every output of the op (flattened), x = input ``position``:
        one column of the op's local Jacobian, by forward-mode AD.

        The other floating-point inputs first carry zero tangents, where no two of their
        elements share memory and they hold at most as many elements as x or
        ``ZERO_TANGENT_ELEMENTS``: an input without one takes torch's zero-tensor path, ten
        times slower on a small elementwise product, and a large one (a weight) would cost
        more in zeros than it saves. A zero tangent adds 0 · (a partial derivative) to each
        entry, which changes nothing where the partial derivative is finite and gives NaN
        where it is not (x · y's 0 · x at an infinite x): a column with a NaN is taken again
        with no tangents on the other inputs."""
        inputs = self.inputs()
        primal = inputs[position].detach().contiguous()  # no expanded (aliased) input
        tangent = torch.zeros(primal.numel(), dtype=primal.dtype, device=primal.device)
        tangent[element] = 1
        tangent = tangent.view(primal.shape)
        columns = self._forward_column(inputs, position, primal, tangent, zero_tangents=True)
        if any(_has_nan(c) for c in columns):
            columns = self._forward_column(inputs, position, primal, tangent, zero_tangents=False)
        return tuple(c.reshape(-1) for c in columns)

    def _forward_column(
        self,
        inputs: list[Tensor],
        position: int,
        primal: Tensor,
        tangent: Tensor,
        zero_tangents: bool,
    ) -> list[Tensor]:
        """The op's outputs' tangents for ``tangent`` on input ``position``; the other
        inputs with zero tangents (``zero_tangents``, where they can hold one) or none."""
        with torch.no_grad(), forward_ad.dual_level():
            substitute = {position: forward_ad.make_dual(primal, tangent)}
            for p, t in enumerate(inputs):
                if p != position:
                    t = t.detach()
                    small = t.numel() <= max(primal.numel(), ZERO_TANGENT_ELEMENTS)
                    dual = zero_tangents and small and _holds_a_tangent(t)
                    substitute[p] = forward_ad.make_dual(t, torch.zeros_like(t)) if dual else t
            out = self.rerun(substitute)
            columns = []
            for o in out if isinstance(out, (tuple, list)) else (out,):
                value, column = forward_ad.unpack_dual(o)
                columns.append(torch.zeros_like(value) if column is None else column)
        return columns

    @contextlib.contextmanager
    def _same_noise(self):
        if self.rng_state is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng_state)
            yield


def _holds_a_tangent(t: Tensor) -> bool:
    """Whether input ``t`` can carry a tangent: floating point, and no two of its elements
    at one memory location (forward AD writes tangents in place)."""
    return t.is_floating_point() and bool(torch.ops.aten.is_non_overlapping_and_dense(t))


def _has_nan(t: Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())
