"""Each op as the generated modules print it: its rule (a Function's ``vjp``) in one
semiring, and its plan (what the forward keeps) for the op table.

The Python here decides every line; the templates only print them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .formulas import Flavour, rewrite
from .model import OpEntry
from .schema import Param


@dataclass(frozen=True)
class Rule:
    """One op's backward in one semiring: the function ``name(parameters)`` runs ``body``."""

    op: str
    name: str
    parameters: tuple[str, ...]
    body: tuple[str, ...]
    #: every name the body reads (its imports and whether it takes ``_ref`` follow)
    names: frozenset[str]


def rule_name(entry: OpEntry) -> str:
    """The name of ``entry``'s rule in a generated module (``sum.dim`` → ``sum_dim_vjp``)."""
    return f"{entry.schema.func_name}_vjp"


def rule(entry: OpEntry, flavour: Flavour, lead: tuple[str, ...] = ()) -> Rule:
    """The rule of ``entry`` spelled in ``flavour``. It takes ``lead``, the incoming
    message(s), one ``need_<input>`` per input with a formula when there are several, the
    saved tensors, the kept values and, when a formula reads it, the output's (dtype,
    device) ``_ref``; it returns the message of its one input, or the inputs' messages in
    formula order (None for an input not needed)."""
    several = len(entry.formulas) > 1
    code = {
        f.target: rewrite(f.tree, flavour, entry.tensor_params) for f in entry.formulas.values()
    }
    body = [
        f"{i.target} = {rewrite(i.tree, flavour, entry.tensor_params)}" for i in entry.intermediates
    ]
    if several:
        guards = [" or ".join(f"need_{u}" for u in i.users) for i in entry.intermediates]
        body = _merge_guards([f"if {g}:\n    {b}" for g, b in zip(guards, body)])
        results = [c if c == "None" else f"{c} if need_{t} else None" for t, c in code.items()]
        body.append(f"return ({', '.join(results)})")
    else:  # the rule runs only when its one input is needed
        body.append(f"return {next(iter(code.values()))}")
    names = frozenset(n.id for b in body for n in ast.walk(ast.parse(b)) if isinstance(n, ast.Name))
    parameters = (
        *lead,
        "grads" if entry.multi_output else "grad",
        *(f"need_{t}" for t in entry.formulas if several),
        *(s.name for s in entry.saved),
        *(k.name for k in entry.kept),
        *(("_ref",) if "_ref" in names else ()),
    )
    return Rule(entry.name, rule_name(entry), parameters, tuple(body), names)


def _merge_guards(statements: list[str]) -> list[str]:
    """Consecutive ``if <same condition>:`` blocks as one block."""
    merged: list[str] = []
    for statement in statements:
        head, _, rest = statement.partition("\n")
        if merged and merged[-1].partition("\n")[0] == head:
            merged[-1] += "\n" + rest
        else:
            merged.append(statement)
    return merged


def plan_source(entry: OpEntry) -> str:
    """``Plan(...)`` for ``entry`` (:class:`semiring_autograd.ops.function.Plan`)."""
    index = {n: str(i) for i, n in enumerate(entry.param_names)}
    index |= {"result": "OUTPUT", "aux": "AUX"}
    order = list(entry.formulas)
    fields = {
        "name": repr(entry.name),
        "params": _tuple(repr(p) for p in entry.param_names),
        "targets": _tuple(index[t] for t in order),
    }
    if entry.saved:
        fields["saved"] = _tuple(
            f"({index[s.name]}, {_tuple(str(order.index(r)) for r in s.readers)})"
            for s in entry.saved
        )
    if entry.kept:
        fields["kept"] = _tuple(f"({k.kind!r}, {index[k.source]}, {k.attr!r})" for k in entry.kept)
    if entry.tensor_list is not None:
        fields["list_at"] = index[entry.tensor_list.name]
    if entry.forward:
        fields["forward"] = f"FH.{entry.forward}"
    if entry.multi_output:
        fields["multi_output"] = "True"
    if entry.has_aux:
        fields["has_aux"] = "True"
    if entry.returns_aux:
        condition = condition_source(entry.returns_aux)
        fields["returns_aux"] = f"lambda {', '.join(entry.param_names)}: {condition}"
    if entry.aux_type:
        fields["aux_type"] = entry.aux_type
    return _call("Plan", fields)


def spec_source(entry: OpEntry) -> str:
    """``OpSpec(...)`` for ``entry`` (:class:`semiring_autograd.ops.spec.OpSpec`)."""
    params = (
        f"ParamSpec({p.name!r}, {p.type!r}, {p.has_default}, {default_source(p)}, {p.kwonly})"
        for p in entry.schema.params
    )
    fields = {
        "name": repr(entry.name),
        "signature": repr(entry.schema.text),
        "params": _tuple(params),
        "torch_functions": _tuple(repr(t) for t in entry.torch_functions),
        "granularity": repr(entry.granularity),
        "source_file": repr(entry.source_file),
    }
    if entry.accepts:
        fields["accepts"] = (
            f"lambda {', '.join(entry.param_names)}: {condition_source(entry.accepts)}"
        )
        fields["accepts_text"] = repr(entry.accepts)
    if entry.multi_output:
        fields["multi_output"] = "True"
    if entry.forward:
        fields["forward_helper"] = repr(entry.forward)
    if entry.differentiable:
        fields["differentiable"] = _tuple(repr(d) for d in entry.differentiable)
    if entry.may_return_input:
        fields["may_return_input"] = "True"
    return _call("OpSpec", fields)


def default_source(p: Param) -> str:
    """A parameter's default as Python source."""
    if not p.has_default:
        return "None"
    if isinstance(p.default, tuple) and p.default[:1] == ("torch_attr",):
        return p.default[1]
    return repr(p.default)


def _call(name: str, fields: dict[str, str]) -> str:
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"


def _tuple(items) -> str:
    items = list(items)
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def condition_source(source: str) -> str:
    """A condition on an op's arguments (``accepts``, ``returns_aux``) as Python source."""
    return rewrite(ast.parse(source, mode="eval"), Flavour("generic"), set())
