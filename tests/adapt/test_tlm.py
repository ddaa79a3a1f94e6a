import copy
import math
from dataclasses import replace

import pytest
import torch

from lab.adapt import loop as L
from lab.adapt import tlm as T
from lab.adapt import tlm_study as TS
from lab.models import tiny_llama
from tests.adapt.tiny import V, model


def test_sample_ce_is_the_mean_nll_of_the_input_itself():
    m = model()
    x = torch.randint(V, (3, 7))
    mask = torch.ones_like(x)
    mask[1, 5:] = 0  # right padding in row 1
    ce = T.sample_ce(m, x, mask)
    logp = m(input_ids=x, attention_mask=mask).logits.log_softmax(-1)
    for b in range(3):
        n = int(mask[b].sum())
        want = -sum(logp[b, t, x[b, t + 1]] for t in range(n - 1)) / (n - 1)  # naive loop
        assert ce[b].item() == pytest.approx(want.item(), rel=1e-5)
    # labels == input_ids: the same number as the model's own LM loss on the unpadded row
    assert T.sample_ce(m, x[:1]).item() == pytest.approx(m(input_ids=x[:1], labels=x[:1]).loss.item(), rel=1e-5)


def test_sel_weights_and_loss_by_hand():
    ce = torch.tensor([2.0, 3.0, 4.0, 5.0], requires_grad=True)
    coeff, sel = T.sel_weights(ce, threshold=3.0, lamb=0.1)
    assert sel.tolist() == [False, False, True, True]
    torch.testing.assert_close(coeff, torch.tensor([0.0, 0.0, 0.1 * math.e, 0.1 * math.e**2]))
    loss = T.tlm_loss(ce, coeff, sel)
    assert loss.item() == pytest.approx((0.1 * math.e * 4 + 0.1 * math.e**2 * 5) / 2)
    loss.backward()  # the weights are constants: d loss / d CE_i = coeff_i / #selected
    torch.testing.assert_close(ce.grad, coeff / 2)
    paper = T.tlm_loss(ce.detach(), coeff, sel, objective="paper")
    assert paper.item() == pytest.approx((0.1 * math.e * math.exp(4) + 0.1 * math.e**2 * math.exp(5)) / 2)
    none = T.tlm_loss(ce, *T.sel_weights(ce, threshold=9.0))
    assert none.item() == 0.0 and none.requires_grad
    with pytest.raises(ValueError):
        T.tlm_loss(ce, coeff, sel, objective="ppl")


def test_pool_scores_equals_scoring_the_whole_stream_at_once():
    from lab.data.domains import MarkovDomains, answer_scores

    D = MarkovDomains()
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(D.tokenizer), d_model=16, n_layers=1, n_heads=2, max_len=32).eval()
    data = D.sample(10, "target", torch.Generator().manual_seed(0))
    g = torch.Generator()
    whole = answer_scores(m, data, generator=g, device="cpu")
    parts = [(len(x), answer_scores(m, {"input": x, "answer": y}, generator=g, device="cpu"))
             for x, y in zip(data["input"].split(4), data["answer"].split(4))]  # 4, 4, 2
    assert T.pool_scores(parts) == pytest.approx(whole, rel=1e-5)


def test_the_notebook_controls_substitutions():
    """03_tlm's controls: `no_adapt` (lr 0) leaves the model the base model; `no_sel` makes online TLM
    learn from every input, where SEL skips the ones it has learned."""
    inputs = [torch.randint(V, (1, 10), generator=torch.Generator().manual_seed(i % 3)) for i in range(24)]
    m = T.add_lora(model(), targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        ce0 = T.sample_ce(m, torch.cat(inputs))
    threshold = ce0.min().item() - 0.1  # every input selected at the start
    log = L.adapt(m, inputs, T.tlm_objective(threshold=threshold), lr=0.0)
    assert log.backward_passes == len(inputs)
    with torch.no_grad():
        assert torch.equal(T.sample_ce(m, torch.cat(inputs)), ce0)
    counts = {}
    for sel in (True, False):
        m = T.add_lora(model(), targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        _, log = L.adapt_online(m, inputs, T.tlm_objective(threshold=threshold, sel=sel), chunk=4, lr=3e-2,
                                predict=lambda part: [None] * len(part))
        counts[sel] = log.backward_passes
    assert counts[False] == len(inputs) and counts[True] < len(inputs)


# ------------------------------------------------------------------ the notebook's toy


def small(**kw):
    """A toy small enough for a unit test (20 stream inputs: log P0 at the 0.1 quantile selects 18)."""
    return TS.Config(base=replace(TS.Config.base, d_model=16, n_layers=1, n_heads=2, steps=20, batch_size=8),
                    n_stream=20, n_held=6, n_retain=6, n_fisher=16, probe_every=4, chunk=4, **kw)


def test_config_sizes_knobs_and_controls():
    from pathlib import Path

    from lab.core.runner import declared_controls
    from lab.data.domains import RetentionDomains

    smoke, full = TS.Config.for_scale("smoke"), TS.Config.for_scale("full")
    assert (smoke.n_stream, smoke.base.steps) == (250, 500) and (full.n_stream, full.base.steps) == (1000, 1500)
    assert replace(full.base, steps=500) == smoke.base  # full changes only the pre-training steps
    assert smoke.domains == RetentionDomains()
    cfg = TS.Config.for_scale("smoke", select_frac=0.5, lr=2e-3)
    assert (cfg.select_frac, cfg.lr, cfg.tlm_lr, cfg.sel) == (0.5, 2e-3, 2e-3, True)
    assert TS.Config.for_scale("smoke", control="no_sel").sel is False
    assert TS.Config.for_scale("smoke", lr=2e-3, control="no_adapt").tlm_lr == 0.0
    with pytest.raises(ValueError, match="no_sel"):
        TS.Config.for_scale("smoke", control="no_lora")
    assert smoke.base.build(len(smoke.domains.tokenizer)).config.vocab_size == len(smoke.domains.tokenizer)
    nb = Path(__file__).resolve().parents[2] / "notebooks" / "03_tlm.ipynb"
    assert set(declared_controls(nb)) == set(TS.CONTROLS)


def test_base_keeps_the_cache_key_of_a_hand_built_pretraining():
    from lab.data.domains import RetentionDomains
    from lab.models import TrainConfig
    from lab.models.train import cache_key

    for scale, steps in (("smoke", 500), ("full", 1500)):
        cfg = TS.Config.for_scale(scale)
        V = len(cfg.domains.tokenizer)
        ref = tiny_llama(vocab_size=V, d_model=64, n_layers=2, n_heads=4, max_len=32)
        assert cache_key(cfg.base.build(V), cfg.domains, cfg.base.train_config(3)) == \
            cache_key(ref, RetentionDomains(), TrainConfig(steps=steps, batch_size=64, lr=3e-3, seed=3))


def test_evaluate_adds_the_questions_own_perplexity():
    from lab.data.domains import answer_scores

    cfg = small()
    torch.manual_seed(0)
    m = cfg.base.build(len(cfg.domains.tokenizer)).eval()
    data = cfg.domains.sample(3, "target", torch.Generator().manual_seed(0))
    got = TS.evaluate(m, data, generator=torch.Generator(), device="cpu")
    assert list(got) == ["acc", "rougeL", "out_ppl", "in_ppl"]
    assert {k: got[k] for k in ("acc", "rougeL", "out_ppl")} == answer_scores(m, data, generator=torch.Generator(),
                                                                              device="cpu")
    with torch.no_grad():  # naive loop: per question the mean NLL of its own tokens, then exp of the mean
        ces = []
        for x in data["input"].tolist():
            logp = [m(input_ids=torch.tensor([x[:t]])).logits[0, -1].log_softmax(-1)[x[t]].item()
                    for t in range(1, len(x))]
            ces.append(-sum(logp) / len(logp))
    assert got["in_ppl"] == pytest.approx(math.exp(sum(ces) / len(ces)), rel=1e-5)
    cheap = TS.perplexities(m, data, device="cpu")  # Obs. 1's probe: the same two numbers, no generation
    assert cheap == pytest.approx({k: got[k] for k in ("out_ppl", "in_ppl")}, rel=1e-5)


def test_build_sets_log_p0_from_select_frac_on_a_stream_of_questions_only():
    cfg = small()
    toy = TS.build(cfg, seed=0)
    assert len(toy.inputs) == cfg.n_stream and all(x.shape == (1, cfg.domains.passage + 3) for x in toy.inputs)
    assert cfg.domains.leaks(toy.inputs) == 0 and len(toy.held["answer"]) == cfg.n_held
    assert torch.equal(torch.cat(toy.inputs), toy.stream["input"]) and len(toy.stream["answer"]) == cfg.n_stream
    assert int((toy.retain["input"][:, 1] == cfg.domains.tokenizer.convert_tokens_to_ids("A")).sum()) == cfg.n_retain
    with torch.no_grad():
        assert toy.ce0.tolist() == pytest.approx([T.sample_ce(toy.base, x).item() for x in toy.inputs], rel=1e-5)
    assert int((toy.ce0 > toy.threshold).sum()) == 18  # select_frac = 0.9 of 20
    base = toy.score(toy.base, entropy=True)
    assert base["backward"] == base["selected"] == 0 and set(base) == {"target", "stream", "retention", "backward",
                                                                       "selected"}
    assert set(base["target"]) == {"out_ppl", "in_ppl", "entropy"} and set(toy.score(toy.base)["target"]) == {
        "out_ppl", "in_ppl"}


def test_source_answers_control_changes_only_the_held_out_answers():
    """`source_answers`: the same held-out questions, answered by the source chain; every other stream unchanged."""
    cfg = small()
    toy, ctl = TS.build(cfg, seed=0), TS.build(replace(cfg, control="source_answers"), seed=0)
    assert torch.equal(ctl.held["input"], toy.held["input"]) and not torch.equal(ctl.held["answer"], toy.held["answer"])
    assert torch.equal(ctl.held["answer"], cfg.domains.answers_of(toy.held["input"], "source"))
    assert torch.equal(ctl.stream["answer"], toy.stream["answer"])
    assert torch.equal(ctl.retain["input"], toy.retain["input"])
    assert ctl.threshold == toy.threshold and ctl.adaptation_stream()[0] is ctl.inputs


def test_online_tlm_is_scored_on_its_own_stream_answers_each_given_before_training_on_it():
    """run_online's "stream" scores: chunk by chunk, the answers of the model as it was before that chunk's
    update (a naive loop: answer the chunk, then adapt on it with a fresh optimiser), pooled; not the final
    model's answers to the whole stream."""
    from lab.data.domains import answer_scores

    cfg = small()
    toy = TS.build(cfg, seed=0)
    torch.manual_seed(3)
    got = TS.run_online(toy, sel=False, lr=3e-2)
    torch.manual_seed(3)
    m = toy.lora_copy()
    hits, nll, n = 0.0, 0.0, 0
    for start in range(0, cfg.n_stream, cfg.chunk):
        x, y = toy.stream["input"][start:start + cfg.chunk], toy.stream["answer"][start:start + cfg.chunk]
        s = answer_scores(m, {"input": x, "answer": y}, generator=torch.Generator(), device="cpu")
        hits, nll, n = hits + s["acc"] * len(x), nll + math.log(s["out_ppl"]) * len(x), n + len(x)
        L.adapt(m, [x[i:i + 1] for i in range(len(x))], T.tlm_objective(sel=False), lr=3e-2, schedule="constant")
    assert got["stream"]["acc"] == pytest.approx(hits / n) and got["stream"]["out_ppl"] == pytest.approx(
        math.exp(nll / n), rel=1e-5)
    final = answer_scores(m, toy.stream, generator=torch.Generator(), device="cpu")
    assert got["stream"]["out_ppl"] != pytest.approx(final["out_ppl"], rel=1e-3)  # not the final model's answers
    assert got["backward"] == cfg.n_stream


def test_run_arms_is_each_arm_written_out_and_the_controls_substitute_where_they_say():
    cfg = small()
    toy = TS.build(cfg, seed=0)
    torch.manual_seed(7)
    results, curve = TS.run_arms(toy)
    assert list(results) == ["TLM", "TLM w/o SEL", "Tent", "EATA", "COME", "TLM, LoRA on q/v (the paper's)",
                             "TLM, full parameters", "online TLM", "online TLM w/o SEL"]
    assert results["TLM"]["selected"] == results["TLM"]["backward"] == 18  # selected by the base model's CE
    assert results["TLM w/o SEL"]["backward"] == results["Tent"]["backward"] == results["COME"]["backward"] == 20
    assert results["online TLM w/o SEL"]["backward"] == 20
    assert [c["step"] for c in curve] == [0, 4, 8, 12, 16, 20] and set(curve[0]) == {"step", "out_ppl", "in_ppl"}
    torch.manual_seed(TS.arm_seed(toy))  # TLM by hand: a LoRA copy, the base model's CE selecting
    m = T.add_lora(copy.deepcopy(toy.base), targets=cfg.lora_targets)
    start = {n: q.clone() for n, q in m.named_parameters() if q.requires_grad}
    log = L.adapt(m, toy.inputs, T.tlm_objective(threshold=toy.threshold, base_ce=T.base_ce(m)), lr=cfg.lr)
    assert toy.score(m, log) == results["TLM"]
    torch.manual_seed(TS.arm_seed(toy))  # TLM w/o SEL by hand: from the same adapters as TLM (a paired comparison)
    m = T.add_lora(copy.deepcopy(toy.base), targets=cfg.lora_targets)
    assert all(torch.equal(q, start[n]) for n, q in m.named_parameters() if q.requires_grad)
    assert toy.score(m, L.adapt(m, toy.inputs, T.tlm_objective(sel=False), lr=cfg.lr)) == results["TLM w/o SEL"]
    torch.manual_seed(TS.arm_seed(toy))  # the paper's LoRA targets: q and v only
    m = T.add_lora(copy.deepcopy(toy.base), targets=("q_proj", "v_proj"))
    assert {n.split(".")[-4] for n, q in m.named_parameters() if q.requires_grad} == {"q_proj", "v_proj"}
    log = L.adapt(m, toy.inputs, T.tlm_objective(threshold=toy.threshold, base_ce=T.base_ce(m)), lr=cfg.tlm_lr)
    assert toy.score(m, log) == results["TLM, LoRA on q/v (the paper's)"]
    with torch.no_grad():
        assert torch.equal(T.base_ce(m)(toy.inputs[0]), T.sample_ce(toy.base, toy.inputs[0]))
    torch.manual_seed(7)  # every arm seeds itself: the random state before does not matter
    frozen, _ = TS.run_arms(replace(toy, cfg=replace(cfg, control="no_adapt")))
    assert frozen["TLM"]["target"] == toy.score(toy.base)["target"] and frozen["Tent"] == results["Tent"]
    assert frozen["online TLM"]["stream"] == pytest.approx(toy.score(toy.base)["stream"])
    every, _ = TS.run_arms(replace(toy, cfg=replace(cfg, control="no_sel")))
    assert every["TLM"]["backward"] == every["online TLM"]["backward"] == cfg.n_stream
    ppl, _ = TS.run_arms(replace(toy, cfg=replace(cfg, control="entropy_as_ppl")))
    assert ppl["Tent"]["backward"] == ppl["COME"]["backward"] == cfg.n_stream  # every input, the NLL as the loss
    assert ppl["EATA"]["backward"] == results["EATA"]["backward"]  # EATA keeps its entropy filters (here: none kept)
    assert ppl["Tent"]["stream"] == results["TLM w/o SEL"]["stream"]  # Tent's loop with the NLL is TLM w/o SEL
    assert ppl["COME"]["target"]["in_ppl"] != results["COME"]["target"]["in_ppl"]  # the PPL loss instead


def test_source_inputs_control_adapts_tlm_on_source_inputs_and_still_answers_the_target_stream():
    """`source_inputs`: TLM and online TLM learn from as many source-domain inputs (log P0 at the same quantile of
    the base CE on them), the other arms are untouched, and online TLM still answers the target stream's chunks
    (a naive loop: answer target chunk k, then adapt on source chunk k)."""
    from lab.data.domains import answer_scores

    cfg = small(control="source_inputs")
    toy = TS.build(cfg, seed=0)
    assert len(toy.source_inputs) == cfg.n_stream and cfg.domains.leaks(toy.source_inputs) == 0
    src = torch.cat(toy.source_inputs)
    assert not torch.equal(src, torch.cat(toy.inputs))
    with torch.no_grad():
        ce = T.sample_ce(toy.base, src)
    assert int((ce > toy.source_threshold).sum()) == 18 and toy.adaptation_stream()[0] is toy.source_inputs
    assert replace(toy, cfg=replace(cfg, control="")).adaptation_stream() == (toy.inputs, toy.threshold)
    torch.manual_seed(3)
    got = TS.run_online(toy, sel=False, lr=3e-2)
    torch.manual_seed(3)
    m = toy.lora_copy()
    nll, n = 0.0, 0
    for start in range(0, cfg.n_stream, cfg.chunk):
        x, y = toy.stream["input"][start:start + cfg.chunk], toy.stream["answer"][start:start + cfg.chunk]
        s = answer_scores(m, {"input": x, "answer": y}, generator=torch.Generator(), device="cpu")
        nll, n = nll + math.log(s["out_ppl"]) * len(x), n + len(x)
        L.adapt(m, toy.source_inputs[start:start + cfg.chunk], T.tlm_objective(sel=False), lr=3e-2,
                schedule="constant")
    assert got["stream"]["out_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    results, _ = TS.run_arms(toy)
    torch.manual_seed(TS.arm_seed(toy))
    m = T.add_lora(copy.deepcopy(toy.base), targets=cfg.lora_targets)
    log = L.adapt(m, toy.source_inputs, T.tlm_objective(threshold=toy.source_threshold, base_ce=T.base_ce(m)),
                  lr=cfg.lr)
    assert toy.score(m, log) == results["TLM"]
