"""Formula expressions: validation, dependency analysis and rewriting into Python.

A formula is a Python expression over: ``grad`` (the incoming message; ``grads`` for
multi-output ops), ``result`` (the op's primal output), ``aux`` (a forward helper's extra
output), the op's parameters, earlier intermediates, the semiring primitives
(:data:`semiring_autograd.primitives.PRIMITIVES`), the shape helpers, ``shapes(x)`` (the
shapes of a tensor list or of a multi-output result), ``torch``, ``math`` and a few
builtins. ``x.shape``, ``x.ndim``, ``x.dim()``, ``x.dtype`` and ``x.device`` of a tensor parameter
read saved metadata instead of keeping the tensor alive.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from semiring_autograd.ops import shape_helpers, tensor_helpers
from semiring_autograd.ops.primitives import PRIMITIVES

#: helper name -> the alias generated code imports its module as
HELPERS = {
    **{name: "H" for name in shape_helpers.HELPERS},
    **{name: "TH" for name in tensor_helpers.HELPERS},
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


@dataclass
class Analysis:
    """What a formula reads."""

    full: set[str]  # names read as values (tensors kept alive when they are tensor params)
    meta: set[tuple[str, str]]  # (tensor param, "shape" | "dtype" | "device") read as metadata
    shapes: set[str]  # names read through shapes(...)


def parse(expr: str, where: str) -> ast.Expression:
    try:
        return ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise FormulaError(f"{where}: formula is not a Python expression: {exc.msg}: {expr!r}")


def analyse(tree: ast.Expression, where: str, tensor_params: set[str], known: set[str]) -> Analysis:
    """Validate names and calls; return which names the formula reads and how."""
    out = Analysis(set(), set(), set())
    bound_locals: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            for gen in node.generators:
                for t in ast.walk(gen.target):
                    if isinstance(t, ast.Name):
                        bound_locals.add(t.id)
        if isinstance(node, ast.Lambda):
            raise FormulaError(f"{where}: lambdas are not allowed in formulas")
    meta_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fname = node.func.id
            if fname == "shapes":
                if len(node.args) != 1 or not isinstance(node.args[0], ast.Name):
                    raise FormulaError(f"{where}: shapes() takes one parameter name")
                arg = node.args[0].id
                if arg not in known:
                    raise FormulaError(f"{where}: shapes() of unknown name {arg!r}")
                out.shapes.add(arg)
                meta_nodes.add(id(node.args[0]))
            elif fname not in PRIMITIVES and fname not in HELPERS and fname not in BUILTINS:
                if fname in known or fname in bound_locals:
                    continue
                raise FormulaError(
                    f"{where}: unknown primitive or function {fname!r}; primitives are "
                    f"{', '.join(PRIMITIVES)}; helpers are {', '.join(HELPERS)}"
                )
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in tensor_params and node.attr in META_ATTRS:
                meta_nodes.add(id(node.value))
                out.meta.add((node.value.id, META_ATTRS[node.attr]))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "dim"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in tensor_params
            and not node.args
        ):
            meta_nodes.add(id(node.func.value))
            out.meta.add((node.func.value.id, "shape"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            name = node.id
            if name in bound_locals or name in MODULES or name in BUILTINS:
                continue
            if name in PRIMITIVES or name in HELPERS or name == "shapes":
                continue
            if name not in known:
                raise FormulaError(
                    f"{where}: unknown name {name!r}; a formula may use grad, grads, result, "
                    f"aux, the op's parameters ({', '.join(sorted(known - SPECIAL)) or 'none'}) "
                    "and earlier intermediates"
                )
            if id(node) not in meta_nodes:
                out.full.add(name)
    return out


class _Rewriter(ast.NodeTransformer):
    def __init__(self, real: bool, tensor_params: set[str]):
        self.real = real
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
        node = self.generic_visit(node)
        if not isinstance(node.func, ast.Name):
            return node
        fname = node.func.id
        if (
            not self.real
            and fname in ("matmul", "mul")
            and _is_primitive_call(node.args[1], "P", "lift")
        ):
            # matmul(x, lift(w)) -> matmul_lift, mul(x, lift(w)) -> mul_lift: semirings skip
            # work lift would do (log|w| only to exp it, a signed point's four corners)
            lifted = node.args[1].args
            return ast.Call(
                ast.Attribute(ast.Name("P", ast.Load()), f"{fname}_lift", ast.Load()),
                [ast.Name("S", ast.Load()), node.args[0], lifted[1], lifted[2]],
                [],
            )
        if fname == "shapes":
            return ast.Name(f"{node.args[0].id}__shapes", ast.Load())
        if fname in HELPERS:
            return ast.Call(
                ast.Attribute(ast.Name(HELPERS[fname], ast.Load()), fname, ast.Load()),
                node.args,
                node.keywords,
            )
        if fname not in PRIMITIVES:
            return node
        args = list(node.args)
        if fname in NEEDS_REF:
            args.append(ast.Name("_ref", ast.Load()))
        if self.real:
            if fname == "lift":
                return node.args[0]
            if fname == "mul":
                return ast.BinOp(args[0], ast.Mult(), args[1])
            if fname == "add":
                return ast.BinOp(args[0], ast.Add(), args[1])
            return ast.Call(
                ast.Attribute(ast.Name("RP", ast.Load()), fname, ast.Load()), args, node.keywords
            )
        return ast.Call(
            ast.Attribute(ast.Name("P", ast.Load()), fname, ast.Load()),
            [ast.Name("S", ast.Load()), *args],
            node.keywords,
        )


def _is_primitive_call(node: ast.AST, module: str, name: str) -> bool:
    """Is ``node`` an already rewritten call ``module.name(...)``?"""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
    )


def rewrite(tree: ast.Expression, real: bool, tensor_params: set[str]) -> str:
    """Python source of the formula for a semiring (Real inlines lift/mul/add)."""
    new = _Rewriter(real, tensor_params).visit(ast.parse(ast.unparse(tree), mode="eval"))
    ast.fix_missing_locations(new)
    return ast.unparse(new)
