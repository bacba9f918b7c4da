"""Semiring attributions as a Captum ``Attribution`` (needs ``captum``: the ``captum`` extra).

``SemiringAttribution(model, sa.MaxProduct()).attribute(x, target=3)`` runs one patched
forward and one semiring backward seeded at the target output of every example (Captum's
target convention), and returns the readout per input element, in the inputs' shape — so
Captum's visualisation (``captum.attr.visualization``), metrics (``infidelity``,
``sensitivity_max``) and ``NoiseTunnel`` take it as they take ``Saliency``. Under
``sa.Real()`` it is the gradient, ``Saliency(model).attribute(x, target, abs=False)``.

``LayerSemiringAttribution(model, layer, semiring)`` is the Captum ``LayerAttribution``: the
readout at a module's output (or, with ``attribute_to_layer_input=True``, its inputs), from
one patched forward with a hook on the module; under ``sa.Real()`` it is
``LayerGradientXActivation(model, layer, multiply_by_inputs=False)``.

``visualization_record(result)`` turns an ``sa.attribute`` result (per-token scores) into
Captum's ``VisualizationDataRecord``, the scores placed on Captum's colour range [-1, 1] as
the library's reports place them on their semiring's scale, for ``visualize_text``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

try:
    from captum.attr import Attribution, LayerAttribution, visualization
    from captum.log import log_usage
except ImportError as exc:  # the optional extra
    raise ImportError("sa.captum needs captum: pip install 'semiring-autograd[captum]'") from exc

from ..engine.grad import grad
from ..explain.token_scores import Attribution as TokenScores
from ..explain.report import Scale
from ..engine.patch import patch
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec, semiring_named


class SemiringAttribution(Attribution):
    """The semiring readout from the target output to every input element.

    ``forward_func``: the model (an ``nn.Module``, patched for each call), or any function of
    the inputs that runs ``model`` (then give ``model=``; the function's own ops are
    recorded too). ``semiring``: an instance or a
    command-line name (``"max-product"``)."""

    def __init__(
        self,
        forward_func: Callable[..., Tensor],
        semiring: Semiring | str,
        *,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__(forward_func)
        self.model = _model_of(forward_func, model, "SemiringAttribution")
        self.semiring = semiring_named(semiring)

    @log_usage()  # Captum's convention; NoiseTunnel calls the undecorated ``__wrapped__``
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: Any = None,
        additional_forward_args: Any = None,
        *,
        which: str = "max",
    ) -> Tensor | tuple[Tensor, ...]:
        """Per input, a tensor of its shape: the readout from the target output of each
        example (``target`` as in Captum: None for one output per example, an index or an
        index tuple into each example's output, or one per example as a tensor or list).
        The selected outputs start paths (weight 1); with examples that do not interact the
        readout at an example's input is from its own target. SignedMaxProduct: ``which``
        = "max" (largest signed product) or "min"."""
        single = isinstance(inputs, Tensor)
        signed = _check_which(self.semiring, which)
        xs, out = _patched_forward(self, inputs, additional_forward_args)
        seed = _target_mask(out, target, xs[0].shape[0])
        with torch.enable_grad():
            readouts = grad(out, list(xs), seed)
        if signed:
            readouts = tuple(r[0 if which == "max" else 1] for r in readouts)
        return readouts[0] if single else tuple(readouts)

    def has_convergence_delta(self) -> bool:
        return False


class LayerSemiringAttribution(LayerAttribution):
    """The semiring readout from the target output to every element of a layer's output
    (or inputs): Captum's ``LayerAttribution`` with a semiring.

    ``forward_func``, ``semiring`` and ``model=`` as for :class:`SemiringAttribution`;
    ``layer``: a module that ``forward_func`` runs once per call (an embedding, a block, a
    head)."""

    def __init__(
        self,
        forward_func: Callable[..., Tensor],
        layer: nn.Module,
        semiring: Semiring | str,
        *,
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"LayerSemiringAttribution: layer is a {type(layer).__name__}, not an nn.Module"
            )
        super().__init__(forward_func, layer)
        self.model = _model_of(forward_func, model, "LayerSemiringAttribution")
        self.semiring = semiring_named(semiring)

    @log_usage()  # Captum's convention; NoiseTunnel calls the undecorated ``__wrapped__``
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: Any = None,
        additional_forward_args: Any = None,
        attribute_to_layer_input: bool = False,
        *,
        which: str = "max",
    ) -> Tensor | tuple[Tensor, ...]:
        """Per tensor of the layer's output (its positional inputs with
        ``attribute_to_layer_input=True``), a tensor of its shape: the readout from the
        target output of each example, as :meth:`SemiringAttribution.attribute`; one tensor
        where the layer has one, else a tuple (Captum's convention). Every path from the
        target through the layer's tensor counts, and only those: a tensor the model also
        uses outside the layer (a residual stream) has the paths through both uses."""
        signed = _check_which(self.semiring, which)
        seen: list[tuple[Tensor, ...]] = []
        if attribute_to_layer_input:
            hook = self.layer.register_forward_pre_hook(
                lambda module, args: seen.append(_layer_tensors(args, "inputs"))
            )
        else:
            hook = self.layer.register_forward_hook(
                lambda module, args, output: seen.append(_layer_tensors(output, "output"))
            )
        try:
            xs, out = _patched_forward(self, inputs, additional_forward_args)
        finally:
            hook.remove()
        where = "inputs" if attribute_to_layer_input else "output"
        if len(seen) != 1:
            raise ValueError(
                f"LayerSemiringAttribution: the layer ran {len(seen)} times in one forward; "
                "it reads a layer that runs once (hook a module called once, or wrap each "
                "call in its own module)"
            )
        (tensors,) = seen
        if not all(t.requires_grad for t in tensors):
            raise ValueError(
                f"LayerSemiringAttribution: the layer's {where} does not depend on a tensor "
                "requiring grad (a floating input or a parameter), so no path reaches it"
            )
        seed = _target_mask(out, target, xs[0].shape[0] if xs else out.shape[0])
        with torch.enable_grad():
            readouts = grad(out, list(tensors), seed)
        if signed:
            readouts = tuple(r[0 if which == "max" else 1] for r in readouts)
        return readouts[0] if len(readouts) == 1 else tuple(readouts)

    def has_convergence_delta(self) -> bool:
        return False


def visualization_record(
    result: TokenScores, *, true_class: Any = None
) -> "visualization.VisualizationDataRecord":
    """Captum's record of one ``sa.attribute`` result, for ``visualize_text``: per token, its
    score's place on the semiring's report scale (:class:`~..explain.report.Scale`) as a
    weight in Captum's colour range — score / bound where the scale is anchored at zero
    (Real, SignedMaxProduct's largest products: −1 … 1; MaxProduct: 0 … 1), (score − smallest)
    / (largest − smallest) for the log-domain readouts (Log, Entropy, Counting: 0 … 1),
    1 for a path and 0 for none (Boolean); 0 (neutral) for a score that is not finite.
    ``pred_class`` and ``pred_prob`` are the model's most probable next token and its
    probability, ``attr_class`` the target, ``attr_score`` the largest finite score,
    ``raw_input_ids`` the tokens; ``true_class`` is the caller's label (default the
    target)."""
    if not isinstance(result, TokenScores):
        raise TypeError(
            f"visualization_record takes one sa.attribute result, got {type(result).__name__}"
            " (a list of texts gives one result per text: make one record of each)"
        )
    scale = Scale.of(result)
    scores = result.display_scores()
    if result.reached is not None:  # a token no path reaches is neutral, whatever it reads
        scores = scores.masked_fill(~result.reached.reshape(scores.shape), float("nan"))
    finite = torch.isfinite(scores)
    if scale.kind == "presence":
        weights = (scores > 0).double()
    elif scale.kind == "diverging":
        weights = (scores / scale.upper).clamp(-1.0, 1.0)
    else:
        weights = ((scores - scale.lower) / (scale.upper - scale.lower)).clamp(0.0, 1.0)
    weights = torch.where(finite, weights, torch.zeros_like(weights))
    prediction = result.prediction
    top = prediction.top[0] if prediction is not None and prediction.top else (None, float("nan"))
    best = float(scores[finite].max()) if bool(finite.any()) else float("nan")
    return visualization.VisualizationDataRecord(
        weights,
        top[1],
        top[0],
        result.target if true_class is None else true_class,
        result.target,
        best,
        list(result.tokens),
        None,
    )


class _Forward(nn.Module):
    """``forward_func`` as the forward of a module holding the model, so the patch records
    every op it runs, the model's and its own (a scaling, a readout)."""

    def __init__(self, attribution: SemiringAttribution | LayerSemiringAttribution):
        super().__init__()
        self.model = attribution.model
        self.fn = attribution.forward_func

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _model_of(forward_func: Callable[..., Tensor], model: nn.Module | None, who: str) -> nn.Module:
    if model is not None:
        return model
    if not isinstance(forward_func, nn.Module):
        raise TypeError(
            f"{who} patches a module: forward_func is not an nn.Module, so pass the model it "
            "runs as model="
        )
    return forward_func


def _check_which(semiring: Semiring, which: str) -> bool:
    """Whether ``semiring`` is signed (readouts of a (max, min) pair); refuses a bad ``which``."""
    if which not in ("max", "min"):
        raise ValueError(f"which is 'max' or 'min', got {which!r}")
    signed = _signed(semiring)
    if which == "min" and not signed:
        raise ValueError("which='min' is for SignedMaxProduct readouts")
    return signed


def _patched_forward(
    attribution: SemiringAttribution | LayerSemiringAttribution,
    inputs: Tensor | tuple[Tensor, ...],
    additional_forward_args: Any,
) -> tuple[tuple[Tensor, ...], Tensor]:
    """The inputs (detached; floating ones requiring grad) and the output of one forward of
    ``attribution.forward_func`` under the patch."""
    given = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    xs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in given)
    extra = _as_tuple(additional_forward_args)
    model = attribution.model
    runner = model if attribution.forward_func is model else _Forward(attribution)
    with torch.enable_grad():  # Captum's metrics and NoiseTunnel call attribute under no_grad
        with patch(runner, attribution.semiring):
            out = runner(*xs, *extra)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"{type(attribution).__name__}: forward_func returned {type(out).__name__}; it "
            "must return a tensor whose first dimension is the batch (e.g. model(x).logits)"
        )
    return xs, out


def _layer_tensors(value: Any, where: str) -> tuple[Tensor, ...]:
    tensors = (value,) if isinstance(value, Tensor) else value
    if (
        not isinstance(tensors, tuple)
        or not tensors
        or not all(isinstance(t, Tensor) for t in tensors)
    ):
        raise TypeError(
            f"LayerSemiringAttribution: the layer's {where} is {type(value).__name__}, not a "
            "tensor or a tuple of tensors; hook the submodule that returns the tensor"
        )
    return tensors


def _signed(semiring: Semiring) -> bool:
    spec = inherited_spec(semiring)
    return spec is not None and spec.top_paths == "signed"


def _as_tuple(args: Any) -> tuple:
    if args is None:
        return ()
    return tuple(args) if isinstance(args, tuple) else (args,)


def _target_mask(out: Tensor, target: Any, batch: int) -> Tensor:
    """Weights of ``out``'s shape: 1 at each example's target output, 0 elsewhere."""
    if out.dim() == 0 or out.shape[0] != batch:
        raise ValueError(
            f"SemiringAttribution: the output's shape {tuple(out.shape)} does not start with "
            f"the batch size {batch}"
        )
    mask = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    if target is None:
        if out[0].numel() != 1:
            raise ValueError(
                f"target=None needs one output per example; the output has shape "
                f"{tuple(out.shape)}: give target="
            )
        mask.fill_(1.0)
        return mask
    if isinstance(target, Tensor):
        target = target.tolist() if target.numel() > 1 else target.item()
    per_example = isinstance(target, list)
    if per_example and len(target) != batch:
        raise ValueError(f"got {len(target)} targets for a batch of {batch}")
    for b in range(batch):
        t = target[b] if per_example else target
        index = t if isinstance(t, tuple) else (t,)
        try:
            mask[(b, *index)] = 1.0
        except (IndexError, TypeError) as exc:
            raise ValueError(
                f"target {t!r} of example {b} does not index its output of shape "
                f"{tuple(out.shape[1:])}"
            ) from exc
    return mask
