"""Formula expressions: validation, dependency analysis and rewriting into Python.

A formula is a Python expression over: ``grad`` (the incoming message; ``grads`` for
multi-output ops), ``result`` (the op's primal output), ``aux`` (a forward helper's extra
output), the op's parameters, earlier intermediates, the semiring primitives
(:data:`semiring_autograd.ops.primitives.PRIMITIVES`), the shape helpers, ``shapes(x)`` (the
shapes of a tensor list or of a multi-output result), ``torch``, ``math`` and a few
builtins. ``x.shape``, ``x.ndim``, ``x.dim()``, ``x.dtype`` and ``x.device`` of a tensor parameter
read saved metadata instead of keeping the tensor alive.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

from semiring_autograd.ops import (
    einsum_helpers,
    primitives,
    shape_helpers,
    tensor_helpers,
    window_helpers,
)
from semiring_autograd.ops.primitives import PRIMITIVES

#: helper name -> the alias generated code imports its module as
HELPERS = {
    **{name: "H" for name in shape_helpers.HELPERS},
    **{name: "TH" for name in tensor_helpers.HELPERS},
    **{name: "WH" for name in window_helpers.HELPERS},
    **{name: "EH" for name in einsum_helpers.HELPERS},
}

BUILTINS = frozenset(
    {
        "len",
        "tuple",
        "list",
        "range",
        "int",
        "float",
        "min",
        "max",
        "abs",
        "zip",
        "enumerate",
        "isinstance",
        "sorted",
        "bool",
        "any",
        "all",
        "None",
        "True",
        "False",
    }
)
MODULES = frozenset({"torch", "math"})
SPECIAL = frozenset({"grad", "grads", "result", "aux"})
#: primitives that need the (dtype, device) reference of the op's output
NEEDS_REF = frozenset({"lift", "zero", "fill_zero"})
#: tensor attributes read from saved metadata: attribute -> what is saved (ndim from shape)
META_ATTRS = {"shape": "shape", "ndim": "shape", "dtype": "dtype", "device": "device"}


class FormulaError(ValueError):
    """A formula that does not validate."""


@dataclass(frozen=True)
class Analysis:
    """What a formula reads."""

    full: frozenset[str]  # names read as values (tensors kept alive when tensor params)
    meta: frozenset[tuple[str, str]]  # (tensor param, "shape" | "dtype" | "device") read
    shapes: frozenset[str]  # names read through shapes(...)


def parse(expr: str, where: str) -> ast.Expression:
    try:
        return ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise FormulaError(f"{where}: formula is not a Python expression: {exc.msg}: {expr!r}")


def analyse(tree: ast.Expression, where: str, tensor_params: set[str], known: set[str]) -> Analysis:
    """Validate names and calls; return which names the formula reads and how."""
    bound_locals = _comprehension_names(tree, where)
    shapes = _check_calls(tree, where, known | bound_locals)
    meta, meta_nodes = _metadata_reads(tree, tensor_params)
    full: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            name = node.id
            if name in bound_locals or name in MODULES or (name in BUILTINS and name not in known):
                continue  # a parameter named like a builtin (clamp's min, max) is the parameter
            if name in PRIMITIVES or name in HELPERS or name == "shapes":
                continue
            if name not in known:
                raise FormulaError(
                    f"{where}: unknown name {name!r}; a formula may use grad, grads, result, "
                    f"aux, the op's parameters ({', '.join(sorted(known - SPECIAL)) or 'none'}) "
                    "and earlier intermediates"
                )
            if id(node) not in meta_nodes:
                full.add(name)
    return Analysis(frozenset(full), frozenset(meta), frozenset(shapes))


def _comprehension_names(tree: ast.Expression, where: str) -> set[str]:
    """The names comprehensions bind (no lambdas allowed)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            for gen in node.generators:
                names |= {t.id for t in ast.walk(gen.target) if isinstance(t, ast.Name)}
        if isinstance(node, ast.Lambda):
            raise FormulaError(f"{where}: lambdas are not allowed in formulas")
    return names


def _check_calls(tree: ast.Expression, where: str, callable_names: set[str]) -> set[str]:
    """Check every call of a bare name; return the names read through ``shapes(...)``."""
    shapes: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        fname = node.func.id
        if fname == "shapes":
            if len(node.args) != 1 or not isinstance(node.args[0], ast.Name):
                raise FormulaError(f"{where}: shapes() takes one parameter name")
            if node.args[0].id not in callable_names:
                raise FormulaError(f"{where}: shapes() of unknown name {node.args[0].id!r}")
            shapes.add(node.args[0].id)
        elif not {fname} & (set(PRIMITIVES) | HELPERS.keys() | BUILTINS | callable_names):
            raise FormulaError(
                f"{where}: unknown primitive or function {fname!r}; primitives are "
                f"{', '.join(PRIMITIVES)}; helpers are {', '.join(HELPERS)}"
            )
    return shapes


def _metadata_reads(
    tree: ast.Expression, tensor_params: set[str]
) -> tuple[set[tuple[str, str]], set[int]]:
    """(tensor parameter, saved attribute) pairs read as metadata (``x.shape``, ``x.dim()``
    …, and ``shapes(x)``'s argument), and the ids of the name nodes read that way."""
    meta: set[tuple[str, str]] = set()
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "shapes" and node.args:
                nodes.add(id(node.args[0]))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in tensor_params and node.attr in META_ATTRS:
                nodes.add(id(node.value))
                meta.add((node.value.id, META_ATTRS[node.attr]))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "dim"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in tensor_params
            and not node.args
        ):
            nodes.add(id(node.func.value))
            meta.add((node.func.value.id, "shape"))
    return meta, nodes


#: structural primitives, the same in every semiring: tensor expressions on a one-component
#: value, over the parameter names of their namesakes in semiring_autograd.ops.primitives
STRUCTURAL = {
    "reshape": "{a}.reshape({shape})",
    "permute": "{a}.permute({dims})",
    "transpose": "{a}.transpose({d0}, {d1})",
    "expand": "{a}.expand({shape})",
    "narrow": "{a}.narrow({dim}, {start}, {length})",
    "index_select": "{a}.index_select({dim}, {index})",
    "flip": "{a}.flip({dims})",
    "roll": "{a}.roll({shifts}, {dims})",
    "cat": "torch.cat(list({parts}), {dim})",
    "split": "list({a}.split(list({sizes}), {dim}))",
    "unbind": "list({a}.unbind({dim}))",
    "stack": "torch.stack(list({parts}), {dim})",
}


@dataclass(frozen=True)
class Flavour:
    """How formulas are spelled in one generated module.

    ``generic``: values are tuples of components, every primitive a call
    ``P.<name>(S, ...)``; ``single``: a one-component semiring's values are its component
    tensor, ⊕/⊗/lift are the semiring's ``inline`` forms, structural primitives tensor
    methods, the rest ``C.<name>(S, ...)``; ``plain`` (Real): the same on gradients in the
    primal's dtype (no message precision, no fused ``*_lift``), the rest ``RP.<name>(...)``.
    """

    kind: str  # "generic" | "single" | "plain"
    inline: Any = None  # the semiring's InlineForms (single, plain)


class _Rewriter(ast.NodeTransformer):
    def __init__(self, flavour: Flavour, tensor_params: set[str]):
        self.flavour = flavour
        self.tensor_params = tensor_params

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if (
            isinstance(node.value, ast.Name)
            and node.value.id in self.tensor_params
            and node.attr in META_ATTRS
        ):
            saved = ast.Name(f"{node.value.id}__{META_ATTRS[node.attr]}", ast.Load())
            if node.attr == "ndim":
                return ast.Call(ast.Name("len", ast.Load()), [saved], [])
            return saved
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "dim"
            and not node.args
            and isinstance(f.value, ast.Name)
            and f.value.id in self.tensor_params
        ):
            return ast.Call(
                ast.Name("len", ast.Load()), [ast.Name(f"{f.value.id}__shape", ast.Load())], []
            )
        lifted = _lift_argument(node)
        if lifted is not None and self.flavour.kind != "plain":
            extra = [self.visit(x) for x in node.args[2:]]
            return self._fused(node.func.id, self.visit(node.args[0]), self.visit(lifted), extra)
        node = self.generic_visit(node)
        if not isinstance(node.func, ast.Name):
            return node
        fname = node.func.id
        if fname == "shapes":
            return ast.Name(f"{node.args[0].id}__shapes", ast.Load())
        if fname in HELPERS:
            return _call(HELPERS[fname], fname, node.args, node.keywords)
        if fname not in PRIMITIVES:
            return node
        if self.flavour.kind == "generic":
            args = [_S, *node.args] + ([_REF] if fname in NEEDS_REF else [])
            return _call("P", fname, args, node.keywords)
        return self._one_component(node, fname)

    def _fused(self, fname: str, x: ast.AST, w: ast.AST, extra: list[ast.AST]) -> ast.AST:
        """``mul(x, lift(w))``, ``matmul(x, lift(w))`` and ``contract(x, lift(w), spec)`` as
        one primitive: semirings skip work lift would do (log|w| only to exp it, a signed
        point's four corners)."""
        if self.flavour.kind == "generic":
            return _call("P", f"{fname}_lift", [_S, x, w, *extra, _REF])
        mul_lift = self.flavour.inline.mul_lift
        if fname != "mul" or mul_lift is None:
            return _call("C", f"{fname}_lift", [_S, x, w, *extra, _REF])
        message = _call("C", "as_message", [w, _REF])
        return _expression(mul_lift.format(a=_source(x), w=_source(message)))

    def _one_component(self, node: ast.Call, fname: str) -> ast.AST:
        plain = self.flavour.kind == "plain"
        inline = self.flavour.inline
        args = list(node.args)
        if fname in STRUCTURAL:
            return _expression(STRUCTURAL[fname].format(**_bound_sources(node)))
        if fname in ("mul", "add"):
            form = inline.mul if fname == "mul" else inline.add
            return _expression(form.format(**_bound_sources(node)))
        if fname == "lift" and inline.lift is not None:
            w = _bound(node)["w"]
            w = w if plain else _call("C", "as_message", [w, _REF])
            return _expression(inline.lift.format(w=_source(w)))
        ref = [_REF] if fname in NEEDS_REF else []
        if plain:
            return _call("RP", fname, args + ref, node.keywords)
        return _call("C", fname, [_S, *args] + ref, node.keywords)


_REF = ast.Name("_ref", ast.Load())
_S = ast.Name("S", ast.Load())


def _call(module: str, name: str, args: list, keywords: list | None = None) -> ast.Call:
    return ast.Call(
        ast.Attribute(ast.Name(module, ast.Load()), name, ast.Load()), args, keywords or []
    )


def _source(node: ast.AST) -> str:
    """An argument's source in parentheses, safe to paste into any expression."""
    return f"({ast.unparse(node)})"


def _bound(node: ast.Call) -> dict[str, ast.AST]:
    """A primitive call's argument nodes by the parameter names of its namesake in
    :mod:`semiring_autograd.ops.primitives` (positional and keyword arguments alike)."""
    signature = inspect.signature(getattr(primitives, node.func.id))
    keywords = {k.arg: k.value for k in node.keywords}
    bound = signature.bind_partial(None, *node.args, **keywords).arguments
    return {name: value for name, value in bound.items() if name != "S"}


def _bound_sources(node: ast.Call) -> dict[str, str]:
    return {name: _source(value) for name, value in _bound(node).items()}


def _expression(source: str) -> ast.AST:
    return ast.parse(source, mode="eval").body


def _lift_argument(node: ast.Call) -> ast.AST | None:
    """For ``mul(x, lift(w))``, ``matmul(x, lift(w))`` or ``contract(x, lift(w), spec)``:
    the node ``w``; else None."""
    if (
        isinstance(node.func, ast.Name)
        and len(node.args) == {"mul": 2, "matmul": 2, "contract": 3}.get(node.func.id)
        and isinstance(node.args[1], ast.Call)
        and isinstance(node.args[1].func, ast.Name)
        and node.args[1].func.id == "lift"
        and len(node.args[1].args) == 1
    ):
        return node.args[1].args[0]
    return None


def rewrite(tree: ast.Expression, flavour: Flavour, tensor_params: set[str]) -> str:
    """Python source of the formula in a generated module of ``flavour``."""
    new = _Rewriter(flavour, tensor_params).visit(ast.parse(ast.unparse(tree), mode="eval"))
    ast.fix_missing_locations(new)
    return ast.unparse(new)
