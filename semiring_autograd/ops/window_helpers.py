"""Window geometry that YAML formulas of convolution, pooling and interpolation call.

Each of these ops reads, for every output element, a few input elements along its spatial
dims: a window, separable per dim. One dim's window table is a pair of ``(k, out)``
tensors: the input index each output reads at each of ``k`` taps (−1 where the tap reads
nothing: padding, a shorter window) and, for linear ops with fixed weights (average pooling,
interpolation), the edge weight of that tap. :class:`Windows` combines the tables of all
spatial dims into ``(K, P)`` taps over flat spatial positions, for ``rows`` planes (batch ×
channels); its ``scatter_index`` sends each tap's message to its input element, and every
tap that reads nothing to one extra slot past the end, which the formula drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

Table = tuple[Tensor, "Tensor | None"]


@dataclass(frozen=True)
class Windows:
    """Taps of a windowed op over ``rows`` planes of ``spatial_numel`` elements each."""

    positions: Tensor  # (K, P): flat spatial position each output reads at each tap, or −1
    weights: Tensor | None  # (K, P): the edge weight of each tap (None: no fixed weight)
    rows: int
    spatial_numel: int

    @property
    def taps(self) -> int:
        return self.positions.shape[0]

    @property
    def out_numel(self) -> int:
        return self.positions.shape[1]

    @property
    def slots(self) -> int:
        """Elements of the input: ``rows`` · spatial size (the extra slot is ``slots``)."""
        return self.rows * self.spatial_numel

    @property
    def scatter_index(self) -> Tensor:
        """(rows · K · P,): the flat input position of each tap of each plane, ``slots``
        where the tap reads nothing."""
        pos = self.positions
        base = torch.arange(self.rows, device=pos.device).view(-1, 1, 1) * self.spatial_numel
        flat = torch.where(pos >= 0, base + pos, self.slots)
        return flat.reshape(-1)


def _windows(tables: Sequence[Table], spatial: Sequence[int], rows: int) -> Windows:
    """Combine per-dim tables (index (k_d, o_d), weight (k_d, o_d) or None) over the
    spatial dims into :class:`Windows` with taps ordered (k_1, …, k_n) and outputs
    (o_1, …, o_n), both row-major."""
    n = len(tables)
    flat = None
    valid = None
    weight = None
    stride = 1
    for d in range(n - 1, -1, -1):
        index, w = tables[d]
        view = [1] * (2 * n)
        view[d], view[n + d] = index.shape
        idx = index.view(view)
        ok = idx >= 0
        term = idx.clamp(min=0) * stride
        flat = term if flat is None else flat + term
        valid = ok if valid is None else valid & ok
        if w is not None:
            w = w.view(view)
            weight = w if weight is None else weight * w
        stride *= spatial[d]
    full = [*(t[0].shape[0] for t in tables), *(t[0].shape[1] for t in tables)]
    taps = math.prod(full[:n])
    outs = math.prod(full[n:])
    positions = torch.where(valid, flat, -1).expand(full).reshape(taps, outs)
    if weight is not None:
        weight = torch.where(valid, weight, 0).expand(full).reshape(taps, outs)
    return Windows(positions, weight, rows, math.prod(spatial))


def _tuple(value: int | Sequence[int], n: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    return value * n if len(value) == 1 else value


def _strided_table(
    length: int, out: int, kernel: int, stride: int, pad: int, dilation: int, device
) -> Table:
    """Tap k of output o reads o·stride + k·dilation − pad, when inside [0, length)."""
    index = (
        torch.arange(out, device=device).view(1, -1) * stride
        + torch.arange(kernel, device=device).view(-1, 1) * dilation
        - pad
    )
    return torch.where((index >= 0) & (index < length), index, -1), None


# ----------------------------------------------------------------------------- convolution


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution reading ``(N, C, *spatial)`` with a weight ``(OC, C/G, *kernel)`` into
    ``(N, OC, *out)``. A transposed convolution is described by its adjoint: the
    convolution that reads the transposed op's output grid (``spatial``) into its input grid
    (``out``), ``C`` being the transposed op's output channels."""

    batch: int
    channels: int
    out_channels: int
    groups: int
    spatial: tuple[int, ...]
    out: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, ...]  # leading padding per dim
    dilation: tuple[int, ...]

    @property
    def kernel_numel(self) -> int:
        return math.prod(self.kernel)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out)

    @property
    def group_shape(self) -> tuple[int, int, int, int]:
        """(N, G, OC/G, P): the output by group."""
        g = self.groups
        return (self.batch, g, self.out_channels // g, self.out_numel)

    @property
    def kernel_rows(self) -> tuple[int, int, int]:
        """(G, OC/G, C/G · K): the weight by group."""
        g = self.groups
        return (g, self.out_channels // g, self.channels // g * self.kernel_numel)

    @property
    def tap_shape(self) -> tuple[int, int, int, int, int]:
        """(N, G, P, C/G, K): one message per input channel and tap of each output."""
        g = self.groups
        return (self.batch, g, self.out_numel, self.channels // g, self.kernel_numel)

    @property
    def weight_grad_rows(self) -> tuple[int, int, int]:
        """(G, OC/G, N · P)."""
        g = self.groups
        return (g, self.out_channels // g, self.batch * self.out_numel)

    def windows(self, device: torch.device) -> Windows:
        tables = [
            _strided_table(*dims, device)
            for dims in zip(
                self.spatial, self.out, self.kernel, self.stride, self.pad, self.dilation
            )
        ]
        return _windows(tables, self.spatial, self.batch * self.channels)


def _batch(input_shape: Sequence[int], weight_shape: Sequence[int]) -> int:
    """N of a batched input, 1 of an unbatched one (one dim fewer than the weight)."""
    return input_shape[0] if len(input_shape) == len(weight_shape) else 1


def conv_geometry(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: int | Sequence[int],
    padding: int | str | Sequence[int],
    dilation: int | Sequence[int],
    groups: int,
) -> ConvGeometry:
    """The geometry of ``F.conv{n}d(input, weight, …)`` (padding an int, a tuple, "same"
    or "valid"; "same" puts the odd padding element last, as torch does)."""
    n = len(weight_shape) - 2
    spatial = tuple(input_shape[-n:])
    kernel = tuple(weight_shape[2:])
    stride_, dilation_ = _tuple(stride, n), _tuple(dilation, n)
    if padding == "valid":
        lead = trail = (0,) * n
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation_, kernel)]
        lead = tuple(t // 2 for t in total)
        trail = tuple(t - t // 2 for t in total)
    else:
        lead = trail = _tuple(padding, n)
    out = tuple(
        (length + a + b - d * (k - 1) - 1) // s + 1
        for length, a, b, d, k, s in zip(spatial, lead, trail, dilation_, kernel, stride_)
    )
    return ConvGeometry(
        _batch(input_shape, weight_shape),
        input_shape[-n - 1],
        weight_shape[0],
        groups,
        spatial,
        out,
        kernel,
        stride_,
        lead,
        dilation_,
    )


def conv_transpose_geometry(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    output_padding: int | Sequence[int],
    groups: int,
    dilation: int | Sequence[int],
) -> ConvGeometry:
    """The adjoint geometry of ``F.conv_transpose{n}d(input, weight, …)`` (weight
    ``(C_in, OC/G, *kernel)``): output element q of channel oc reads input element p of
    channel c at tap k where q = p·stride + k·dilation − padding."""
    n = len(weight_shape) - 2
    grid = tuple(input_shape[-n:])
    kernel = tuple(weight_shape[2:])
    stride_, pad, extra, dilation_ = (
        _tuple(v, n) for v in (stride, padding, output_padding, dilation)
    )
    out_grid = tuple(
        (length - 1) * s - 2 * p + d * (k - 1) + e + 1
        for length, s, p, d, k, e in zip(grid, stride_, pad, dilation_, kernel, extra)
    )
    return ConvGeometry(
        _batch(input_shape, weight_shape),
        weight_shape[1] * groups,
        weight_shape[0],
        groups,
        out_grid,
        grid,
        kernel,
        stride_,
        pad,
        dilation_,
    )


def conv_columns(input: Tensor, geometry: ConvGeometry, windows: Windows) -> Tensor:
    """(G, N · P, C/G · K): the input element under each tap of each output (0 where the
    tap reads padding) — the weight's local derivatives, im2col by group."""
    g = geometry
    planes = input.reshape(g.batch * g.channels, -1)
    padded = torch.cat([planes, planes.new_zeros(planes.shape[0], 1)], 1)
    index = torch.where(windows.positions >= 0, windows.positions, planes.shape[1])
    cols = padded[:, index.reshape(-1)]
    cols = cols.reshape(g.batch, g.groups, g.channels // g.groups, g.kernel_numel, g.out_numel)
    return cols.permute(1, 0, 4, 2, 3).reshape(
        g.groups, g.batch * g.out_numel, g.channels // g.groups * g.kernel_numel
    )


def conv_transpose_rows(input: Tensor, geometry: ConvGeometry) -> Tensor:
    """(G, N · P, C_in/G): a transposed convolution's input by group, each element the
    local derivative of its weight taps."""
    g = geometry
    cin = g.out_channels // g.groups
    x = input.reshape(g.batch, g.groups, cin, g.out_numel)
    return x.permute(1, 0, 3, 2).reshape(g.groups, g.batch * g.out_numel, cin)


def conv_transpose_kernel(weight: Tensor, geometry: ConvGeometry) -> Tensor:
    """(G, OC/G · K, C_in/G): a transposed convolution's weight by group, as the matrix its
    input's message is read through."""
    g = geometry
    w = weight.reshape(g.groups, g.out_channels // g.groups, g.channels // g.groups, -1)
    return w.reshape(g.groups, w.shape[1], -1).transpose(1, 2)


# ----------------------------------------------------------------------------- pooling


def _pool_out(length: int, kernel: int, stride: int, pad: int, dilation: int, ceil: bool) -> int:
    """torch's pooling output size (a ceil-mode window must start inside the input or its
    leading padding)."""
    span = length + 2 * pad - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= length + pad:
        out -= 1
    return out


def pool_windows(
    input_shape: Sequence[int],
    dims: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None,
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    ceil_mode: bool,
    device: torch.device,
) -> Windows:
    """The windows of ``F.max_pool{dims}d`` / ``F.avg_pool{dims}d`` over the last ``dims``
    dims (stride None or empty: the kernel size)."""
    kernel = _tuple(kernel_size, dims)
    stride_ = kernel if stride is None or stride == [] or stride == () else _tuple(stride, dims)
    pad, dil = _tuple(padding, dims), _tuple(dilation, dims)
    spatial = tuple(input_shape[-dims:])
    tables = []
    for length, k, s, p, d in zip(spatial, kernel, stride_, pad, dil):
        out = _pool_out(length, k, s, p, d, ceil_mode)
        tables.append(_strided_table(length, out, k, s, p, d, device))
    rows = math.prod(input_shape[:-dims])
    return _windows(tables, spatial, rows)


def avg_pool_windows(
    input_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    dims: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None,
    padding: int | Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Windows:
    """The windows of ``F.avg_pool{dims}d`` with each tap's weight 1/divisor: the pool of
    ones (= taps inside the input / divisor, as torch counts the divisor) over the taps
    inside the input, in the input's precision (float32 for half and bfloat16)."""
    win = pool_windows(input_shape, dims, kernel_size, stride, padding, 1, ceil_mode, device)
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    ones = torch.ones((1, 1, *input_shape[-dims:]), dtype=dtype, device=device)
    pool = getattr(torch.nn.functional, f"avg_pool{dims}d")
    extra = {} if dims == 1 else {"divisor_override": divisor_override}
    share = pool(ones, kernel_size, stride, padding, ceil_mode, count_include_pad, **extra)
    inside = (win.positions >= 0).sum(0, keepdim=True).clamp(min=1).to(dtype)
    weights = torch.where(win.positions >= 0, share.reshape(1, -1) / inside, 0)
    return Windows(win.positions, weights, win.rows, win.spatial_numel)


def _adaptive_table(length: int, out: int, device) -> Table:
    """Output o averages [⌊o·L/O⌋, ⌈(o+1)·L/O⌉), as torch's adaptive pooling."""
    o = torch.arange(out, device=device)
    start = torch.div(o * length, out, rounding_mode="floor")
    end = torch.div((o + 1) * length + out - 1, out, rounding_mode="floor")
    taps = int((end - start).max()) if out else 0
    index = start.view(1, -1) + torch.arange(taps, device=device).view(-1, 1)
    inside = index < end.view(1, -1)
    weight = inside.to(torch.float64) / (end - start).view(1, -1).to(torch.float64)
    return torch.where(inside, index, -1), weight


def adaptive_windows(
    input_shape: Sequence[int], dims: int, output_size: int | Sequence[int | None], device
) -> Windows:
    """The windows of ``F.adaptive_{avg,max}_pool{dims}d`` (an output size None keeps the
    input's), each tap weighted 1/(window size)."""
    spatial = tuple(input_shape[-dims:])
    sizes = (output_size,) * dims if isinstance(output_size, int) else tuple(output_size)
    sizes = tuple(s if s is not None else length for s, length in zip(sizes, spatial))
    tables = [_adaptive_table(length, out, device) for length, out in zip(spatial, sizes)]
    return _windows(tables, spatial, math.prod(input_shape[:-dims]))


def fold_windows(
    input_shape: Sequence[int],
    output_size: int | Sequence[int],
    kernel_size: int | Sequence[int],
    dilation: int | Sequence[int],
    padding: int | Sequence[int],
    stride: int | Sequence[int],
    device: torch.device,
) -> Windows:
    """The windows of ``F.fold`` (columns ``(N, C·K, L)``, or unbatched ``(C·K, L)``, summed
    into ``(N, C, *output_size)``): the output element each column entry lands on."""
    size = _tuple(output_size, 2)
    taps = math.prod(_tuple(kernel_size, 2))
    batch = input_shape[0] if len(input_shape) == 3 else 1
    channels = input_shape[-2] // taps
    return pool_windows(
        (batch, channels, *size), 2, kernel_size, stride, padding, dilation, False, device
    )


def plane_positions(indices: Tensor, input_shape: Sequence[int], dims: int) -> Tensor:
    """Flat input positions of the elements that ``indices`` (torch's max-pooling indices,
    flat within each plane of the last ``dims`` dims) select, for every output element."""
    plane = math.prod(input_shape[-dims:])
    rows = math.prod(input_shape[:-dims])
    base = torch.arange(rows, device=indices.device).view(-1, 1) * plane
    return (indices.reshape(rows, -1) + base).reshape(-1)


# ----------------------------------------------------------------------------- interpolation


def _interpolation_table(
    length: int, size: int | None, scale: float | None, mode: str, align_corners, recompute, dtype
) -> Table:
    """One dim's taps of F.interpolate, read off the op itself: interpolating the rows of
    the identity gives the (out, length) matrix of weights (the modes are separable;
    bicubic, which torch has only in 2-D, runs with a second dim of size 1, read with
    weight exactly 1)."""
    one_d = "linear" if mode in ("linear", "bilinear", "trilinear") else mode
    extra = (
        {} if one_d.startswith("nearest") or one_d == "area" else {"align_corners": align_corners}
    )
    eye = torch.eye(length, dtype=dtype).unsqueeze(0)
    if one_d == "bicubic":
        matrix = torch.nn.functional.interpolate(
            eye.unsqueeze(-1),
            size=None if size is None else (size, 1),
            scale_factor=None if scale is None else (scale, 1.0),
            mode=one_d,
            recompute_scale_factor=recompute,
            **extra,
        )[0, :, :, 0].T
    else:
        matrix = torch.nn.functional.interpolate(
            eye,
            size=size,
            scale_factor=scale,
            mode=one_d,
            recompute_scale_factor=recompute,
            **extra,
        )[0].T
    nonzero = matrix != 0
    count = nonzero.sum(1)
    taps = int(count.max()) if matrix.numel() else 0
    order = torch.argsort(nonzero.to(torch.int8), dim=1, descending=True, stable=True)[:, :taps]
    inside = torch.arange(taps).view(1, -1) < count.view(-1, 1)
    index = torch.where(inside, order, -1).T.contiguous()
    weight = torch.where(inside, matrix.gather(1, order), 0).T.contiguous()
    return index, weight


def interpolation_windows(
    input_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    size: int | Sequence[int] | None,
    scale_factor: float | Sequence[float] | None,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
) -> Windows:
    """The taps and weights of ``F.interpolate`` (any mode but antialiased ones) over
    the spatial dims of an input (N, C, *spatial); weights in the input's precision
    (float32 for half and bfloat16), as torch computes them."""
    dims = len(input_shape) - 2
    spatial = tuple(input_shape[2:])
    sizes = [None] * dims if size is None else list(_tuple(size, dims))
    if scale_factor is None:
        scales = [None] * dims
    elif isinstance(scale_factor, (int, float)):
        scales = [float(scale_factor)] * dims
    else:
        scales = [float(s) for s in scale_factor]
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    tables = [
        _interpolation_table(
            length, sizes[d], scales[d], mode, align_corners, recompute_scale_factor, dtype
        )
        for d, length in enumerate(spatial)
    ]
    tables = [(i.to(device), w.to(device)) for i, w in tables]
    return _windows(tables, spatial, input_shape[0] * input_shape[1])


HELPERS = (
    "conv_geometry",
    "conv_transpose_geometry",
    "conv_columns",
    "conv_transpose_rows",
    "conv_transpose_kernel",
    "pool_windows",
    "avg_pool_windows",
    "adaptive_windows",
    "plane_positions",
    "fold_windows",
    "interpolation_windows",
)
