"""``scripts/gpu-check --dry-run``: every stage of the GPU machine's check runs on the CPU at
small sizes and writes what the real run writes, so the first lent GPU spends its minutes
measuring, not failing on set-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_writes_every_stage(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu-check.json").read_text())
    stages = result["stages"]
    assert [r["status"] for r in stages["tests"]] == ["ok"]
    # the CUDA tests are selected by the marker: every test of test_cuda.py at least
    assert stages["tests"][0]["counts"]["collected"] >= 40, stages["tests"]
    assert stages["build"][0]["status"] == "ok"
    rows = {(r["case"], r["mode"]): r for r in result["bench"]}
    assert set(rows) == {("tinyllama", m) for m in ("native", "Real", "MaxProduct")}
    for (_, mode), row in rows.items():
        assert "error" not in row, row
        assert row["median_s"] > 0 and row["peak_bytes"] >= 0
        if mode != "native":
            assert row["native_median_s"] > 0 and 0 <= row["kernel_share"] <= 1.5
    gemm = result["gemm"]["rows"]
    assert {r["variant"] for r in gemm} == {"triton", "torch-chunked"}
    assert all(r["equal_to_triton"] for r in gemm), gemm
    assert all(r["equal_to_triton"] for r in result["gemm"]["tiles"]), result["gemm"]["tiles"]
    text = (out / "gpu-check.md").read_text()
    assert "| tests | ok |" in text and "**tinyllama** (cpu)" in text
    assert "| 32 | triton |" in text
    assert text in proc.stdout
