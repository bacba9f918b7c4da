"""The worst error, in ulp, of log|w| as the Entropy CPU kernels take it, over every positive
finite float32 (2^31 - 2^23 values, in chunks), against torch.log in float64.

Run: .venv/bin/python benchmarks/log_ulp.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import torch

from semiring_autograd import kernels

CHUNK = 1 << 24
LAST = 0x7F800000  # the bits of +inf


def main() -> None:
    worst, at = 0.0, 0.0
    for start in range(1, LAST, CHUNK):
        bits = torch.arange(start, min(start + CHUNK, LAST), dtype=torch.int64)
        w = bits.to(torch.int32).view(torch.float32)
        zero = torch.zeros_like(w)
        got = kernels.entropy_mul_lift(zero, zero, w)
        if got is None:
            raise SystemExit("the CPU kernels are unavailable")
        expected = torch.log(w.double())
        ulp = torch.ldexp(torch.ones_like(expected), torch.frexp(expected).exponent - 24)
        err = (got[0].double() - expected).abs() / ulp
        i = int(err.argmax())
        if float(err[i]) > worst:
            worst, at = float(err[i]), float(w[i])
    print(f"log|w| over every positive float32: at most {worst:.3f} ulp (at w = {at!r})")


if __name__ == "__main__":
    main()
