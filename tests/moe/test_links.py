"""The links: the simulator's time model (FIFO copies, compute lanes) and the host-to-device copy timer."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab.moe.links import MIXTRAL, SimLink, TimeModel, h2d_bandwidth


def test_sim_link_time_model():
    tm = TimeModel(pcie=1e3, hbm=1e4, latency=0.5)
    link = SimLink(tm)
    z = lambda n: torch.zeros(n, dtype=torch.uint8)
    r1 = link.copy(z(100), z(100), 0, "a")  # 0.5 + 0.1
    r2 = link.copy(z(1000), z(1000), 0, "b")  # FIFO: starts when the first ends
    assert r1 == pytest.approx(0.6) and r2 == pytest.approx(0.6 + 1.5)
    link.compute(0, 10_000, lambda: None)  # overlaps the copies
    assert link.mark() == pytest.approx(1.0)
    link.wait(r2)
    assert link.mark() == pytest.approx(2.1)
    lanes = [(s.lane, s.start, s.end) for s in link.spans]
    assert lanes[2] == ("compute", 0.0, pytest.approx(1.0))


def test_h2d_bandwidth_runs_on_cpu():
    bw = h2d_bandwidth(H=64, n_rows=(1, 8), device="cpu", reps=2)
    assert set(bw) == {"compact", "per_row"} and all(v > 0 for d in bw.values() for v in d.values())
    assert list(bw["compact"]) == [1, 8]


def test_mixtral_equivalent_scales_both_bandwidths():
    tm = TimeModel.mixtral_equivalent(64, 192, pcie=10.0)
    assert tm.scale == 64 * 192 / (MIXTRAL["H"] * MIXTRAL["F"])
    assert tm.transfer(100) == pytest.approx(tm.latency + 100 / (10.0 * tm.scale))
    assert tm.compute(100) == pytest.approx(100 / (936e9 * tm.scale))


def test_sim_link_lanes_and_dependencies():
    """A gather waits for its prediction and occupies the host lane; its copy waits for the gather and for the
    last reader of its destination; every span records what it needed."""
    link = SimLink(TimeModel(pcie=1e3, hbm=1e4, host=2e3, latency=0.0))
    link.compute(0, 10_000, lambda: None, "predict")  # ends at 1.0
    staged, g = link.gather(torch.arange(20, dtype=torch.uint8).reshape(10, 2), torch.tensor([1, 3]), 1, "gather",
                            link.mark())
    assert torch.equal(staged, torch.tensor([[2, 3], [6, 7]], dtype=torch.uint8)) and g == pytest.approx(1.002)
    dst = torch.zeros(2, 2, dtype=torch.uint8)
    r = link.copy(staged, dst, 1, "rows", (g, 1.5))  # the destination is read until 1.5
    assert torch.equal(dst, staged) and r == pytest.approx(1.504)
    assert [(s.lane, s.needs) for s in link.spans] == [("compute", 0.0), ("host", 1.0), ("transfer", 1.5)]
    link.wait(None)
    assert link.mark() == 1.0 and link.elapsed(0.5, 2.0) == 1.5


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_gather_is_index_select_and_restores_torch_threads(threads):
    """The links' host gather with n threads returns host[idx] exactly (rows in idx's order, repeats kept) and leaves
    torch's thread count as it found it, also when the gather fails."""
    from lab.moe.links import row_gather

    g = torch.Generator().manual_seed(threads)
    host = torch.randn(50, 2, 8, generator=g).half()
    idx = torch.tensor([7, 3, 3, 49, 0, 12, 31])
    was = torch.get_num_threads()
    out = row_gather(host, idx, torch.empty(len(idx), 2, 8, dtype=torch.float16), threads)
    assert torch.equal(out, host[idx]) and torch.get_num_threads() == was
    with pytest.raises(IndexError):
        row_gather(host, torch.tensor([50]), torch.empty(1, 2, 8, dtype=torch.float16), threads)
    assert torch.get_num_threads() == was


def test_gather_bandwidth_runs():
    from lab.moe.links import gather_bandwidth

    assert gather_bandwidth(H=64, F=256, reps=2) > 0


def _causal(spans, tol=1e-12):
    """Check a decode's span list: every span starts once its inputs exist; each prediction of layer n starts after
    layer n-1's attention of the same token; each gather after the compute that chose its rows; each row copy after
    its gather."""
    last = {}
    for s in spans:
        assert s.start >= s.needs - tol, s
        if s.lane == "compute" and s.what == "attention":
            last["attn", s.layer] = s.end
        if s.lane == "compute" and s.what.startswith("predict layer"):
            n = int(s.what.rsplit(" ", 1)[1])
            assert s.start >= last["attn", n - 1] - tol, s
            last["chose", n] = s.end
        if s.lane == "compute" and s.what.startswith("mask"):
            last["chose", s.layer] = s.end
        if s.lane == "host":
            assert s.start >= last["chose", s.layer] - tol and s.needs >= last["chose", s.layer] - tol, s
            last["gather", s.layer, s.what.split()[-1]] = s.end
        if s.lane == "transfer" and s.what.startswith("rows"):
            assert s.start >= last["gather", s.layer, s.what.split()[-1]] - tol, s


@pytest.mark.parametrize("policy", ["floe", "mixtral"])
def test_decode_timeline_is_causal(policy):
    from lab.models.zoo import tiny_mixtral
    from lab.moe.offload import OffloadEngine

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=40, d_model=32, n_layers=3, n_heads=4, d_ff=48, n_experts=4).eval()
    seq = torch.randint(40, (1, 8), generator=torch.Generator().manual_seed(3))
    eng = OffloadEngine(model, policy, SimLink(TimeModel.mixtral_equivalent(32, 48)), keep=0.25)
    eng.run(seq)
    spans = eng.link.spans
    assert {s.lane for s in spans} >= {"compute", "transfer"} and any(s.what == "attention" for s in spans)
    _causal(spans)
    if policy == "floe":
        assert any(s.lane == "host" for s in spans) and any(s.what.startswith("mask") for s in spans)
        gathers = [s for s in spans if s.lane == "host"]
        assert all(s.end > s.start for s in gathers)  # the host gather is charged
        # the prefetch still overlaps compute: some gather runs while an expert of the layer before computes
        assert any(g.start < c.end and c.start < g.end for g in gathers for c in spans
                   if c.lane == "compute" and c.what.startswith("expert") and c.layer == g.layer - 1)
    broken = [*spans]  # a prediction moved before its attention is caught
    p = next(i for i, s in enumerate(broken) if s.what.startswith("predict"))
    early = broken[p].start - 1.0  # and its recorded needs with it: only the attention rule can catch it
    broken[p] = type(broken[p])(**{**vars(broken[p]), "start": early, "needs": early})
    with pytest.raises(AssertionError):
        _causal(broken)


def test_sim_link_host_index_is_the_indices_on_the_host():
    link = SimLink(TimeModel())
    idx = torch.tensor([4, 1, 7])
    assert torch.equal(link.host_index(idx, 0.0), idx) and link.host_index(idx, 0.0).device.type == "cpu"


def test_gpu_script_smoke(tmp_path):
    """`scripts/gpu_floe.py --smoke`: every policy through the same loop on CPU (the simulator, a tiny BF16 model)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "gpu_floe.py"), "--smoke", "--tokens", "6",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(out.read_text())
    res = rec["policies"]
    assert len(res) == 10 and all(v["finite"] and v["tps"] > 0 and v["bytes_per_token"] > 0 for v in res.values())
    # Mixtral-offloading sized by FloE's measured device bytes: it fits in them, and the ratios come from this run
    eq, floe = rec["floe_vs_mixtral_offloading_equal_memory"], res["FloE keep 0.2"]
    mo = res["Mixtral-offloading at FloE's memory"]
    assert mo["resident_bytes"] <= floe["resident_bytes"] and eq["device_bytes_ratio"] >= 1
    assert eq["tps_ratio"] == floe["tps"] / mo["tps"] and eq["mixtral_kwargs"] == mo["engine_kwargs"]
    assert res["FP16 on demand"]["max_abs_vs_dense"] < 0.1  # BF16 experts moved whole: the dense model's logits
    # routes recorded per layer for the layer's own tokens only (FloE's and Mixtral-offloading's next-layer
    # predictions call the routers too; recorded, they would not line up with the dense forward's and raise)
    assert rec["cached_route_flips"] == 0 and res["FP16 on demand"]["route_flips_vs_cached"] == 0
    assert all(0 <= v["route_flips_vs_dense"] <= 3 * 6 for v in res.values())
    assert res["FloE keep 0.2"]["kernels_vs_torch_max_abs"] == 0.0  # on CPU both runs take the torch path


GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA with TRITON_INTERPRET unset (make test-gpu)")
class TestCudaLink:
    def test_host_index_waits_for_its_prediction_only(self):
        """The indices reach the host once the prediction that chose them has run, not after the work queued
        behind it (a ~0.5 s spin kernel here); `idx.cpu()` waits for the spin."""
        from lab.moe.links import CudaLink

        link = CudaLink()
        idx = torch.arange(100, device="cuda") * 3
        chose = link.mark()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU cycles queued behind the prediction
        t0 = time.perf_counter()
        on_host = link.host_index(idx, chose)
        fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        idx.cpu()
        slow = time.perf_counter() - t0
        assert torch.equal(on_host, torch.arange(100) * 3) and on_host.is_pinned()
        assert fast < 0.05 < 0.2 < slow, (fast, slow)

    @pytest.mark.parametrize("policy", ["fp16", "lru-int2", "mixtral", "stream", "floe"])
    def test_decode_matches_the_simulator_and_is_causal(self, policy):
        """The same engine over CudaLink (pinned host tier, side-stream copies) and over the simulator on CPU:
        the same logits and bytes; the CUDA timeline is causal (host and event clocks aligned to 1 ms)."""
        from lab.models.zoo import tiny_mixtral
        from lab.moe.links import CudaLink
        from lab.moe.offload import OffloadEngine

        torch.manual_seed(0)
        model = tiny_mixtral(vocab_size=40, d_model=64, n_layers=3, n_heads=4, d_ff=96, n_experts=4).eval()
        seq = torch.randint(40, (1, 8), generator=torch.Generator().manual_seed(3))
        ref, ref_stats = OffloadEngine(model, policy, SimLink(TimeModel()), keep=0.25).run(seq)
        model.cuda()
        eng = OffloadEngine(model, policy, CudaLink(), keep=0.25, device="cuda")
        out, stats = eng.run(seq.cuda())
        tol = 1e-3 if policy in ("fp16", "stream") else 2e-2  # quantized on another device; FloE with the kernels
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)
        assert stats.bytes == ref_stats.bytes and stats.misses == ref_stats.misses
        assert stats.max_memory >= stats.start_memory > 0 and all(t > 0 for t in stats.seconds)
        _causal(sorted(eng.link.spans, key=lambda s: s.start), tol=1e-3)
        assert all(p.device.type == "cuda" for p in model.parameters())  # restored after the run
