"""The YAML loader's errors, `generate --check`, and a new op added through YAML end to end."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import semiring_autograd as sa
from semiring_autograd.codegen import generate
from semiring_autograd.codegen.loader import DerivativesError, load_entries, load_entry
from semiring_autograd.engine.dispatch import OpTable
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

ROOT = Path(__file__).resolve().parent.parent


def _entry(text: str):
    import yaml

    return load_entry(yaml.safe_load(textwrap.dedent(text)), "test.yaml entry 1")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.exp]
            granularity: op
            input: frobnicate(grad, lift(result))
            """,
            "unknown primitive or function 'frobnicate'",
        ),
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.exp]
            granularity: op
            input: mul(grad, lift(reslt))
            """,
            "unknown name 'reslt'",
        ),
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.exp]
            granularity: op
            input: mul(grad, lift(result))
            other: grad
            """,
            "formula for unknown input name 'other'",
        ),
        (
            """
            name: embedding(Tensor input, Tensor weight) -> Tensor
            torch: [torch.nn.functional.embedding]
            granularity: op
            non_differentiable: [input]
            input: grad
            weight: grad
            """,
            "formula given for non-differentiable input 'input'",
        ),
        (
            """
            name: mul(Tensor input, Tensor other) -> Tensor
            torch: [torch.mul]
            granularity: op
            input: mul(grad, lift(other))
            """,
            "missing formula for tensor input 'other'",
        ),
        (
            """
            name: mul(Tensor input, int other) -> Tensor
            torch: [torch.mul]
            granularity: op
            input: grad
            other: grad
            """,
            "'other' is a int, not a tensor",
        ),
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.not_a_function]
            granularity: op
            input: grad
            """,
            "torch.not_a_function' does not exist",
        ),
        (
            """
            name: exp(Tensor input) => Tensor
            torch: [torch.exp]
            granularity: op
            input: grad
            """,
            "cannot parse signature",
        ),
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.exp]
            input: grad
            """,
            "'granularity:' must say",
        ),
        (
            """
            name: exp(Tensor input) -> Tensor
            torch: [torch.exp]
            granularity: op
            input: mul(grad, lift(result)
            """,
            "not a Python expression",
        ),
        (
            """
            name: exp(Blob input) -> Tensor
            torch: [torch.exp]
            granularity: op
            input: grad
            """,
            "unknown type 'Blob'",
        ),
        (
            """
            name: einsum(Tensor... operands, str equation) -> Tensor
            torch: [torch.einsum]
            granularity: op
            operands: grad
            """,
            "a Tensor... parameter must be the last",
        ),
        (
            """
            name: einsum(str equation, int n) -> Tensor
            torch: [torch.einsum]
            granularity: op
            """,
            "no Tensor parameter",
        ),
        (
            """
            name: contiguous(Tensor input) -> Tensor
            torch: [torch.Tensor.contiguous]
            granularity: op
            may_return_input: yes please
            input: grad
            """,
            "'may_return_input:' is true or false",
        ),
        (
            """
            name: cat(Tensor[] tensors, int dim=0) -> Tensor
            torch: [torch.cat]
            granularity: op
            may_return_input: true
            tensors: "[reshape(piece, shape) for piece, shape in zip(split(grad, split_sizes(shapes(tensors), dim), dim), shapes(tensors))]"
            """,
            "needs a first parameter of type Tensor",
        ),
        (
            """
            name: unbind(Tensor input, int dim=0) -> Tensor[]
            torch: [torch.unbind]
            granularity: op
            may_return_input: true
            input: stack(grads, dim)
            """,
            "needs an op returning one tensor",
        ),
    ],
)
def test_loader_errors(text, message):
    with pytest.raises(DerivativesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _entry(text)


def test_duplicate_op_is_an_error(tmp_path):
    entry = """
- name: exp(Tensor input) -> Tensor
  torch: [torch.exp]
  granularity: op
  input: mul(grad, lift(result))
"""
    (tmp_path / "a.yaml").write_text(entry)
    (tmp_path / "b.yaml").write_text(entry)
    with pytest.raises(DerivativesError, match="defined twice"):
        load_entries(tmp_path)


def test_ops_generating_the_same_python_name_are_an_error(tmp_path):
    """``neg.out`` and ``neg_out`` differ as ops but would both generate the rule
    ``neg_out_vjp``."""
    (tmp_path / "a.yaml").write_text("""
- name: neg.out(Tensor input) -> Tensor
  torch: [torch.neg]
  granularity: op
  input: grad
- name: neg_out(Tensor input) -> Tensor
  torch: [torch.Tensor.neg]
  granularity: op
  input: grad
""")
    with pytest.raises(DerivativesError, match="both generate the Python name 'neg_out'"):
        load_entries(tmp_path)


def test_generate_check_is_clean():
    """This process renders exactly the committed files, which another process rendered
    (another hash seed, another set order): rendering is deterministic."""
    assert generate.main(["--check"]) == 0


def test_generate_check_detects_stale_and_rewrites_only_changed(tmp_path):
    out = tmp_path / "gen"
    shutil.copytree(ROOT / "generated", out, ignore=shutil.ignore_patterns("__pycache__"))
    assert generate.main(["--check", "--out-dir", str(out)]) == 0
    target = out / "log.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    assert generate.main(["--check", "--out-dir", str(out)]) == 1
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.py")}
    assert generate.write(ROOT / "derivatives", out, check=False) == ["log.py"]
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.py")}
    assert [n for n in before if before[n] != after[n]] == ["log.py"]
    assert generate.main(["--check", "--out-dir", str(out)]) == 0


def test_generated_files_carry_header_and_hash():
    for path in (ROOT / "generated").glob("*.py"):
        head = path.read_text().splitlines()[:3]
        assert head[0].startswith("# @generated") and "DO NOT EDIT" in head[0]
        assert any(line.startswith("# source-hash: ") for line in head)


SIN_ENTRY = """
- name: sin(Tensor input) -> Tensor
  torch: [torch.sin, torch.Tensor.sin]
  granularity: op
  input: mul(grad, lift(torch.cos(input)))
"""


def test_new_op_via_yaml_end_to_end(tmp_path):
    yaml_dir = tmp_path / "derivatives"
    yaml_dir.mkdir()
    core = yaml.safe_load((ROOT / "derivatives" / "core.yaml").read_text())
    kept = [e for e in core if e["name"].split("(")[0] in ("linear", "sum.dim")]
    (yaml_dir / "core.yaml").write_text(yaml.safe_dump(kept, allow_unicode=True))
    (yaml_dir / "extra.yaml").write_text(SIN_ENTRY)
    out = tmp_path / "generated"
    assert generate.main(["--yaml-dir", str(yaml_dir), "--out-dir", str(out)]) == 0
    op_table = OpTable.load(out)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return torch.sin(self.lin(x)).sum(-1)

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(sa.UnsupportedOpError, match="torch.sin"):
        with sa.patch(model, sa.Real()):
            model(x)
    (expected,) = torch.autograd.grad(model(x).sum(), x)  # unpatched
    for real in (sa.Real(), sa.Real(formulas=True)):  # torch's graph; the new formula
        with sa.patch(model, real, op_table=op_table):
            y = model(x)
        torch.testing.assert_close(sa.grad(y.sum(), x), expected, rtol=1e-12, atol=1e-12)
    with sa.patch(model, sa.MaxProduct(), op_table=op_table):
        y = model(x)
    got = sa.grad(y[1], x)
    # brute force: paths x[1, j] -> h[1, i] -> sin -> sum; weight |W_ij| |cos(h_i)|
    h = model.lin(x)[1]
    brute = (model.lin.weight.abs() * torch.cos(h).abs()[:, None]).amax(0)
    torch.testing.assert_close(got[1], brute.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0], torch.zeros(3, dtype=torch.float64))


class MyMaxTimes(sa.Semiring):
    """A user's (max, ×) written from scratch: only the definition, no fast paths."""

    def zero(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=like.dtype, device=like.device),)

    def one(self, shape, like):
        return (torch.ones(tuple(shape), dtype=like.dtype, device=like.device),)

    def lift(self, w):
        return (w.abs(),)

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def readout(self, a):
        return a[0]


def test_user_semiring_runs_through_generic_module():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 4), nn.LayerNorm(4), nn.GELU(), nn.Linear(4, 3), nn.Softmax(-1)
    ).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, MyMaxTimes()):
        y = model(x)
    assert type(y.grad_fn).__name__ == "SoftmaxFunctionalBackward"
    assert "generic" in type(y.grad_fn)._forward_cls.__module__
    mine = sa.grad(y, x)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    torch.testing.assert_close(mine, sa.grad(y, x), rtol=1e-12, atol=1e-12)


def _inline_cases(S: sa.Semiring) -> dict[str, tuple]:
    """Arguments for each inline form: real derivatives with zeros, signs, inf and NaN, and
    component tensors made by lifting them (so every kind of value occurs)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, dtype=torch.float64, generator=gen) * 3
    w[:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-300])
    v = w[torch.randperm(64, generator=gen)]
    (a,), (b,) = S.lift(w), S.lift(v)
    return {
        "lift": {"w": w},
        "mul": {"a": a, "b": b},
        "add": {"a": a, "b": b},
        "mul_lift": {"a": a, "w": v},
    }


@pytest.mark.parametrize(
    "cls", [c for c in BUILTIN_SEMIRINGS if c.inline is not None], ids=lambda c: c.__name__
)
def test_inline_forms_equal_the_methods(cls):
    """The tensor expressions a specialised module is generated from compute what the
    semiring's methods compute, NaN and infinities included."""
    S = cls()
    methods = {
        "lift": lambda w: S.lift(w)[0],
        "mul": lambda a, b: S.mul((a,), (b,))[0],
        "add": lambda a, b: S.add((a,), (b,))[0],
        "mul_lift": lambda a, w: S.mul_lift((a,), w)[0],
    }
    checked = 0
    for name, args in _inline_cases(S).items():
        form = getattr(cls.inline, name)
        if form is None:
            continue
        names = {k: f"args[{k!r}]" for k in args}
        scope = {"torch": torch, "math": __import__("math"), "args": args, "S": S}
        got = eval(form.format(**names), scope)
        torch.testing.assert_close(got, methods[name](**args), rtol=0, atol=0, equal_nan=True)
        checked += 1
    assert checked >= 3


def test_generated_modules_follow_the_registry_and_are_not_copies():
    """One module per built-in semiring the registry gives its own, bound to that semiring,
    plus the generic one; no two are the same file but for a name."""
    import semiring_autograd.generated as generated
    from semiring_autograd.semirings.registry import SEMIRINGS

    own = {s.name: s.cls for s in SEMIRINGS if s.module == "own"}
    assert set(generated.MODULES) == set(own) | {"generic"}
    for name, cls in own.items():
        assert generated.MODULES[name].S == cls()
    bodies = {}
    for name in generated.MODULES:
        text = (ROOT / "generated" / f"{name}.py").read_text()
        body = text.split('"""', 2)[2]  # after the module docstring
        cls = own.get(name)
        bodies[name] = body.replace(cls.__name__, "SEMIRING") if cls else body
    names = sorted(bodies)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert bodies[first] != bodies[second], f"{first}.py and {second}.py are copies"


def test_one_component_primitives_bind_keywords_by_the_primitive_signature():
    """A structural primitive or ⊗ written with keyword arguments is spelled as the
    positional call would be (the names are those of ``semiring_autograd.ops.primitives``)."""
    import ast

    from semiring_autograd.codegen.formulas import Flavour, rewrite

    flavour = Flavour("single", sa.Log.inline)
    for positional, keyword in (
        ("reshape(grad, (2, 3))", "reshape(grad, shape=(2, 3))"),
        ("transpose(grad, 0, 1)", "transpose(a=grad, d1=1, d0=0)"),
        ("mul(grad, grad)", "mul(grad, b=grad)"),
        ("cat([grad, grad], 0)", "cat(dim=0, parts=[grad, grad])"),
    ):
        expected = rewrite(ast.parse(positional, mode="eval"), flavour, {"x"})
        assert rewrite(ast.parse(keyword, mode="eval"), flavour, {"x"}) == expected
    assert rewrite(ast.parse("transpose(grad, 0, 1)", mode="eval"), flavour, set()) == (
        "grad.transpose(0, 1)"
    )
