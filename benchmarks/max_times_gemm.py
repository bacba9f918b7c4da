"""The max-times GEMM, out[i, j] = max_k a[i, k]·b[k, j]: the Triton kernel against torch
formulations, in terms per second and as a share of the device's float32 peak.

Per square size n (float32, batch 1, uniform [0, 1) operands, seed 0), each variant's median
time over repeated calls after a warm-up call:

- ``triton``: the operators' CUDA kernel (``kernels/triton_matmul.py``), called directly;
- ``torch-chunked``: the broadcast product over a chunk of k and its ``amax``, folded over
  the chunks with ``torch.maximum`` (chunks of at most 256 MiB of products), sizes up to
  4096;
- ``torch-compiled``: ``torch.compile`` of the broadcast product and its ``amax`` over all
  of k (Inductor fuses them into one reduction kernel), sizes up to 2048 (not in a dry run).

``--tiles`` times the Triton kernel again at the largest size under other tile shapes and
unrolls (BLOCK_M, BLOCK_N, warps, unroll of k), each checked equal to the default's
result, so the kernel's choice is measured on the device at hand.

A term is one multiply and one max, counted as 2 operations as a GEMM counts its
multiply-add: rate = 2·n³ / time. The float32 peak (no tensor cores) is multiprocessors ×
128 lanes × 2 × the maximum SM clock (``nvidia-smi``). Every variant's result is checked
equal to the Triton kernel's, entry for entry (the products are the same multiplies and a
max is exact). ``--dry-run`` runs the kernel in Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, set before Triton is imported) at n = 32.

Usage: ``python benchmarks/max_times_gemm.py [--sizes 1024 4096] [--json FILE] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: products held at once by the chunked torch formulation
CHUNK_BYTES = 256 * 2**20


def fp32_peak(torch) -> float | None:
    """Float32 non-tensor-core peak of CUDA device 0 in operations/s, or None off CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        mhz = float(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return sms * 128 * 2 * mhz * 1e6


def chunked(torch, a, b):
    """max_k a[0, :, k]·b[0, k, :] by chunks of k: broadcast product, amax, maximum."""
    m, k = a.shape[1:]
    n = b.shape[2]
    step = max(1, CHUNK_BYTES // (m * n * a.element_size()))
    out = None
    for k0 in range(0, k, step):
        part = (a[0, :, k0 : k0 + step, None] * b[0, None, k0 : k0 + step, :]).amax(1)
        out = part if out is None else torch.maximum(out, part)
    return out[None]


def timed(torch, fn, device: str, budget_s: float) -> float:
    """Median seconds of ``fn()`` over calls after one warm-up, at least 3 and up to
    ``budget_s`` of calls (at most 20)."""
    fn()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s and len(times) < 20):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(torch, row: dict, fn, reference, device: str, budget_s: float) -> dict:
    """``row`` with whether ``fn()`` equals ``reference`` and its median seconds and terms
    per second (n³ terms, n = ``row["n"]``), or the error it raised."""
    try:
        row["equal_to_triton"] = bool(torch.equal(fn(), reference))
        row["seconds"] = timed(torch, fn, device, budget_s)
        row["terms_per_s"] = row["n"] ** 3 / row["seconds"]
    except Exception as error:  # noqa: BLE001 -- recorded in the row
        row["error"] = f"{type(error).__name__}: {str(error)[:1000]}"
    return row


#: (BLOCK_M, BLOCK_N, warps, unroll of k) tried by --tiles; each a multiple of LANES_N
TILES = [(64, 64, 4, 4), (64, 64, 4, 8), (128, 64, 4, 4), (64, 128, 4, 4), (128, 64, 8, 4),
         (128, 128, 8, 4), (32, 64, 2, 4)]  # fmt: skip


def tile_sweep(torch, triton_matmul, n: int, device: str, budget_s: float) -> list[dict]:
    """The max_times kernel under each of TILES at size n, against the default tile's
    result; the module's TILES and UNROLL are restored afterwards."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(1, n, n, generator=gen).to(device)
    b = torch.rand(1, n, n, generator=gen).to(device)
    out = a.new_empty(1, n, n)
    reference = triton_matmul.max_times(a, b, 0.0, False, out).clone()
    default = (dict(triton_matmul.TILES), dict(triton_matmul.UNROLL))
    rows = []
    try:
        for block_m, block_n, warps, unroll in TILES[:2] if device == "cpu" else TILES:
            triton_matmul.TILES[("max_times", torch.float32)] = (block_m, block_n, warps)
            triton_matmul.UNROLL["max_times"] = unroll
            row = {"n": n, "tile": [block_m, block_n, warps, unroll]}
            fn = lambda: triton_matmul.max_times(a, b, 0.0, False, out)  # noqa: E731
            rows.append(measure(torch, row, fn, reference, device, budget_s))
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        triton_matmul.TILES, triton_matmul.UNROLL = default[0], default[1]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of calls per row")
    parser.add_argument("--json", help="write the rows to this file (rewritten after each)")
    parser.add_argument("--dry-run", action="store_true", help="Triton's interpreter on CPU")
    parser.add_argument("--tiles", action="store_true", help="also other tiles, largest size")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.sizes = [32]
    import torch

    from semiring_autograd.kernels import triton_matmul

    device = "cpu" if args.dry_run else "cuda"
    peak = fp32_peak(torch)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "fp32_peak_ops": peak,
        "rows": [],
    }
    compiled = torch.compile(lambda a, b: (a[:, :, :, None] * b[:, None, :, :]).amax(2))
    for n in args.sizes:
        gen = torch.Generator().manual_seed(0)
        a = torch.rand(1, n, n, generator=gen).to(device)
        b = torch.rand(1, n, n, generator=gen).to(device)
        out = a.new_empty(1, n, n)
        reference = triton_matmul.max_times(a, b, 0.0, False, out).clone()
        variants = {"triton": lambda: triton_matmul.max_times(a, b, 0.0, False, out)}
        if n <= 4096:
            variants["torch-chunked"] = lambda: chunked(torch, a, b)
        if n <= 2048 and not args.dry_run:
            variants["torch-compiled"] = lambda: compiled(a, b)
        for name, fn in variants.items():
            row = measure(torch, {"n": n, "variant": name}, fn, reference, device, args.budget)
            if peak and "seconds" in row:
                row["share_of_fp32_peak"] = 2 * n**3 / row["seconds"] / peak
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    if args.tiles:
        result["tiles"] = tile_sweep(torch, triton_matmul, args.sizes[-1], device, args.budget)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result))
    if not all(r.get("equal_to_triton") for r in result.get("tiles", [])):
        sys.exit("a tile shape failed or differs from the default's result")
    if not all(r.get("equal_to_triton") for r in result["rows"]):
        sys.exit("a variant failed or differs from the Triton kernel")


if __name__ == "__main__":
    main()
