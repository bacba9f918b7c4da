"""``semirings.base.broadcast_shape`` against its oracle, ``torch.broadcast_shapes``: equal and
empty shapes take its shortcut, every other case torch's own rule (errors included)."""

from __future__ import annotations

import pytest
import torch

from semiring_autograd.semirings.base import broadcast_shape

CASES = [
    ((), ()),
    ((3,), ()),
    ((), (2, 3)),
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),
    ((1,), (5,)),
    ((2, 1), (1, 4)),
    ((4, 1, 3), (4, 1, 3), (4, 1, 3)),
    ((4, 1, 3), (), (5, 1)),
    ((0,), (0,)),
    ((0,), (1,)),
]


@pytest.mark.parametrize("shapes", CASES, ids=str)
def test_equals_torch_broadcast_shapes(shapes):
    got = broadcast_shape(*(torch.Size(s) for s in shapes))
    assert isinstance(got, torch.Size)
    assert got == torch.broadcast_shapes(*shapes)


@pytest.mark.parametrize("shapes", [((2,), (3,)), ((2, 3), (3, 2)), ((4,), (4,), (5,))], ids=str)
def test_shapes_that_do_not_broadcast_raise_as_torch_does(shapes):
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes(*shapes)
    with pytest.raises(RuntimeError):
        broadcast_shape(*shapes)
