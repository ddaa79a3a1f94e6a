"""`python -m lab bench floe`: the ratios it prints are the engine's, bad input is one sentence; and the toy's
measurements notebook 05 shows, against references."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lab.data.chains import PermutationChains
from lab.moe import blocks
from lab.moe import floe as fl
from lab.moe import floe_bench as fb
from lab.moe import floe_decode as fd
from lab.moe import floe_predictors as fpred
from lab.moe.floe_bench import POLICIES, floe_bench, report
from lab.moe.links import SimLink, TimeModel
from lab.moe.offload import OffloadEngine

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
    assert 0 <= fp16["layer_error"] < 1e-5 and fp16["miss"] == 0.0  # weights rounded to fp16 only
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
    assert res["LRU FP16 k=2"]["layer_error"] == fp16["layer_error"] and int2["layer_error"] > 1e3 * fp16["layer_error"]
    assert int2["loss"] != fp16["loss"]
    mo, stream = res["Mixtral-offloading k=2"], res["DeepSpeed streaming"]
    assert 0 < mo["miss"] < 1 and 0 < mo["layer_error"] < int2["layer_error"]  # group 16 is finer than 64
    assert stream["bytes"] == (4 - 1) * 8 * fp16_expert and stream["bytes_vs_fp16"] == 2 / 8  # every expert
    assert stream["loss"] == pytest.approx(fp16["loss"], abs=1e-6) and stream["miss"] == 0.0
    text = report(res, "cpu")
    assert "modelled" in text and all(name in text for name in POLICIES)


def test_bench_bad_input_is_one_sentence():
    r = subprocess.run([sys.executable, "-m", "lab", "bench", "floe", "--pcie", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--pcie" in r.stderr


# ------------------------------------------------------------------ the notebook's measurements (lab.moe.floe_bench)

def test_toy_data_draws_calibration_then_evaluation():
    task = PermutationChains(length=8)
    cal, ev = fb.toy_data(task, 3, seed=2)
    g = torch.Generator().manual_seed(1002)
    assert torch.equal(cal, task.batch(3, g)["input_ids"])
    ref = task.batch(3, g)
    assert set(ev) == {"input_ids", "labels"} and all(torch.equal(ev[key], ref[key]) for key in ref)
    assert torch.equal(fb.decode_seqs(task, 2, seed=2), task.batch(2, torch.Generator().manual_seed(5002))["input_ids"])


def test_expert_activations_by_token(model, xs):
    acts = fb.expert_activations(model, xs, (1, 2), (0, 3))
    assert not any(t.requires_grad for a in acts.values() for t in a.values())  # measurements: no autograd graph
    assert list(acts) == [(1, 0), (1, 3), (2, 0), (2, 3)]
    mlp = blocks.moe_blocks(model)[2]
    Wg, Wu, _ = blocks.weights(mlp, 3)
    _, _, idx = blocks.route(mlp, xs[2])
    routed = [t for t in range(len(xs[2])) if 3 in idx[t].tolist()]  # the tokens sent to expert 3, one by one
    assert acts[2, 3]["up"].shape == (len(routed), 48)
    for row, t in enumerate(routed):
        x = xs[2][t]
        assert torch.allclose(acts[2, 3]["gate"][row], F.silu(Wg @ x), atol=1e-6)
        assert torch.allclose(acts[2, 3]["down"][row], F.silu(Wg @ x) * (Wu @ x), atol=1e-6)


def test_sparsity_errors(model, xs):
    """Nothing dropped at k = 0 (the threshold is the smallest |a|): zero error; the magnitude mask orders the
    activations (down least), a random mask of the same size loses that order and costs more."""
    zero = fb.sparsity_errors(model, xs, xs, (0.0,))
    assert all(v == [0.0] for v in zero.values())
    err = fb.sparsity_errors(model, xs, xs, (0.5, 0.8))
    assert all(len(v) == 2 and v[0] < v[1] for v in err.values())
    assert err["down"][1] < 0.7 * err["up"][1]
    rnd = fb.sparsity_errors(model, xs, xs, (0.8,), control="random_mask")
    assert all(rnd[on][0] > 2 * err[on][1] for on in fl.MATRICES)
    swapped = fb.sparsity_errors(model, xs, xs, (0.8,), control="gate_for_up")
    assert swapped["up"][0] == pytest.approx(err["gate"][1]) and swapped["gate"][0] == pytest.approx(err["up"][1])


def test_quant_sensitivity(model, xs):
    ids = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "labels": ids}
    base = blocks.eval_loss(model, batch)
    qs = fb.quant_sensitivity(model, batch, xs, (8, 1), base, group_size=16)
    assert list(qs) == [(m, b) for b in (8, 1) for m in fl.MATRICES]
    assert all(qs[m, 8]["err"] < 1e-3 and abs(qs[m, 8]["loss"]) < 1e-3 for m in fl.MATRICES)  # 8 bits: almost exact
    assert all(qs[m, 1]["err"] > 100 * qs[m, 8]["err"] for m in fl.MATRICES)


def test_variant_quality_closed_forms(model, xs):
    """The dense experts cost nothing; zero experts give relative error exactly 1 (||0 − y||² / ||y||²)."""
    ids = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "labels": ids}
    base = blocks.eval_loss(model, batch)
    q = fb.variant_quality(model, batch, xs, {"dense": blocks.dense_fn(model),
                                              "zero": lambda l, e, x: torch.zeros_like(x)}, base, (1, 2))
    assert q["dense"]["err"] == 0.0 and q["dense"]["loss_pct"] == pytest.approx(0.0, abs=1e-4)
    assert q["zero"]["err"] == pytest.approx(1.0) and q["zero"]["loss_pct"] != pytest.approx(0.0)
    t_up = fl.thresholds(model, xs, 0.75, "up")
    variants = fb.expert_variants(model, xs, t_up, 0.75, fl.floe_experts(model, t_up, group_size=16), group_size=16)
    assert list(variants) == ["FloE (INT2 up + sparse)", "up sparse only", "CATS (gate sparse)", "random mask",
                              "HQQ INT2 expert", "HQQ INT3 expert"]
    errs = {b: fb.variant_quality(model, batch, xs, {b: variants[f"HQQ INT{b} expert"]}, base, (1, 2))[b]["err"]
            for b in (2, 3)}
    assert 0 < errs[3] < errs[2]  # one more bit, a smaller error: the two rows are not the same quantizer
    assert torch.equal(variants["up sparse only"](1, 2, xs[1]), fl.sparse_fn(model, t_up, "up")(1, 2, xs[1]))


def test_trained_overlap_without_training_is_the_next_router(model, xs):
    """With no epoch the predictor is the next layer's router (its initialisation): router reuse's overlap."""
    got = fb.trained_overlap(model, xs, xs, 0.25, epochs=0, seed=0)
    assert got == [s["inter"] for s in fpred.predictor_stats(model, xs, 0.25)]
    trained = fb.trained_overlap(model, xs, xs, 0.25, epochs=20, lr=1e-2, batch=16)
    assert len(trained) == 2 and all(0 <= v <= 1 for v in trained)


def test_kernel_errors_are_small(model, xs):
    ex = fl.floe_experts(model, fl.thresholds(model, xs, 0.8, "up"), group_size=16)[1, 0]
    kernel_err, up_err = fb.kernel_errors(ex, xs[1][0])
    assert 0 <= kernel_err < 1e-4 and 0 <= up_err < 1e-4


def test_mixtral_arithmetic_and_equal_memory():
    per_call = fb.mixtral_bytes_per_call()
    assert per_call["FP16 expert"] == 3 * 4096 * 14336 * 2 == pytest.approx(352.3e6, rel=1e-3)  # "352 MB"
    assert per_call["HQQ INT2 expert (g64)"] == per_call["FP16 expert"] * 2.5 / 16
    assert per_call["ZeRO-3 MoE block (/2)"] == 4 * per_call["FP16 expert"]
    assert per_call["FloE rows, k = 0.8"] == pytest.approx(0.2 * 2 / 3 * per_call["FP16 expert"])
    # 2-bit codes + an 8-bit scale and an 8-bit zero per 16 weights + two FP16 per 128 scales: 3 + 32/2048 bits
    bits = 2 + 8 / 16 + 8 / 16 + 2 * 16 / (128 * 16)
    assert per_call["Mixtral-offloading expert (g16)"] == pytest.approx(per_call["FP16 expert"] * bits / 16, rel=1e-5)
    # FloE holds 600 B; a token moves 6 INT2 experts of 50 B over 3 layers: 600 / (3 · 50) = 4 experts per layer
    assert fd.equal_memory_k(600, 300, 3) == 4 and fd.equal_memory_k(1, 300, 3) == 1


def test_engine_policies_names():
    pols = fd.engine_policies(1 - 0.8)
    assert list(pols) == ["FP16 on demand", "INT2 on demand", "LRU FP16, k=2", "LRU INT2, k=2",
                          "Mixtral-offloading, k=2", "DeepSpeed streaming", "FloE keep 0.2", "FloE keep 0.1"]
    assert pols["FloE keep 0.2"] == ("floe", {"keep": 1 - 0.8})
    whole = fd.engine_policies(1 - 0.8, whole_experts=True)  # FloE's control: every row moved, names unchanged
    assert list(whole) == list(pols) and whole["FloE keep 0.1"] == whole["FloE keep 0.2"] == ("floe", {"keep": 1.0})
    assert all(whole[n] == pols[n] for n in pols if not n.startswith("FloE"))


def test_decoder_against_the_engine(model):
    """One policy decoded by hand with the engine: loss, bytes/token, tokens/s (first token left out), misses."""
    seqs = torch.randint(40, (2, 10), generator=torch.Generator().manual_seed(6))
    dec = fd.Decoder(model, seqs, pcie_gbps=12.0)
    got = dec.decode("floe", {"keep": 0.25})
    nll, nbytes, secs, miss, calls = [], [], [], 0, 0
    for s in seqs:
        logits, st = OffloadEngine(model, "floe", SimLink(TimeModel.mixtral_equivalent(32, 48, pcie=12e9)),
                                   keep=0.25).run(s[None])
        nll.append(F.cross_entropy(logits[:-1], s[1:]).item())
        nbytes, secs, miss, calls = nbytes + st.bytes, secs + st.seconds[1:], miss + st.misses, calls + st.calls
    assert got["loss"] == pytest.approx(sum(nll) / 2) and got["bytes"] == pytest.approx(sum(nbytes) / len(nbytes))
    assert got["tps"] == pytest.approx(len(secs) / sum(secs)) and got["miss"] == pytest.approx(miss / calls)
    assert got["spans"] and min(s.start for s in got["spans"]) > 0  # the last token only
    with torch.no_grad():
        dense = [F.cross_entropy(model(input_ids=s[None]).logits[0, :-1], s[1:]).item() for s in seqs]
    assert dec.dense_loss() == pytest.approx(sum(dense) / 2)
    slow = dec.decode("fp16", {}, gbps=1.0, n=1)
    assert slow["tps"] < dec.decode("fp16", {}, n=1)["tps"]
    rnd = fd.Decoder(model, seqs, predictor="random").decode("floe", {"keep": 0.25})
    assert rnd["miss"] > got["miss"]


def test_decoder_budgets(model):
    """Under a budget too small for FloE's INT2 W_up only FP16 on demand and the (empty) LRU caches run."""
    dec = fd.Decoder(model, torch.randint(40, (1, 6), generator=torch.Generator().manual_seed(7)))
    small = dec.simulate(25.0, 0.25, 10)
    assert "floe" not in small and set(small) == {"FP16 on demand", "LRU INT2"}  # INT2 staging slots fit 10 kB
    assert "floe" in dec.simulate(25.0, 0.25, 1e6)
    by = dec.tps_by_budget((10, 1e6), 0.25)
    assert by["floe"][0] is None and by["floe"][1] > 0 and len(by["LRU FP16"]) == 2 and by["Mixtral-offloading"][1] > 0
    bw = dec.tps_by_bandwidth({"fp16": ("fp16", {})}, (1.0, 100.0))
    assert bw["fp16"][0] < bw["fp16"][1]


def test_mixtral_at_equal_memory(model):
    floe_bytes, kw = fd.mixtral_at_equal_memory(model, 0.25)
    eng = lambda k: OffloadEngine(model, "mixtral", SimLink(TimeModel()), cache_k=k)
    assert kw is not None and eng(kw["cache_k"]).stats.resident_bytes <= floe_bytes
    assert kw["cache_k"] == 4 or eng(kw["cache_k"] + 1).stats.resident_bytes > floe_bytes


def test_sweeps_are_modelled_on_cuda_too(model):
    """A GPU's PCIe bandwidth cannot be set: on CUDA the bandwidth and budget sweeps run over the simulator on a CPU
    copy of the model (on CPU here: the copy is made and used without touching CUDA), with the CPU decoder's results."""
    seqs = torch.randint(40, (1, 6), generator=torch.Generator().manual_seed(7))
    cpu, gpu = fd.Decoder(model, seqs), fd.Decoder(model, seqs, device="cuda")
    assert cpu.modelled is cpu
    sim = gpu.modelled
    assert sim.device == "cpu" and sim.model is not model and sim is gpu.modelled
    pols = {"fp16": ("fp16", {}), "floe": ("floe", {"keep": 0.25})}
    assert gpu.tps_by_bandwidth(pols, (1.0, 100.0)) == cpu.tps_by_bandwidth(pols, (1.0, 100.0))
    assert {n: r["tps"] for n, r in gpu.simulate(25.0, 0.25, 1e6).items()} == \
        {n: r["tps"] for n, r in cpu.simulate(25.0, 0.25, 1e6).items()}


def test_host_gather_sweep_moves_floe_only(model):
    """The host row-gather bandwidth sets FloE's modelled tokens/s (slower gather, fewer tokens/s; at 25 GB/s the
    simulator's default) and nothing else's: FP16 on demand gathers nothing on the host."""
    seqs = torch.randint(40, (1, 6), generator=torch.Generator().manual_seed(7))
    dec = fd.Decoder(model, seqs)
    pols = {"fp16": ("fp16", {}), "floe": ("floe", {"keep": 0.25})}
    by = dec.tps_by_host(pols, (0.5, 5.0, 25.0))
    assert by["floe"][0] < by["floe"][1] < by["floe"][2] == dec.decode("floe", {"keep": 0.25}, n=1)["tps"]
    assert by["fp16"] == [dec.decode("fp16", {}, n=1)["tps"]] * 3
