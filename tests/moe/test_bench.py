"""`python -m lab bench floe`: the ratios it prints are the engine's, and bad input is one sentence."""

import subprocess
import sys

import pytest

from lab.moe.bench import POLICIES, floe_bench, h2d_bandwidth, report

from ..conftest import ROOT


def test_floe_bench_ratios():
    res = floe_bench(seed=0, steps=5, n_seq=1)
    assert list(res) == list(POLICIES)
    assert res["FP16 on demand"]["bytes_vs_fp16"] == 1.0 and res["FP16 on demand"]["layer_error"] == 0.0
    assert res["FloE k=0.8"]["bytes_vs_fp16"] > 5 and res["FloE k=0.9"]["bytes"] < res["FloE k=0.8"]["bytes"]
    assert res["INT2 on demand"]["bytes_vs_fp16"] == pytest.approx(16 / 2.5, rel=1e-6)  # 2 bits + fp16 meta per 64
    text = report(res, "cpu")
    assert "modelled" in text and all(name in text for name in POLICIES)


def test_bench_bad_input_is_one_sentence():
    r = subprocess.run([sys.executable, "-m", "lab", "bench", "floe", "--pcie", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--pcie" in r.stderr


def test_h2d_bandwidth_runs_on_cpu():
    bw = h2d_bandwidth(H=64, n_rows=(1, 8), device="cpu", reps=2)
    assert set(bw) == {"compact", "per_row"} and all(v > 0 for d in bw.values() for v in d.values())
    assert list(bw["compact"]) == [1, 8]
