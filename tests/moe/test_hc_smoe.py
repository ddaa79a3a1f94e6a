"""HC-SMoE against independent references: a naive agglomeration, naive routing loops, hand-merged experts,
brute-force pruning, `from_pretrained` round trips, and the checkpoint path through the runner."""

import json
from itertools import combinations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.core.params import ParamError
from lab.models.zoo import tiny_qwen2_moe
from lab.moe import blocks
from lab.moe import hc_merge as hm
from lab.moe import hc_smoe as hc


def naive_agglomerate(X: np.ndarray, r: int, link: str = "average") -> np.ndarray:
    """Agglomerative clustering by its definition: merge the two closest clusters until r remain."""
    D = np.linalg.norm(X[:, None] - X[None], axis=-1)
    agg = {"average": np.mean, "single": np.min, "complete": np.max}[link]
    clusters = [[i] for i in range(len(X))]
    while len(clusters) > r:
        pairs = [(agg(D[np.ix_(a, b)]), i, j) for (i, a), (j, b) in combinations(enumerate(clusters), 2)]
        _, i, j = min(pairs)
        clusters = [c for k, c in enumerate(clusters) if k not in (i, j)] + [clusters[i] + clusters[j]]
    labels = np.empty(len(X), dtype=int)
    for c, members in enumerate(clusters):
        labels[members] = c
    return hc.canonical(labels)


@pytest.mark.parametrize("link", ["average", "single", "complete"])
def test_scipy_clustering_matches_naive_agglomeration(link):
    X = torch.randn(9, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for r in range(1, 10):
        assert np.array_equal(hc.cluster(X, r, link=link), naive_agglomerate(X.numpy(), r, link)), (link, r)


def test_hierarchical_is_what_runs_not_kmeans(monkeypatch):
    """method="hierarchical" never touches k-means (the official scripts' misspelling silently ran k-means++);
    k-means is reached only when asked for."""
    import sklearn.cluster

    def boom(*a, **k):
        raise AssertionError("k-means ran")

    X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(sklearn.cluster, "KMeans", boom)
    assert len(set(hc.cluster(X, 3).tolist())) == 3
    with pytest.raises(AssertionError, match="k-means ran"):
        hc.cluster(X, 3, method="kmeans")
    with pytest.raises(ValueError):
        hc.cluster(X, 3, method="hirarchical")  # the typo is an error here, not a silent fallthrough
    with pytest.raises(ParamError, match="r=9 experts per layer: it must be between 1 and the model's 8 experts"):
        hc.cluster(X, 9)  # `-p r 9`: one sentence from the runner, no report


def test_average_linkage_differs_from_kmeans_on_a_chain():
    """Two tight blobs + a chain of points: average linkage and k-means give different partitions."""
    X = torch.tensor([[0.0], [0.1], [0.2], [3.0], [4.0], [5.0], [6.0], [6.1]])
    hier = hc.cluster(X, 2)
    km = hc.cluster(X, 2, method="kmeans_fixed", init=[0, 7])
    assert np.array_equal(hier, naive_agglomerate(X.numpy(), 2)) and not np.array_equal(hier, km)


def test_random_and_kmeans_groups_have_r_clusters():
    X = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for method in ("random", "kmeans", "kmeans_fixed"):
        labels = hc.cluster(X, 4, method=method, seed=2)
        assert sorted(set(labels.tolist())) == [0, 1, 2, 3]
    assert sorted(np.bincount(hc.cluster(X, 4, method="random", seed=5)).tolist()) == [2, 2, 2, 2]


def test_m_smoe_dominant_groups_by_hand():
    """M-SMoE: the r most used experts lead; each other expert joins the dominant one of largest router-logit cosine
    (a naive loop over Python floats here), whatever the vectors' lengths; r out of range is a ParamError."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 10, generator=g)
    feats[4] = 7.0 * feats[1] + 0.01 * torch.randn(10, generator=g)  # 4 points where 1 does, far longer
    f = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    labels = hc.dominant_groups(feats, f, 3)
    dom = [0, 2, 4]  # the three most used
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))
    want = {d: d for d in dom}
    for e in (1, 3, 5):
        want[e] = max(dom, key=lambda d: cos(feats[e], feats[d]))
    assert want[1] == 4
    assert np.array_equal(labels, hc.canonical([want[e] for e in range(6)]))
    assert len(set(labels[dom])) == 3  # the dominant experts stay apart
    with pytest.raises(ParamError, match="between 1 and"):
        hc.dominant_groups(feats, f, 7)


def test_usage_frequencies_by_a_token_loop(model, xs):
    mlp, x = blocks.moe_blocks(model)[0], xs[0]
    counts = torch.zeros(4)
    for t in x:
        p = torch.softmax(mlp.gate.weight @ t, 0)
        for e in p.topk(2).indices:
            counts[e] += 1
    assert torch.allclose(hc.usage_frequencies(mlp, x).float(), counts / counts.sum())


def test_output_features_are_means_over_all_tokens(model, xs):
    mlp, x = blocks.moe_blocks(model)[1], xs[1]
    o = hc.features(mlp, x, "output")
    for e in range(4):
        Wg, Wu, Wd = blocks.weights(mlp, e)
        ref = torch.stack([(F.silu(Wg @ t) * (Wu @ t)) @ Wd.T for t in x]).mean(0)
        assert torch.allclose(o[e], ref, atol=1e-6)
    assert hc.features(mlp, x, "router").shape == (4, len(x))
    assert hc.features(mlp, x, "weight").shape == (4, 3 * 48 * 32)


def test_merge_cluster_is_frequency_weighted():
    g = torch.Generator().manual_seed(0)
    ws = [tuple(torch.randn(6, 4, generator=g) for _ in range(3)) for _ in range(3)]
    f = torch.tensor([0.1, 0.3, 0.0])
    out = hc.merge_cluster(ws, f)
    for i in range(3):
        assert torch.allclose(out[i], (0.1 * ws[0][i] + 0.3 * ws[1][i]) / 0.4, atol=1e-6)
    assert torch.allclose(hc.merge_cluster(ws, torch.zeros(3))[0], sum(w[0] for w in ws) / 3, atol=1e-6)


def hand_merged(mlp, labels, f):
    """{cluster: (W_gate, W_up, W_down)} merged by a plain loop."""
    out = {}
    for c in set(labels):
        m = [e for e in range(len(labels)) if labels[e] == c]
        tot = sum(f[e].item() for e in m)
        out[c] = tuple(sum(f[e].item() / tot * blocks.weights(mlp, e)[i] for e in m) for i in range(3))
    return out


def test_aliased_block_is_the_official_merged_layer(model, xs):
    """Router unchanged, each top-k pick j uses the merged expert of its cluster, gates of picks in one cluster add."""
    mlps = blocks.moe_blocks(model)
    labels = [np.array([0, 1, 0, 1]), np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1])]
    freqs = [hc.usage_frequencies(m, x) for m, x in zip(mlps, xs)]
    merged = hc.aliased(model, labels, freqs)
    for l, (mlp, x) in enumerate(zip(mlps, xs)):
        W = hand_merged(mlp, labels[l].tolist(), freqs[l])
        ref = torch.zeros_like(x)
        for n, t in enumerate(x):
            p = torch.softmax(mlp.gate.weight @ t, 0)
            top = p.topk(2)
            for g, e in zip(top.values / top.values.sum(), top.indices):
                ref[n] += g * blocks.expert(t[None], *W[labels[l][e]])[0]
        with torch.no_grad():
            got = blocks.moe_blocks(merged)[l](x[None])[0]
        assert torch.allclose(got, ref, atol=1e-5), l


def test_smaller_model_block_and_round_trip(model, xs, ids, tmp_path):
    """r experts and merged router rows: the block equals the hand computation; save -> from_pretrained gives
    identical logits, fewer parameters, a smaller file, num_local_experts = r."""
    from transformers import AutoModelForCausalLM

    mlps = blocks.moe_blocks(model)
    labels = [np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1]), np.array([0, 1, 1, 0])]
    freqs = [hc.usage_frequencies(m, x) for m, x in zip(mlps, xs)]
    small = hc.smaller(model, labels, freqs)
    assert small.config.num_local_experts == 2 and small.config.num_experts_per_tok == 2
    for l, (mlp, x) in enumerate(zip(mlps, xs)):
        W, f = hand_merged(mlp, labels[l].tolist(), freqs[l]), freqs[l]
        rows = torch.stack([sum(f[e] * mlp.gate.weight[e] for e in range(4) if labels[l][e] == c) /
                            sum(f[e] for e in range(4) if labels[l][e] == c) for c in range(2)]).float()
        ref = torch.zeros_like(x)
        for n, t in enumerate(x):
            p = torch.softmax(rows @ t, 0)  # both clusters picked (top-2 of 2), renormalised
            for c in range(2):
                ref[n] += p[c] / p.sum() * blocks.expert(t[None], *W[c])[0]
        with torch.no_grad():
            assert torch.allclose(blocks.moe_blocks(small)[l](x[None])[0], ref, atol=1e-5), l
    small.save_pretrained(tmp_path / "m")
    model.save_pretrained(tmp_path / "orig")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()  # plain: transformers' default attention
    same = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(same(input_ids=ids).logits, small(input_ids=ids).logits)
        assert torch.allclose(back(input_ids=ids).logits, small(input_ids=ids).logits, atol=1e-5)
    assert sum(p.numel() for p in back.parameters()) < sum(p.numel() for p in model.parameters())
    assert hm.file_size(tmp_path / "m") < hm.file_size(tmp_path / "orig")


def test_pruned_model_renormalises_over_survivors(model, xs):
    mlps, keep = blocks.moe_blocks(model), [[0, 2], [1, 3], [0, 1, 3]]
    with pytest.raises(RuntimeError):  # one r for every layer: a real config holds one expert count
        hc.pruned(model, keep)
    keep = keep[:2] + [[2, 3]]
    small = hc.pruned(model, keep)
    for l, (mlp, x) in enumerate(zip(mlps, xs)):
        ref = torch.zeros_like(x)
        for n, t in enumerate(x):
            logit = mlp.gate.weight[keep[l]] @ t
            w = torch.softmax(logit, 0)
            for i, e in enumerate(keep[l]):
                ref[n] += w[i] * blocks.expert(t[None], *blocks.weights(mlp, e))[0]
        with torch.no_grad():
            assert torch.allclose(blocks.moe_blocks(small)[l](x[None])[0], ref, atol=1e-5)
        outs = torch.stack([blocks.expert(x, *blocks.weights(mlp, e)) for e in range(4)])
        assert torch.allclose(hc.routed_out(mlp, x, outs, keep[l]), ref, atol=1e-5)  # O-prune's restricted router


def test_o_prune_is_the_best_subset_by_brute_force(model, xs):
    mlp, x = blocks.moe_blocks(model)[2], xs[2]
    with torch.no_grad():
        y = mlp(x[None])[0]
        errs = {}
        for s in combinations(range(4), 2):
            small = hc.pruned(model, [list(s)] * 3)
            errs[s] = (blocks.moe_blocks(small)[2](x[None])[0] - y).pow(2).sum().item()
    assert tuple(hc.o_prune(mlp, x, 2)) == min(errs, key=errs.get)
    assert hc.prune_keep(mlp, x, 2, "F") == sorted(hc.usage_frequencies(mlp, x).topk(2).indices.tolist())


def test_alignment_recovers_a_permuted_copy():
    g = torch.Generator().manual_seed(0)
    Wg, Wu, Wd = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)
    p = torch.randperm(16, generator=g)
    other = (Wg[p], Wu[p], Wd[:, p])
    assert all(torch.equal(a, b) for a, b in zip(hc.align_neurons((Wg, Wu, Wd), other), (Wg, Wu, Wd)))
    f = torch.tensor([0.5, 0.5])
    aligned = hc.merge_cluster([(Wg, Wu, Wd), other], f, align=True)
    plain = hc.merge_cluster([(Wg, Wu, Wd), other], f)
    assert torch.allclose(aligned[0], Wg, atol=1e-6) and not torch.allclose(plain[0], Wg, atol=1e-2)
    rnd = hc.merge_cluster([(Wg, Wu, Wd), other], f, align="random")  # the control: a random permutation, seed 0
    q = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rnd[2], 0.5 * Wd + 0.5 * other[2][:, q], atol=1e-6)
    assert not torch.allclose(rnd[2], Wd, atol=1e-2)


def test_top2_one_group_counts_tokens_whose_two_picks_share_a_group(model, ids):
    st = hm.make_study("m", model, ids, {"input_ids": ids}, truth=np.array([0, 0, 1, 1]))
    n_exp = model.config.num_local_experts
    assert n_exp == 4
    want = []
    for m, x in zip(blocks.moe_blocks(model), st.xs):  # naive: sort each token's logits by hand
        hits = 0
        for row in (x @ m.gate.weight.T).tolist():
            a, b = sorted(range(n_exp), key=lambda j: -row[j])[:2]
            hits += st.truth[a] == st.truth[b]
        want.append(hits / len(x))
    assert np.allclose(hm.top2_one_group(st), want)
    up = hm.make_study("up", hm.upcycle(model, 2, 0.0, torch.Generator()), ids, {"input_ids": ids},
                       truth=np.arange(8) % 4)  # exact copies, router rows too: both picks always one pair
    assert hm.top2_one_group(up) == [1.0] * len(up.xs)


def test_permuted_copies_compute_the_same_function(model, ids):
    C = hm.permute_copies(model, 2, torch.Generator().manual_seed(0))
    assert not torch.equal(C.model.layers[0].mlp.experts.down_proj[3], model.model.layers[0].mlp.experts.down_proj[3])
    with torch.no_grad():
        assert torch.allclose(C(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_upcycle_duplicates_experts_and_router_rows(model):
    up = hm.upcycle(model, 2, 0.0, torch.Generator().manual_seed(0))
    a, b = blocks.moe_blocks(model)[0], blocks.moe_blocks(up)[0]
    assert up.config.num_local_experts == 8
    assert torch.equal(b.experts.gate_up_proj[5], a.experts.gate_up_proj[1])
    assert torch.equal(b.gate.weight[6], a.gate.weight[2])


def test_qwen_moe_shared_expert_untouched_and_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = tiny_qwen2_moe(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=24, n_experts=4, d_shared=32).eval()
    ids = torch.randint(40, (2, 12), generator=torch.Generator().manual_seed(0))
    xs = blocks.moe_inputs(m, ids)
    freqs = [hc.usage_frequencies(b, x) for b, x in zip(blocks.moe_blocks(m), xs)]
    small = hc.smaller(m, [np.array([0, 0, 1, 1])] * 2, freqs)
    assert small.config.num_experts == 2
    for a, b in zip(blocks.moe_blocks(m), blocks.moe_blocks(small)):
        assert all(torch.equal(p, q) for p, q in zip(a.shared_expert.parameters(), b.shared_expert.parameters()))
        assert torch.equal(a.shared_expert_gate.weight, b.shared_expert_gate.weight)
    small.save_pretrained(tmp_path)
    with torch.no_grad():
        back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert torch.equal(back(input_ids=ids).logits,
                           small(input_ids=ids).logits)


def test_config_controls():
    assert hc.Config.for_scale("smoke").method == "hierarchical"
    assert hc.Config.for_scale("smoke", "random_groups").method == "random"
    assert hc.Config.for_scale("smoke", "weight_features").feature == "weight"
    assert hc.Config.for_scale("smoke", "random_alignment").align == "random" and hc.Config().align == "matched"
    with pytest.raises(ValueError):
        hc.Config.for_scale("smoke", "nonsense")


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_checkpoint_folder_is_merged_saved_and_reloads(tmp_path):
    """model=<folder>, data=<.txt>: HC-SMoE on a saved tiny Mixtral, in bfloat16 as researchers' checkpoints are
    (loaded as saved), the smaller model written to out_dir and reloaded identically (in bf16 the merged model's
    rotary frequencies were once rounded and its reload used another attention kernel: the run failed)."""
    from transformers import AutoModelForCausalLM

    from ..conftest import fake_lm_eval, run_lab, save_tiny_moe

    save_tiny_moe(tmp_path, [f"w{i}" for i in range(30)], lines=200, d_model=32, n_layers=2, n_heads=4, d_ff=48,
                  n_experts=8, dtype=torch.bfloat16)
    proc = run_lab("run", "06_hc_smoe", "-p", "model", str(tmp_path / "ckpt"), "-p", "data", str(tmp_path / "text.txt"),
                   "-p", "out_dir", str(tmp_path / "merged"), "-p", "tasks", "toy_task", "--out", str(tmp_path / "out"),
                   "--no-page", env=fake_lm_eval(tmp_path / "stub"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "06_hc_smoe.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []  # a checkpoint: measurements, no toy claim
    saved = rec["metrics"]["checkpoint"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert back.config.num_local_experts == 4 and saved["reload_max_abs_logit_diff"] <= 1e-5
    assert saved["params"]["merged"] < saved["params"]["original"]
    assert saved["bytes"]["merged"] < saved["bytes"]["original"]
    # lm-eval (stubbed) scored the written folder: the merged model's parameter count
    assert rec["metrics"]["zero_shot"] == {"toy_task": {"params": saved["params"]["merged"]}}


def test_shrink_keeps_a_bf16_models_rotary_frequencies(tmp_path):
    """A bf16 checkpoint (loaded as `from_pretrained` loads it: weights bf16, rotary frequencies float32) shrunk with
    every expert kept gives the original's logits; `.to(bfloat16)` rounded its rotary frequencies (the logits of 06's
    checkpoint path then moved by ~0.01, and its reload check failed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny_qwen2_moe(vocab_size=64).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    mlps = blocks.moe_blocks(model)
    same = hc.shrink(model, [m.experts.gate_up_proj.data for m in mlps], [m.experts.down_proj.data for m in mlps],
                     [m.gate.weight.data for m in mlps])
    assert all(m.inv_freq.dtype == torch.float32 for m in same.modules() if hasattr(m, "inv_freq"))
    ids = torch.randint(model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(same(input_ids=ids).logits, model(input_ids=ids).logits)


def test_original_bytes_are_the_checkpoints_files_or_its_parameters(tmp_path):
    """The original's size is read from the folder it was loaded from, never written again (Mixtral-8x7B: 93 GB);
    a model built in memory counts its parameters' bytes."""
    from transformers import AutoModelForCausalLM

    m = tiny_qwen2_moe(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=24, n_experts=4, d_shared=32)
    assert hm.original_bytes(m) == sum(p.numel() * p.element_size() for p in m.parameters())
    m.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hm.original_bytes(back) == hm.file_size(tmp_path) > 0
