"""`python -m lab bench floe`: the ratios it prints are the engine's, and bad input is one sentence."""

import subprocess
import sys

import pytest

from lab.moe.bench import POLICIES, floe_bench, h2d_bandwidth, report

from ..conftest import ROOT


def test_floe_bench_ratios():
    """Bytes per token from the byte formulas of `lab.moe.offload` on the bench's toy (H = 64, F = 192, 4 layers
    with layer 0 resident, top-2 routing): FP16 moves every routed expert whole, INT2 its 2-bit codes plus an
    FP16 scale and zero per group of 64, LRU only its misses, FloE keep·F co-located (gate row, down column)
    FP16 pairs per predicted expert plus one more set per mispredicted one."""
    res = floe_bench(seed=0, steps=5, n_seq=1)
    assert list(res) == list(POLICIES)
    H, F, routed = 64, 192, (4 - 1) * 2  # routed experts per token on the offloaded layers
    fp16_expert, int2_expert = 3 * H * F * 2, 3 * (F * H // 4 + 2 * 2 * F * (H // 64))
    fp16, int2 = res["FP16 on demand"], res["INT2 on demand"]
    assert fp16["bytes"] == routed * fp16_expert == 442_368
    assert fp16["bytes_vs_fp16"] == 1.0 and fp16["speed_vs_fp16"] == 1.0  # the reference against itself
    assert fp16["layer_error"] == 0.0 and fp16["miss"] == 0.0
    assert int2["bytes"] == routed * int2_expert and int2["miss"] == 0.0
    assert int2["speed_vs_fp16"] == pytest.approx(int2["tps"] / fp16["tps"]) and int2["speed_vs_fp16"] > 3  # ≈ 5.7
    assert int2["bytes_vs_fp16"] == pytest.approx(16 / 2.5, rel=1e-6)  # 2 bits + 2·16 bits of meta per 64 weights
    for name, expert in (("LRU FP16 k=2", fp16_expert), ("LRU INT2 k=2", int2_expert)):
        r = res[name]
        assert 0 < r["miss"] < 1 and r["bytes"] == pytest.approx(r["miss"] * routed * expert)  # only misses move
        assert r["bytes_vs_fp16"] == pytest.approx(fp16["bytes"] / r["bytes"])
    for name, n_keep in (("FloE k=0.8", round(0.2 * F)), ("FloE k=0.9", round(0.1 * F))):
        r = res[name]
        assert r["bytes"] == pytest.approx(routed * (1 + r["miss"]) * n_keep * 2 * H * 2)
        assert r["bytes"] < fp16["bytes"] / 5 and r["bytes_vs_fp16"] > 5  # a fifth of FP16 offload or less
        assert 0 < r["layer_error"] < 1
    assert res["FloE k=0.9"]["layer_error"] > res["FloE k=0.8"]["layer_error"]  # sparser is less exact
    # the same weights served by a cache decode exactly as on demand; quantized ones differ
    assert res["LRU FP16 k=2"]["loss"] == fp16["loss"] and res["LRU INT2 k=2"]["loss"] == int2["loss"]
    assert res["LRU FP16 k=2"]["layer_error"] == 0.0 and int2["layer_error"] > 0 and int2["loss"] != fp16["loss"]
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
