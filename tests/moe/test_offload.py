"""The offload engine on the CPU device-tier simulator: outputs, exact byte accounting, the time model."""

import math

import pytest
import torch

from lab.models.zoo import tiny_mixtral
from lab.moe.links import SimLink, TimeModel
from lab.moe.offload import OffloadEngine

H, FF, L, E, K = 32, 48, 3, 4, 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_mixtral(vocab_size=40, d_model=H, n_layers=L, n_heads=4, d_ff=FF, n_experts=E).eval()


@pytest.fixture(scope="module")
def seq():
    return torch.randint(40, (1, 12), generator=torch.Generator().manual_seed(3))


def run(model, seq, policy, **kw):
    return OffloadEngine(model, policy, SimLink(TimeModel.mixtral_equivalent(H, FF)), **kw).run(seq)


def test_fp16_policy_matches_the_model_and_counts_bytes_exactly(model, seq):
    logits, st = run(model, seq, "fp16")
    with torch.no_grad():
        ref = model(input_ids=seq).logits[0]
    assert torch.allclose(logits, ref, atol=2e-3)  # weights travel in fp16
    assert st.bytes == [(L - 1) * K * 3 * H * FF * 2] * seq.shape[1]  # every routed expert, whole, each token
    assert st.misses == 0 and st.calls == seq.shape[1] * (L - 1) * K


def test_int2_bytes_formula(model, seq):
    _, st = run(model, seq, "int2", group_size=16)
    per_matrix = FF * H // 4 + 2 * 2 * FF * math.ceil(H / 16)  # codes + fp16 scale and zero per group
    assert st.bytes == [(L - 1) * K * 3 * per_matrix] * seq.shape[1]


def test_lru_cache_hits_and_misses(model, seq):
    _, full = run(model, seq, "lru-fp16", cache_k=E)
    assert full.misses <= E * (L - 1)  # every expert loads once at most, then stays
    assert full.resident_bytes == E * (L - 1) * 3 * H * FF * 2
    _, small = run(model, seq, "lru-fp16", cache_k=1)
    assert small.misses > full.misses and sum(small.bytes) == small.misses * 3 * H * FF * 2


def test_floe_bytes_and_quality(model, seq):
    logits, st = run(model, seq, "floe", keep=0.25)
    n_keep = round(0.25 * FF)
    prefetched = seq.shape[1] * (L - 1) * K  # layer 0 is resident and predicts layer 1
    assert sum(st.bytes) == (prefetched + st.misses) * n_keep * 2 * H * 2
    assert 0 <= st.misses < st.calls
    logits_all, _ = run(model, seq, "floe", keep=1.0)
    with torch.no_grad():
        ref = model(input_ids=seq).logits[0]
    assert (logits_all - ref).abs().max() < 0.05  # every neuron kept: only INT2 W_up and fp16 rows differ
    assert (logits - ref).abs().max() > (logits_all - ref).abs().max()


def test_all_resident_moves_nothing(model, seq):
    _, st = run(model, seq, "floe", resident=tuple(range(L)))
    assert sum(st.bytes) == 0 and st.calls == 0


def test_prefetch_overlaps_compute(model, seq):
    """FloE's copies for layer i+1 start before layer i's compute ends (the point of the prefetch)."""
    eng = OffloadEngine(model, "floe", SimLink(TimeModel.mixtral_equivalent(H, FF)), keep=0.25)
    eng.run(seq[:, :2])
    spans = eng.link.spans
    first_compute_l0 = next(s for s in spans if s.lane == "compute" and s.layer == 0)
    first_copy_l1 = next(s for s in spans if s.lane == "transfer" and s.layer == 1)
    assert first_copy_l1.start <= first_compute_l0.start


def test_bad_policy(model):
    with pytest.raises(ValueError, match="policy"):
        OffloadEngine(model, "zero3", SimLink(TimeModel()))


def test_plan_spends_the_budget_as_the_engine_counts_it(model, seq):
    from lab.moe.offload import plan

    for budget in (10_000, 60_000, 200_000, 400_000):
        p = plan(model, budget, keep=0.25, group_size=16)
        for policy, kw in p.items():
            if kw is None:
                continue
            eng = OffloadEngine(model, policy, SimLink(TimeModel()), group_size=16, **kw)
            assert eng.stats.resident_bytes <= budget
            if policy.startswith("lru") and kw["cache_k"] < E:  # one more expert per layer would not fit
                more = OffloadEngine(model, policy, SimLink(TimeModel()), group_size=16, cache_k=kw["cache_k"] + 1)
                assert more.stats.resident_bytes > budget
    assert plan(model, 10_000, keep=0.25)["floe"] is None  # INT2 W_up of every offloaded expert does not fit
    big = plan(model, 10**9, keep=0.25)
    assert big["floe"]["resident"] == tuple(range(L)) and big["lru-fp16"]["cache_k"] == E


def test_lru_without_a_cache_is_on_demand(model, seq):
    _, none = run(model, seq, "lru-int2", cache_k=0)
    _, demand = run(model, seq, "int2")
    assert none.bytes == demand.bytes and none.resident_bytes == 0
