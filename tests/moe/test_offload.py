"""The offload engine on the CPU device-tier simulator: outputs, residency (what the model and the device tier
hold), exact byte accounting against hand-written formulas, dtypes, the baselines' policies, plan()."""

import gc
import math

import pytest
import torch

from lab.models import hooks
from lab.models.zoo import tiny_mixtral
from lab.moe import offload_store as st
from lab.moe.blocks import moe_blocks, weights
from lab.moe.links import SimLink, TimeModel
from lab.moe.offload import OffloadEngine
from lab.moe.offload_policies import plan

H, FF, L, E, K = 32, 48, 3, 4, 2
FP16_EXPERT = 3 * H * FF * 2
INT2_MATRIX = FF * H // 4 + 2 * 2 * FF * math.ceil(H / 64)  # codes + fp16 scale and zero per group of 64
MO_MATRIX = FF * H // 4 + 2 * FF * (H // 16) + 2 * 2 * math.ceil(FF * (H // 16) / 128) + 2 * 2  # 8-bit meta + fp16


def make(dtype=torch.float32):
    torch.manual_seed(0)
    return tiny_mixtral(vocab_size=40, d_model=H, n_layers=L, n_heads=4, d_ff=FF, n_experts=E).eval().to(dtype)


@pytest.fixture(scope="module")
def model():
    return make()


@pytest.fixture(scope="module")
def seq():
    return torch.randint(40, (1, 12), generator=torch.Generator().manual_seed(3))


def engine(model, policy, **kw):
    return OffloadEngine(model, policy, SimLink(TimeModel.mixtral_equivalent(H, FF)), **kw)


def run(model, seq, policy, **kw):
    return engine(model, policy, **kw).run(seq)


def dense(model, seq):
    with torch.no_grad():
        return model(input_ids=seq).logits[0]


def test_fp16_policy_matches_the_model_and_counts_bytes_exactly(model, seq):
    logits, s = run(model, seq, "fp16")
    assert torch.allclose(logits, dense(model, seq), atol=2e-3)  # weights travel in fp16
    assert s.bytes == [(L - 1) * K * FP16_EXPERT] * seq.shape[1]  # every routed expert, whole, each token
    assert s.misses == 0 and s.calls == seq.shape[1] * (L - 1) * K


def test_int2_bytes_formula(model, seq):
    _, s = run(model, seq, "int2", group_size=16)
    per_matrix = FF * H // 4 + 2 * 2 * FF * math.ceil(H / 16)
    assert s.bytes == [(L - 1) * K * 3 * per_matrix] * seq.shape[1]


def test_lru_cache_hits_and_misses(model, seq):
    _, full = run(model, seq, "lru-fp16", cache_k=E)
    assert full.misses <= E * (L - 1)  # every expert loads once at most, then stays
    assert full.resident_bytes == E * (L - 1) * FP16_EXPERT  # its slots, preallocated
    _, small = run(model, seq, "lru-fp16", cache_k=1)
    assert small.misses > full.misses and sum(small.bytes) == small.misses * FP16_EXPERT


def test_floe_bytes_and_quality(model, seq):
    logits, s = run(model, seq, "floe", keep=0.25)
    n_keep = round(0.25 * FF)
    prefetched = seq.shape[1] * (L - 1) * K  # layer 0 is resident and predicts layer 1
    assert sum(s.bytes) == (prefetched + s.misses) * n_keep * 2 * H * 2
    assert 0 <= s.misses < s.calls
    logits_all, _ = run(model, seq, "floe", keep=1.0)
    ref = dense(model, seq)
    assert (logits_all - ref).abs().max() < 0.05  # every neuron kept: only INT2 W_up and fp16 rows differ
    assert (logits - ref).abs().max() > (logits_all - ref).abs().max()


def test_all_resident_moves_nothing(model, seq):
    logits, s = run(model, seq, "floe", resident=tuple(range(L)))
    assert sum(s.bytes) == 0 and s.calls == 0
    assert s.resident_bytes == (L - 1) * E * FP16_EXPERT  # layers 1.. held in fp16 by the engine
    assert torch.allclose(logits, dense(model, seq), atol=2e-3)


EXPECTED_DEVICE = {  # policy, kwargs -> (device places, bytes) written out by hand
    ("fp16", ()): ({"stage 0", "stage 1"}, K * FP16_EXPERT),
    ("int2", ()): ({"stage 0", "stage 1"}, K * 3 * INT2_MATRIX),
    ("lru-fp16", (("cache_k", 2),)): ({f"cache {l}.{i}" for l in (1, 2) for i in (0, 1)}, 4 * FP16_EXPERT),
    ("lru-int2", (("cache_k", 0),)): ({"stage 0", "stage 1"}, K * 3 * INT2_MATRIX),
    ("stream", ()): ({"stage"}, E * FP16_EXPERT),
    ("mixtral", (("cache_k", 1),)): ({"cache 1.0", "cache 2.0"} | {f"buffer {i}" for i in range(4)}, 6 * 3 * MO_MATRIX),
    ("floe", (("keep", 0.25),)): ({f"up {l}.{e}" for l in (1, 2) for e in range(E)} | {"rows 0", "rows 1"},
                                  2 * E * INT2_MATRIX + 2 * (K * 12 * 2 * H * 2 + K * 12 * 8)),
}


@pytest.mark.parametrize("case", list(EXPECTED_DEVICE), ids=lambda c: c[0])
def test_residency_and_byte_counts(model, seq, case):
    """Between layers the model holds no offloaded expert (its managed expert tensors are `meta`, no tensor it
    reaches shares their storage) and the device tier holds exactly the policy's places, with the bytes written
    out by hand; after `run` the model has its weights back."""
    policy, kw = case
    eng = engine(model, policy, **dict(kw))
    places, nbytes = EXPECTED_DEVICE[case]
    assert set(eng.dev) == places and eng.stats.resident_bytes == nbytes == st.nbytes(eng.dev)
    managed = [p for l in (1, 2) for p in (moe_blocks(model)[l].experts.gate_up_proj,
                                          moe_blocks(model)[l].experts.down_proj)]
    before = [(p.data_ptr(), p.detach().clone()) for p in managed]
    ptrs = {ptr for ptr, _ in before}
    storages = [p.untyped_storage() for p in managed]
    seen = []

    def check(module, args):
        assert all(p.numel() == 0 for p in managed)  # the model's own tensors: emptied, values in the host tier
        shown = [getattr(moe_blocks(model)[l].experts, n) for l in (1, 2) for n in ("gate_up_proj", "down_proj")]
        assert all(p.device.type == "meta" for p in shown)
        reach = [*model.parameters(), *model.buffers()]
        assert not {t.untyped_storage().data_ptr() for t in reach if t.device.type != "meta"} & ptrs
        assert not {t.untyped_storage().data_ptr() for f in eng.dev.values() for t in f.values()} & ptrs
        # no Python object but this test's list refers to a released storage (on CPU the engine's host copy is that
        # storage, as a tensor; on CUDA a stray handle, e.g. a variable of a suspended frame, keeps it on the device)
        assert [[r for r in gc.get_referrers(s) if r is not storages] for s in storages] == [[]] * len(storages)
        seen.append(True)

    handles = [layer.register_forward_pre_hook(check) for layer in hooks.layers(model)]
    try:
        eng.run(seq[:, :3])
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 3 * L
    assert all(p.device.type == "cpu" and p.data_ptr() == ptr and torch.equal(p, w)
               for p, (ptr, w) in zip(managed, before))


def test_a_view_kept_elsewhere_is_counted_as_held(model, seq):
    """Releasing frees an expert storage only if nothing else holds it: with a view of layer 2's gate_up_proj kept
    (as an analysis's FloE expert keeps W_gate), the engine reports exactly that storage's bytes as held; without, 0.
    The engine's own forms are copies, never views."""
    eng = engine(model, "floe", keep=0.25)
    eng.run(seq[:, :2])
    assert eng.stats.held_bytes == 0
    p = moe_blocks(model)[2].experts.gate_up_proj
    view = p.detach()[1, :FF]
    eng = engine(model, "floe", keep=0.25)
    eng.run(seq[:, :2])
    assert eng.stats.held_bytes == p.untyped_storage().nbytes() == E * 2 * FF * H * 4
    del view
    eng = engine(model, "lru-fp16", cache_k=1)
    eng.run(seq[:, :2])
    assert eng.stats.held_bytes == 0


def test_host_tier_holds_the_offloaded_experts(model):
    eng = engine(model, "floe", keep=0.25)
    assert set(eng.host) == {(l, e) for l in (1, 2) for e in range(E)}
    Wg, _, Wd = weights(moe_blocks(model)[2], 3)
    rows = eng.host[2, 3]["rows"]
    assert torch.equal(rows[:, 0], Wg.half()) and torch.equal(rows[:, 1], Wd.T.half())
    assert eng.expert_bytes() == FF * 2 * H * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_models_decode_in_their_dtype(seq, dtype):
    m = make(dtype)
    ref = dense(m, seq).float()
    tol = 0.05 if dtype == torch.bfloat16 else 5e-3
    for policy in ("fp16", "lru-fp16", "stream"):
        logits, _ = run(m, seq, policy)
        assert logits.dtype == dtype and (logits.float() - ref).abs().max() < tol
    for policy in ("int2", "mixtral", "floe"):
        logits, _ = run(m, seq, policy, **({"keep": 1.0} if policy == "floe" else {}))
        assert logits.dtype == dtype and torch.isfinite(logits).all()
        assert torch.corrcoef(torch.stack([logits.float().flatten(), ref.flatten()]))[0, 1] > 0.9


def test_mixtral_offloading(model, seq):
    """One contiguous block per expert (one copy per miss), ~3 bits per weight; experts already on the device run
    while the misses load; the next layer's guessed experts are loaded during this layer."""
    eng = engine(model, "mixtral", cache_k=2)
    logits, s = eng.run(seq)
    assert st.nbytes(eng.host[1, 0]) == 3 * MO_MATRIX and len(eng.host[1, 0]) == 1
    assert 8 * 3 * MO_MATRIX / (3 * H * FF) == pytest.approx(2 + 8 / 16 + 8 / 16, abs=0.05)
    assert sum(s.bytes) % (3 * MO_MATRIX) == 0 and s.misses <= sum(s.bytes) // (3 * MO_MATRIX)
    spans = eng.link.spans
    transfers = [t for t in spans if t.lane == "transfer"]
    assert any(t.layer == 2 and any(c.what == "predict layer 2" and c.end <= t.start for c in spans) for t in transfers)
    assert any(t.start <= c.start < t.end for c in spans if c.lane == "compute" and c.what.startswith("expert")
               for t in transfers if t.layer == c.layer)  # a resident expert computes while a miss loads
    ref = dense(model, seq)
    assert torch.corrcoef(torch.stack([logits.flatten(), ref.flatten()]))[0, 1] > 0.9


@pytest.mark.parametrize("cache_k", [1, 2])
def test_mixtral_offloading_writes_evicted_experts_back(model, seq, cache_k):
    """Their `ExpertCache._swap`: every expert lives in one tier only — on the device (its cache) or in one host
    storage — and an evicted expert is copied back device->host, so a host storage always holds its own expert's
    bytes, also after several evictions (without the write-back, a re-loaded expert would read another's storage)."""
    eng = engine(model, "mixtral", cache_k=cache_k)
    assert all((l, e) not in eng.host for l in (1, 2) for e in range(E - cache_k, E))  # theirs: not offloaded
    logits, s = eng.run(seq)
    loads = sum(s.bytes) // st.nbytes(eng.host_pool[0])
    assert loads > 2 * E and sum(s.bytes_back) == sum(s.bytes)  # some expert was evicted and loaded again
    for l in (1, 2):
        held = {e: eng.host[l, e] for e in range(E) if (l, e) in eng.host}
        held |= {e: eng.dev[place] for e, place in eng.cache[l].items()}
        assert sorted(held) == list(range(E)) and len(eng.cache[l]) == cache_k
        assert not set(eng.cache[l]) & {e for e in range(E) if (l, e) in eng.host}  # one tier each
        for e, form in held.items():
            assert torch.equal(form["mo"], st.mo_form(*weights(moe_blocks(model)[l], e))["mo"]), (l, e)
    fresh, _ = engine(model, "mixtral", cache_k=cache_k).run(seq)
    assert torch.equal(logits, fresh)  # the memoised forms other engines share were never written into
    ablated = engine(model, "mixtral", cache_k=cache_k, write_back=False)  # host copies kept: same experts, fewer bytes
    same, s2 = ablated.run(seq)
    assert torch.equal(same, logits) and sum(s2.bytes_back) == 0 and s2.bytes == s.bytes
    assert all((l, e) in ablated.host for l in (1, 2) for e in range(E))
    assert sum(s2.seconds) < sum(s.seconds)  # the write-backs share the FIFO link with the loads


def test_mo_form_decodes_close_to_the_weights(model):
    W = weights(moe_blocks(model)[1], 0)
    err = lambda form, gs=64: max((a - b).abs().mean().item() for a, b in
                                  zip(st.decode(form, FF, H, torch.float32, gs), (W[0], W[1], W[2].T)))
    assert err(st.mo_form(*W)) < err(st.int2_form(*W, 64)) < 0.5 * W[0].abs().mean().item()


def test_mo_meta_decodes_to_fp16_one_matrix_at_a_time(model):
    """Mixtral-offloading's scale and zero come back from their 8-bit codes in FP16 (HQQ decodes quantized meta in
    its compute dtype), when each matrix is indexed, within FP16 rounding of the scale and zero HQQ found; the codes
    are views into the expert's block (no copy)."""
    from lab.compress.quant import quantize

    W = weights(moe_blocks(model)[1], 2)
    form = st.mo_form(*W)
    parts, g = st.int2_parts(form, FF, H)
    assert g == st.MO_GROUP and len(parts) == 3
    for m, M in enumerate((W[0], W[1], W[2].T)):
        q, s, z = parts[m]
        assert q.untyped_storage().data_ptr() == form["mo"].untyped_storage().data_ptr()
        assert s.dtype == z.dtype == torch.float16 and s.shape == z.shape == (FF, math.ceil(H / st.MO_GROUP))
        ref = quantize(M.detach().float(), 2, st.MO_GROUP)  # before its meta was quantized to 8 bits
        for got, want in ((s, ref.scale), (z, ref.zero)):  # 8-bit meta: within half a step of its range
            step = (want.max() - want.min()).item() / 255
            assert (got.float() - want).abs().max().item() <= 0.5 * step + 2e-3 * want.abs().max().item()


@pytest.mark.parametrize("kind", ["int2", "mo"])
def test_quantized_experts_are_one_block_moved_by_one_copy(model, seq, kind):
    """An `int2` or `mo` expert is one contiguous uint8 tensor (one copy, one latency), whose pieces decode to what
    the quantizer gives each matrix separately (int2: exactly)."""
    W = weights(moe_blocks(model)[1], 3)
    form = st.int2_form(*W, 64) if kind == "int2" else st.mo_form(*W)
    (block,) = form.values()
    assert block.dtype == torch.uint8 and block.is_contiguous() and block.dim() == 1
    if kind == "int2":
        assert st.nbytes(form) == sum(st.nbytes(st.int2_matrix(M, 64)) for M in (W[0], W[1], W[2].T))
        for got, M in zip(st.decode(form, FF, H, torch.float32, 64), (W[0], W[1], W[2].T)):
            q, s, z = st.int2_matrix(M, 64)
            assert torch.equal(got, st.dequant(q, s, z, 64, H, torch.float32))
    eng = engine(model, "int2" if kind == "int2" else "mixtral")
    _, stats = eng.run(seq)
    copies = [s for s in eng.link.spans if s.lane == "transfer" and s.what.startswith("expert")]
    assert copies and sum(stats.bytes) == len(copies) * st.nbytes(block)  # every copy moves one whole block
    back = [s for s in eng.link.spans if s.lane == "transfer" and not s.what.startswith("expert")]
    if kind == "int2":
        assert len(copies) == seq.shape[1] * K * (L - 1)  # one copy per routed expert of an offloaded layer
        assert not back and sum(stats.bytes_back) == 0
    else:  # every load evicts one expert, written back whole
        assert len(back) == len(copies) and sum(stats.bytes_back) == sum(stats.bytes)


def test_bad_policy(model):
    with pytest.raises(ValueError, match="policy"):
        OffloadEngine(model, "zero3", SimLink(TimeModel()))
    with pytest.raises(ValueError, match="mixtral"):
        OffloadEngine(model, "mixtral", SimLink(TimeModel()), cache_k=0)


def test_plan_spends_the_budget_as_the_engine_counts_it(model):
    for budget in (10_000, 60_000, 200_000, 400_000):
        p = plan(model, budget, keep=0.25, group_size=16)
        for policy, kw in p.items():
            if kw is None:
                continue
            eng = OffloadEngine(model, policy, SimLink(TimeModel()), group_size=16, **kw)
            assert eng.stats.resident_bytes <= budget
            if policy != "floe" and 0 < kw["cache_k"] < E:  # one more expert per layer would not fit
                more = OffloadEngine(model, policy, SimLink(TimeModel()), group_size=16,
                                     **(kw | {"cache_k": kw["cache_k"] + 1}))
                assert more.stats.resident_bytes > budget
    assert plan(model, 10_000, keep=0.25)["floe"] is None  # INT2 W_up of every offloaded expert does not fit
    big = plan(model, 10**9, keep=0.25)
    assert big["floe"]["resident"] == tuple(range(L)) and big["lru-fp16"]["cache_k"] == E


def test_lru_without_a_cache_is_on_demand(model, seq):
    _, none = run(model, seq, "lru-int2", cache_k=0)
    _, demand = run(model, seq, "int2")
    assert none.bytes == demand.bytes and none.resident_bytes == demand.resident_bytes == K * 3 * INT2_MATRIX


@pytest.mark.parametrize("K,gs", [(64, 16), (70, 16), (64, 64)])
def test_dequant_reads_the_quantizer_packing(K, gs):
    from lab.compress.quant import quantize

    W = torch.randn(37, K, generator=torch.Generator().manual_seed(K + gs))
    q = quantize(W, 2, gs)
    got = st.dequant(q.packed, q.scale, q.zero, gs, K, torch.float32)
    torch.testing.assert_close(got, q.dequantize(), rtol=0, atol=1e-6)
    assert st.dequant(q.packed, q.scale, q.zero, gs, K, torch.bfloat16).dtype == torch.bfloat16


def test_floe_reserves_its_staging_before_the_decode(model, seq):
    """FloE's engine asks its link for the staging room of its host gathers when it is built (on CUDA the pinned
    ring is pinned then, not inside a timed token): room for ceil(n_keep / chunks) rows of the host rows' shape and
    dtype, exactly the largest gather the decode makes."""

    class Recording(SimLink):
        def __init__(self):
            super().__init__(TimeModel())
            self.reserved, self.gathered = [], []

        def reserve(self, rows, shape, dtype):
            self.reserved.append((rows, shape, dtype))

        def gather(self, host, idx, *a):
            self.gathered.append((len(idx), tuple(host.shape[1:]), host.dtype))
            return super().gather(host, idx, *a)

    link = Recording()
    eng = OffloadEngine(model, "floe", link, keep=0.3, chunks=3)
    assert len(link.reserved) == 1 and not link.gathered
    rows, shape, dtype = link.reserved[0]
    assert rows == -(-eng.n_keep // 3) and shape == (2, H)
    eng.run(seq)
    assert link.gathered and all(s == shape and d == dtype for _, s, d in link.gathered)
    assert max(n for n, *_ in link.gathered) == rows
