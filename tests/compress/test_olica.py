"""Olica (lab.compress.olica, lab.compress.pruned_llama) against independent references."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from lab.compress import olica as ol
from lab.compress import olica_ops as ops
from lab.compress import olica_study as ols
from lab.compress import pruned_llama as om
from lab.data.markov_induction import MarkovInduction
from lab.models.zoo import tiny_llama


def _tiny(seed=0, d=32, L=2, H=4, F=64, V=50):
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=V, d_model=d, n_layers=L, n_heads=H, d_ff=F).eval()


def test_fast_ond_keeps_every_head_product_and_sorts_by_weighted_norm():
    g = torch.Generator().manual_seed(0)
    H, dh, d = 4, 8, 32
    wv, wo, e = torch.randn(H * dh, d, generator=g), torch.randn(d, H * dh, generator=g), torch.rand(d, generator=g)
    nv, no, S = ol.fast_ond(wv, wo, e, H)
    for h in range(H):
        r = slice(h * dh, (h + 1) * dh)
        assert torch.allclose(no[:, r] @ nv[r], wo[:, r] @ wv[r], atol=1e-4)
        assert torch.all(S[h][:-1] >= S[h][1:])  # sorted
        # column j of the new W_o has output-energy-weighted norm S_j, and the columns are orthogonal in that norm
        A = e.sqrt()[:, None] * no[:, r]
        assert torch.allclose(A.T @ A, torch.diag(S[h] ** 2), atol=1e-3)


def test_full_ond_keeps_every_head_product():
    g = torch.Generator().manual_seed(1)
    H, dh, d = 2, 4, 16
    wv, wo = torch.randn(H * dh, d, generator=g), torch.randn(d, H * dh, generator=g)
    nv, no, S = ol.full_ond(wv, wo, torch.rand(d, generator=g) + 0.1, torch.rand(d, generator=g) + 0.1, H)
    for h in range(H):
        r = slice(h * dh, (h + 1) * dh)
        assert torch.allclose(no[:, r] @ nv[r], wo[:, r] @ wv[r], atol=1e-4)


def test_a_sparsity_that_leaves_a_head_no_neuron_is_one_sentence():
    """Within lab.papers' limit 2s < 1 + k the official rounding d_v = d_h − ⌊s_vp·d_h⌋ keeps a neuron (s = 0.74,
    k = 0.5: one of 8); a call past it (s = 0.8: s_vp > 1) is refused by the plan, not by a zero-width Linear."""
    from lab.core.params import ParamError

    assert ol.make_plan(_tiny(), 0.74, 0.5).d_v == 1
    with pytest.raises(ParamError, match="no V/O neuron per head at this model's hidden 32 and head dim 8"):
        ol.make_plan(_tiny(), 0.8, 0.5)
    assert ol.make_plan(_tiny(), 0.33, 3.0).d_v >= 1


def test_ond_rotation_leaves_the_logits_unchanged():
    m, ids = _tiny(), torch.randint(1, 50, (3, 12))
    exact = ols.ond_exactness(m, ids)
    assert exact["fast"] < 1e-5 and exact["full"] < 1e-5  # relative to max |logits|


def _biased(seed=0, d=32, L=2, H=4, F=64, V=50):
    """A Llama config with `attention_bias` and `mlp_bias`, every bias drawn away from zero."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=H, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                      attn_implementation="eager")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return m


def test_biased_attention_rotates_exactly_and_prunes_keeping_its_biases(tmp_path):
    """With `attention_bias`: v_proj's bias folds into o_proj's (b_o + W_o b_v, exact since attention weights sum to
    one), so both OND rotations leave the logits unchanged (before the fold the rotation changed them by ~10 %);
    rank-r Q/K keep the dense q/k biases; a pruned model reloads with no missing key and the same logits."""
    from transformers import AutoModelForCausalLM

    m, ids = _biased(), torch.randint(1, 50, (3, 12))
    exact = ols.ond_exactness(m, ids)
    assert exact["fast"] < 1e-5 and exact["full"] < 1e-5
    a, x = copy.deepcopy(m.model.layers[0].self_attn), torch.randn(6, 32)
    P = torch.rand(6, 6).softmax(1)  # a mix whose rows sum to one, as attention's

    def out(P):
        return a.o_proj(P @ a.v_proj(x))

    before, before_2 = out(P), out(2 * P)
    ops.fold_value_bias(a)
    torch.testing.assert_close(out(P), before)
    assert (out(2 * P) - before_2).abs().max() > 0.1  # rows summing to two: the fold is not exact, the test can fail
    assert a.v_proj.bias.abs().max() == 0
    cfg = ol.Config(mlp_num=1)
    pruned, _ = ol.prune(m, ids, 0.3, cfg.recipe(cfg.method), cfg)
    for dense, new in zip(m.model.layers, pruned.model.layers):
        for name in ("q_proj", "k_proj"):
            torch.testing.assert_close(getattr(new.self_attn, name)[1].bias, getattr(dense.self_attn, name).bias)
    wanda, _ = ol.prune(m, ids, 0.3, cfg.recipe("Wanda-sp"), cfg)  # no rotation, and still folded
    assert all(b_.self_attn.v_proj.bias.abs().max() == 0 for b_ in wanda.model.layers)
    pruned.save_pretrained(tmp_path)
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert (back.eval()(input_ids=ids).logits - pruned(input_ids=ids).logits).abs().max() < 1e-5


def test_weighted_svd_reaches_the_eckart_young_error_and_beats_unweighted_svd_in_its_norm():
    g = torch.Generator().manual_seed(2)
    W, s_in, r = torch.randn(24, 16, generator=g), torch.rand(16, generator=g) * 10, 5
    D = s_in.sqrt()
    w1, w2 = ol.weighted_svd(W, s_in, r)
    assert w1.shape == (r, 16) and w2.shape == (24, r)
    sigma = torch.linalg.svdvals(W * D)
    err = ((W - w2 @ w1) * D).pow(2).sum()
    assert torch.allclose(err, sigma[r:].pow(2).sum(), rtol=1e-4)  # closed form: the trailing singular values
    p1, p2 = ol.weighted_svd(W, None, r)
    assert ((W - p2 @ p1) * D).pow(2).sum() > err


def test_ridge_without_damping_is_least_squares_and_with_damping_the_official_formula():
    g = torch.Generator().manual_seed(3)
    X, E = torch.randn(200, 12, generator=g), torch.randn(200, 5, generator=g)
    ref = torch.linalg.lstsq(X.double(), E.double()).solution.float()
    assert torch.allclose(ol.ridge(X, E, 0.0, 128, 128), ref, atol=1e-5)
    n, L = 4, 50  # 200 tokens as 4 sequences of 50
    G = X.double().T @ X.double()
    lam = 0.5 * G.diagonal().mean() / ((n / 128) * (L / 128))
    want = torch.linalg.solve(G + lam * torch.eye(12, dtype=G.dtype), X.double().T @ E.double()).float()
    assert torch.allclose(ol.ridge(X, E, 0.5, n, L), want, atol=1e-5)


def test_lc_factors_are_the_weighted_truncation_and_exact_at_full_rank():
    g = torch.Generator().manual_seed(4)
    X, E = torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g)
    W = ol.ridge(X, E, 0.0, 1, 1)
    w1, w2, w = ol.lc_factors(X, E, W, 8)
    assert torch.allclose(w1 @ w2, W, atol=1e-4)
    w1, w2, w = ol.lc_factors(X, E, W, 3)
    U, S, Vt = np.linalg.svd((W * w).numpy().astype(np.float64))
    want = (U[:, :3] * S[:3]) @ Vt[:3] / w.numpy()[None]
    assert np.allclose((w1 @ w2).numpy(), want, atol=1e-4)
    P = X @ W
    rho = np.array([np.corrcoef(P[:, j].numpy(), E[:, j].numpy())[0, 1] for j in range(8)])
    assert np.allclose(w.numpy(), np.maximum(1 / (1 + np.exp(-(rho - rho.mean()) / 0.05)), 0.05), atol=1e-5)


def test_sr_allocation_matches_the_official_rule():
    assert ol.sr_allocation(0.2, 3) == pytest.approx((0.4, 0.1))
    assert ol.sr_allocation(0.5, 3) == pytest.approx((0.75, 0.25))


def test_ffn_keep_protects_the_lowest_percent_then_prunes():
    keep = ops.ffn_keep(torch.arange(200.0), 150, 0.01)  # 1 % of 200 = 2 protected, the next 50 pruned
    assert keep.tolist() == [0, 1] + list(range(52, 200))
    assert ops.ffn_keep(torch.arange(10.0).flip(0), 7, 0.0).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_every_head_keeps_the_same_value_count():
    m = om.from_llama(_tiny())
    a = m.model.layers[0].self_attn
    scores = torch.arange(32.0)[torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    wv = a.v_proj.weight.clone()
    ops.prune_vo(a, scores, 4, 3)
    assert a.v_proj.weight.shape == (12, 32) and a.o_proj.weight.shape == (32, 12) and a.v_head_dim == 3
    for h in range(4):
        best = scores[h * 8:(h + 1) * 8].topk(3).indices.sort().values + h * 8
        assert torch.equal(a.v_proj.weight[h * 3:(h + 1) * 3], wv[best])


@pytest.mark.parametrize("name", list(ol.METHODS))
def test_parameter_counts_match_the_hand_computed_plan(name):
    m, V, d, L, H = _tiny(), 50, 32, 2, 4
    cfg = ol.Config(mlp_num=1, lc_ratio=0.1)
    pruned, info = ol.prune(m, torch.randint(1, V, (4, 16)), 0.3, cfg.recipe(name), cfg)
    p = info["plan"]
    s_qk, s_vp = 0.6, 0.15
    assert p.r_qk == math.ceil((1 - s_qk) * d / 2) and p.d_v == 8 - int(s_vp * 8) and p.r_lc == 3
    hand = 2 * V * d + d + L * (2 * d + 2 * 2 * p.r_qk * d + 2 * d * H * p.d_v + 3 * d * p.d_ff)
    hand += 2 * d * p.r_lc * len(p.lc_layers) + (2 * d * L if cfg.recipe(name).compensate else 0)  # FLAP's biases
    assert om.n_params(pruned) == hand
    assert abs(hand - 0.7 * om.n_params(m)) <= 3 * d  # the target within one FFN neuron per layer
    table = om.param_table(pruned)
    bias = d if cfg.recipe(name).compensate else 0  # FLAP: down_proj's bias
    assert table["layer 0"]["q"] == 2 * p.r_qk * d and table["layer 0"]["mlp"] == 3 * d * p.d_ff + bias
    assert table["total"]["all"] == hand


def test_pruned_model_saves_and_reloads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    m, ids = _tiny(), torch.randint(1, 50, (3, 16))
    cfg = ol.Config(mlp_num=1, lc_ratio=0.1)
    pruned, info = ol.prune(m, ids, 0.3, cfg.recipe(cfg.method), cfg)
    assert info["plan"].lc_layers == (0,)  # never the last layer
    pruned.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "olica_llama"
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == "OlicaLlamaForCausalLM" and om.n_params(back) < om.n_params(m)
    with torch.no_grad():
        assert (back(input_ids=ids).logits - pruned(input_ids=ids).logits).abs().max() < 1e-5
    back.config._attn_implementation = "sdpa"  # SDPA accepts the narrower value heads too
    with torch.no_grad():
        assert (back(input_ids=ids).logits - pruned(input_ids=ids).logits).abs().max() < 1e-4


def test_flap_scores_and_bias_compensation_against_their_definitions(tmp_path):
    """FLAP (CASIA-IVA-Lab/FLAP): WIFV = sample variance of input channel j × ‖W[:, j]‖² (a naive loop with
    `statistics.variance`); the compensated bias makes the pruned layer exact on inputs whose pruned channels sit at
    their calibration mean, and adds to a bias the layer already had; a FLAP-pruned model carries o_proj / down_proj
    biases, says so in its config (`out_bias`) and reloads to the same logits."""
    import statistics

    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(6, 3, bias=False)
    x = torch.randn(40, 6, generator=g) * torch.arange(1.0, 7.0)
    mlp = type("M", (), {k: lin for k in ("up_proj", "gate_proj", "down_proj")})()
    got = ops.ffn_scores(mlp, "flap", None, None, g, x.var(0))
    for j in range(6):
        want = statistics.variance(x[:, j].tolist()) * sum(w * w for w in lin.weight[:, j].tolist())
        assert got[j].item() == pytest.approx(want, rel=1e-5)
    keep, mean = torch.tensor([0, 2, 5]), x.mean(0)
    b = ops.compensated_bias(lin, keep, mean)
    xm = x.clone()
    xm[:, [1, 3, 4]] = mean[[1, 3, 4]]  # the pruned channels at their mean: the pruned layer is exact
    torch.testing.assert_close(xm[:, keep] @ lin.weight[:, keep].T + b, lin(xm), atol=1e-5, rtol=1e-5)
    assert ops.compensated_bias(lin, keep, None) is None  # no compensation, no bias
    lin_b = torch.nn.Linear(6, 3)
    torch.testing.assert_close(ops.compensated_bias(lin_b, keep, mean),
                               lin_b.bias + ops.compensated_bias(_no_bias(lin_b), keep, mean))

    m, ids = _tiny(), torch.randint(1, 50, (3, 16))
    cfg = ol.Config(mlp_num=1, lc_ratio=0.1)
    pruned, _ = ol.prune(m, ids, 0.3, cfg.recipe("FLAP"), cfg)
    blocks = pruned.model.layers
    assert all(b_.self_attn.o_proj.bias is not None and b_.mlp.down_proj.bias is not None for b_ in blocks)
    assert pruned.config.out_bias and not om.sync_config(ol.prune(m, ids, 0.3, cfg.recipe("Wanda-sp"), cfg)[0]).out_bias
    pruned.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (back(input_ids=ids).logits - pruned(input_ids=ids).logits).abs().max() < 1e-5


def test_flap_prune_keeps_the_wifv_best_channels_and_compensates_with_their_means():
    """Inside `prune`, layer 0 (its inputs are the dense model's): the kept V/O channels of every head and the kept
    FFN neurons are the top WIFV ones, computed here from hooks on the dense model's o_proj / down_proj inputs, and
    the new biases are W[:, pruned]·E[x_pruned] with those inputs' means."""
    m, ids = _tiny(), torch.randint(1, 50, (4, 16))
    cfg = ol.Config(mlp_num=1, lc_ratio=0.1)
    seen = {}
    blk = m.model.layers[0]
    hooks = [mod.register_forward_hook(lambda _m, inp, _o, k=k: seen.__setitem__(k, inp[0].flatten(0, 1).double()))
             for k, mod in (("o", blk.self_attn.o_proj), ("mid", blk.mlp.down_proj))]
    with torch.no_grad():
        m(input_ids=ids)
    for h in hooks:
        h.remove()
    pruned, info = ol.prune(m, ids, 0.3, cfg.recipe("FLAP"), cfg)
    new, plan, H = pruned.model.layers[0], info["plan"], m.config.num_attention_heads
    for key, old_lin, new_lin in (("o", blk.self_attn.o_proj, new.self_attn.o_proj),
                                  ("mid", blk.mlp.down_proj, new.mlp.down_proj)):
        w_old, w_new, bias = old_lin.weight.detach().double(), new_lin.weight, new_lin.bias
        wifv = seen[key].var(0) * w_old.pow(2).sum(0)
        if key == "o":  # the d_v best of every head
            dh = wifv.numel() // H
            want = torch.cat([h * dh + wifv.view(H, dh)[h].topk(plan.d_v).indices.sort().values for h in range(H)])
        else:
            want = wifv.topk(plan.d_ff).indices.sort().values
        torch.testing.assert_close(w_new.detach().double(), w_old[:, want], atol=1e-6, rtol=0)
        off = torch.ones(len(wifv), dtype=torch.bool)
        off[want] = False
        torch.testing.assert_close(bias.detach().double(), w_old[:, off] @ seen[key].mean(0)[off], atol=1e-5, rtol=1e-4)


def _no_bias(lin: torch.nn.Linear) -> torch.nn.Linear:
    out = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    with torch.no_grad():
        out.weight.copy_(lin.weight)
    return out


def test_from_llama_is_the_same_network_and_refuses_gqa():
    m, ids = _tiny(), torch.randint(1, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(om.from_llama(m)(input_ids=ids).logits, m(input_ids=ids).logits)
    m.config.num_key_value_heads = 2
    with pytest.raises(ValueError, match="GQA"):
        om.from_llama(m)


def test_vo_errors_ond_beats_raw_wanda_and_keeping_everything_is_lossless():
    m, ids = _tiny(), torch.randint(1, 50, (4, 16))
    assert max(ols.vo_errors(m, ids, 1.0, ("fast", "olica"))) < 1e-4
    ond, raw = ols.vo_errors(m, ids, 0.5, ("fast", "olica")), ols.vo_errors(m, ids, 0.5, ("none", "wanda"))
    assert sum(ond) < sum(raw)  # truncating the sorted orthogonal basis beats dropping raw neurons


def test_markov_induction_is_seeded_reserves_id_0_and_repeats_spans():
    t = MarkovInduction(p_copy=1.0)
    a, b = t.batch(8, torch.Generator().manual_seed(0)), t.batch(8, torch.Generator().manual_seed(0))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["input_ids"], a["labels"])
    x = a["input_ids"]
    assert x.min() >= 1 and x.max() < 128 and x.shape == (8, 64)
    for row in x.tolist():  # some span of 8 tokens occurs twice
        grams = [tuple(row[i:i + 8]) for i in range(57)]
        assert len(set(grams)) < len(grams)


def test_config_for_scale_and_controls():
    assert ol.Config.for_scale("smoke").method == "Olica (Fast-OND + LC)"
    rnd = ol.Config.for_scale("smoke", "random")
    assert rnd.method == "random" and rnd.ond == "none" and rnd.recipe(rnd.method).vo == "random"
    sh = ol.Config.for_scale("smoke", "shuffled_lc")
    assert sh.recipe(sh.method).lc_pairs == "shuffled" and sh.recipe(sh.method).lc
    assert ol.Config().recipe("Olica (Fast-OND + LC)").lc_pairs == "matched"
    assert sh.recipe("Wanda-sp").lc_pairs == "matched"
    with pytest.raises(ValueError, match="unknown control"):
        ol.Config.for_scale("smoke", "nope")


def test_the_notebook_declares_the_documented_controls():
    from pathlib import Path

    from lab.core.runner import declared_controls

    nb = Path(__file__).resolve().parents[2] / "notebooks" / "07_olica.ipynb"
    assert set(declared_controls(nb)) == set(ol.CONTROLS)


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_checkpoint_folder_is_pruned_saved_and_reloads(tmp_path):
    """model=<folder>, data=<.txt>: Olica on a saved tiny Llama, the smaller model written to out_dir."""
    from transformers import AutoModelForCausalLM

    from lab.models.tokenizer import word_tokenizer

    from ..conftest import fake_lm_eval, run_lab

    words = [f"w{i}" for i in range(40)]
    tok = word_tokenizer(words)
    _tiny(V=len(tok), d=32, F=64).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    g = np.random.default_rng(0)
    (tmp_path / "text.txt").write_text("\n".join(" ".join(g.choice(words, 60)) for _ in range(200)))
    proc = run_lab("run", "07_olica", "-p", "model", str(tmp_path / "ckpt"), "-p", "data", str(tmp_path / "text.txt"),
                   "-p", "out_dir", str(tmp_path / "pruned"), "-p", "tasks", "toy_a,toy_b", "--out",
                   str(tmp_path / "out"), "--no-page", env=fake_lm_eval(tmp_path / "stub"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "07_olica.json").read_text())
    assert rec["status"] == "measured"
    assert not [c for c in rec["claims"] if c.get("kind", "claim") == "claim"]  # a checkpoint: no toy claim
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert type(back).__name__ == "OlicaLlamaForCausalLM"
    assert om.n_params(back) < 0.8 * om.n_params(dense)
    size = {p: sum(f.stat().st_size for f in (tmp_path / p).glob("*.safetensors")) for p in ("ckpt", "pruned")}
    assert size["pruned"] < size["ckpt"]
    assert rec["metrics"]["saved"]["params"] == om.n_params(back)
    # lm-eval (stubbed) loaded the written folder in the notebook's process, the custom class included
    assert rec["metrics"]["zero_shot"] == {t: {"params": om.n_params(back)} for t in ("toy_a", "toy_b")}


def test_layer_score_is_one_minus_the_mean_column_pearson_correlation_of_the_ridge_fit():
    """`fast_OND`'s layer score: 1 − mean_j corr(fit_j, Y_j) over output columns (numpy's corrcoef as reference)."""
    from lab.compress.olica import mlp_predictability, ridge

    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 6, generator=g)
    Y = X @ torch.randn(6, 4, generator=g) + torch.randn(200, 4, generator=g) * torch.tensor([0.1, 1.0, 3.0, 0.0])
    P = (X @ ridge(X, Y, 0.5, 8, 25)).numpy()
    want = 1 - np.mean([np.corrcoef(P[:, j], Y[:, j].numpy())[0, 1] for j in range(4)])
    assert mlp_predictability(X, Y, 0.5, 8, 25) == pytest.approx(want, abs=1e-5)
