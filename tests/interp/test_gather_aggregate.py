import copy
import math

import pytest
import torch

from lab.data.letters import DELIM, LetterRetrieval
from lab.interp import ablation
from lab.interp import gather_aggregate as ga
from lab.interp import gather_aggregate_study as gs
from lab.models import hooks, tiny_hybrid, tiny_llama, tiny_mamba2
from lab.models.score import choice_accuracy, choice_logprobs
from tests.interp.tiny import V, alive, models

MODELS = models()


def test_four_configurations_on_a_scripted_model():
    m = MODELS["llama"]
    # an "accuracy" that needs head 2 of layer 0 and head 1 of layer 1 (read off the live weights)
    def acc():
        alive = lambda l, h: hooks.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0
        return 0.25 + 0.75 * float(alive(0, 2) and alive(1, 1))

    table = ga.four_configurations(m, (0, 2), (1, 1), acc)
    assert table == {"gather + aggregate": 1.0, "only aggregate": 0.25, "only gather": 0.25, "none": 0.25}


def test_sharpness_by_hand():
    mass, ent = ga.sharpness(torch.tensor([0.0, 1.0, 0.0, 0.0]), 1)
    assert mass == 1.0 and ent == pytest.approx(0.0, abs=1e-6)
    mass, ent = ga.sharpness(torch.tensor([0.5, -0.5, 0.5, 0.5]), 1)  # |.|: SSM rows can be negative
    assert mass == pytest.approx(0.25) and ent == pytest.approx(math.log(4))
    mass, _ = ga.sharpness(torch.tensor([0.1, 0.2, 0.3, 0.4]), [2, 3])  # a segment of positions
    assert mass == pytest.approx(0.7)


def test_discover_on_a_scripted_model():
    m = MODELS["llama"]

    def alive(l, h):
        return hooks.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0

    letter = lambda: 0.25 + 0.75 * float(alive(0, 3) and alive(1, 0)) - 0.05 * float(not alive(1, 2))
    cloze = lambda: 1.0
    d = ga.discover(m, letter, cloze, (0, 1))
    assert d.gather == (0, 3) and d.aggregate == (1, 0)
    assert d.letter == 1.0 and d.removed == {"gather": (0.25, 1.0), "aggregate": (0.25, 1.0)}
    assert d.other_max == pytest.approx(0.05)
    assert d.table["gather + aggregate"] == pytest.approx(0.95) and d.table["none"] == pytest.approx(0.2)
    summary = d.summary()
    assert summary["layers"] == [0, 1] and summary["keep_only"] == d.table and summary["drop"] is d.drop
    assert summary["gather"] == (0, 3) and summary["removed"] == d.removed and summary["other_max"] == d.other_max
    assert ga.discover(m, letter, cloze, (0, 1), heads=((0, 1), (1, 1))).gather == (0, 1)


def test_paper_heads_by_hub_id_or_folder_name():
    want = ((16, 22), (17, 24))
    assert ga.paper_heads("meta-llama/Llama-3.1-8B-Instruct") == want
    assert ga.paper_heads("/models/llama-3.1-8b-instruct/") == want
    assert ga.paper_heads("/tmp/some-tiny-model") is None


def test_decoy_positions_are_other_delimiters():
    D = 9
    ids = torch.tensor([[0, 5, 6, D, 5, 6, D, 5, 6, D, 3]] * 50)
    target = torch.tensor([3, 6, 9, 3, 6] * 10)
    decoy = ga.decoy_positions(ids, target, D, torch.Generator().manual_seed(0))
    assert torch.all(ids[torch.arange(50), decoy] == D) and torch.all(decoy != target)
    assert set(decoy.tolist()) == {3, 6, 9}  # every wrong option gets drawn
    with pytest.raises(ValueError):
        ga.decoy_positions(ids[:1, :4], torch.tensor([3]), D, torch.Generator())


def test_the_notebook_declares_the_documented_controls():
    from pathlib import Path

    from lab.core.runner import declared_controls

    nb = Path(__file__).resolve().parents[2] / "notebooks" / "09_gather_aggregate.ipynb"
    assert set(declared_controls(nb)) == set(ga.CONTROLS) == {"random_heads", "cloze_prompts", "shuffled",
                                                              "untrained", "ssm_row"}


def test_config_for_scale_and_controls():
    smoke, full = ga.Config.for_scale("smoke"), ga.Config.for_scale("full")
    assert smoke == ga.Config() and (smoke.transformer_steps, smoke.mamba2_steps) == (600, 200)
    assert (full.transformer_steps, full.mamba2_steps, full.n_letter, full.n_rows) == (1800, 600, 1000, 256)
    assert smoke.n_draws % 2 == 0  # layer_versus_random draws antithetic pairs
    untrained = ga.Config.for_scale("full", "untrained"), ga.Config.for_scale("smoke", "untrained")
    assert all(c.transformer_steps == c.mamba2_steps == c.hybrid_steps == 0 for c in untrained)
    assert (smoke.hybrid_steps, full.hybrid_steps, smoke.hybrid_batch_size) == (300, 900, 32)
    assert smoke.hybrid_layouts == ("MMA", "MAM")
    assert ga.Config.for_scale("smoke", "ssm_row") == smoke  # the control changes what is masked, not the models
    assert ga.Config.for_scale("smoke", "shuffled") == ga.Config.for_scale("smoke", "cloze_prompts") == smoke
    with pytest.raises(ValueError, match="unknown control"):
        ga.Config.for_scale("smoke", "nope")
    with pytest.raises(AttributeError):
        smoke.n_rows = 1  # frozen


def test_untrained_toys_are_the_seeded_initialisation_and_prompts_come_from_their_seed():
    cfg = ga.Config.for_scale("smoke", "untrained")
    cfg = type(cfg)(**{**cfg.__dict__, "n_letter": 6, "n_cloze": 4, "n_verify": 5})
    study = gs.train_toys(cfg, 3)
    task = LetterRetrieval(max_filler=0, n_questions=4, n_labels=8, n_options=6, min_options=2)
    V = len(task.tokenizer)
    torch.manual_seed(3)
    want = {"transformer": tiny_llama(vocab_size=V, d_model=64, n_layers=2, n_heads=4)}
    torch.manual_seed(3)
    want["mamba2"] = tiny_mamba2(vocab_size=V, d_model=64, n_layers=2, head_dim=16)
    for layout in ("MMA", "MAM"):
        torch.manual_seed(3)
        want[layout] = tiny_hybrid(vocab_size=V, d_model=64, layout=layout, n_heads=4, head_dim=16)
    assert list(study.hybrids) == ["MMA", "MAM"]
    for name, m in want.items():
        got = (study.hybrids[name] if name in study.hybrids else study.models[name]).state_dict()
        assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())
    g = torch.Generator().manual_seed(10_003)
    assert study.letter_ex == task.examples(6, g, "letter", n_options=4)
    assert study.cloze_ex == task.examples(4, g, "cloze")
    # the verification prompts come from their own generator, so adding them changed no other prompt
    assert study.verify_ex == task.examples(5, torch.Generator().manual_seed(30_003), "letter", n_options=4)
    assert study.verify(study.models["mamba2"])() == choice_accuracy(study.models["mamba2"], study.tokenizer,
                                                                     study.verify_ex, task.letters)
    assert study.pairs == {"transformer": (0, 1), "mamba2": (0, 1)}
    assert study.heads == {"transformer": None, "mamba2": None}
    m = study.models["transformer"]
    assert study.letter(m)() == choice_accuracy(m, study.tokenizer, study.letter_ex, task.letters)
    assert study.cloze(m)() == choice_accuracy(m, study.tokenizer, study.cloze_ex, task.contents)


def test_layer_level_on_a_scripted_model():
    m = MODELS["llama"]
    n_blocks = lambda: sum(not isinstance(b, hooks.Skip) for b in hooks.layers(m))
    letter = lambda: 0.25 + 0.75 * float(n_blocks() == 2 and alive(m, 1, 1))  # needs both blocks and L1H1
    cloze = lambda: sum(alive(m, 0, h) for h in range(4)) / 4  # reads layer 0's heads
    row = ga.layer_level(m, letter, cloze, (0, 1))
    assert row == {"minimal model": (1.0, 1.0), "up to the gather layer": (0.25, 1.0),
                   "no gather-layer heads": (1.0, 0.0), "no aggregate-layer heads": (0.25, 1.0)}
    assert ga.share_lost(row, chance=0.25) == 1.0
    draw = ablation.random_heads(m, (0, 1), 4, torch.Generator().manual_seed(5))  # the control: one draw, used twice
    want = (0.25 if 1 in draw.get(1, []) else 1.0, 1 - len(draw.get(0, [])) / 4)
    row = ga.layer_level(m, letter, cloze, (0, 1), random_seed=5)
    assert row["no gather-layer heads"] == row["no aggregate-layer heads"] == want
    assert all(alive(m, l, h) for l in (0, 1) for h in range(4)) and n_blocks() == 2  # everything restored


def test_share_lost_by_hand():
    row = {"minimal model": (0.85, 1.0), "no aggregate-layer heads": (0.4, 1.0)}
    assert ga.share_lost(row, chance=0.25) == pytest.approx(0.45 / 0.6)
    at_chance = {"minimal model": (0.25, 1.0), "no aggregate-layer heads": (0.2, 1.0)}
    assert math.isnan(ga.share_lost(at_chance, chance=0.25))


def test_locate_takes_the_collapse_layer_or_the_given_heads():
    m = MODELS["llama"]
    n_blocks = lambda: sum(not isinstance(b, hooks.Skip) for b in hooks.layers(m))
    letter, cloze = lambda: [0.25, 0.9][n_blocks() - 1], lambda: 1.0
    pair, curve = ga.locate(m, letter, cloze, chance=0.25)
    assert pair == (0, 1) and curve == {"letter": [0.25, 0.9], "cloze": [1.0, 1.0]}
    assert ga.locate(m, letter, cloze, ((5, 1), (7, 2)), chance=0.25)[0] == (6, 7)
    with pytest.warns(UserWarning, match="never rises above chance"):
        assert ga.locate(m, lambda: 0.2, cloze, chance=0.25)[0] == (0, 1)


def test_answer_segments_are_the_answer_option_or_a_decoy():
    task = LetterRetrieval(max_filler=0, n_labels=8)
    ex = task.examples(40, torch.Generator().manual_seed(0))
    rows, answer, delim = task.letter_rows(40, torch.Generator().manual_seed(0))
    tok = task.tokenizer
    ids, seg = ga.answer_segments(tok, ex)
    assert torch.equal(ids, rows) and seg.shape == (40, 3) and torch.equal(seg[:, 0], delim)
    n = torch.arange(40)
    assert torch.equal(ids[n, seg[:, 0]], torch.tensor(tok.convert_tokens_to_ids([DELIM] * 40)))
    assert tok.convert_ids_to_tokens(ids[n, seg[:, 2]].tolist()) == [e["answer"] for e in ex]  # the option's letter
    _, decoy = ga.answer_segments(tok, ex, decoy_seed=0)
    assert torch.equal(ids[n, decoy[:, 0]], ids[n, seg[:, 0]]) and torch.all(decoy[:, 0] != seg[:, 0])
    assert all(a != e["answer"] for a, e in zip(tok.convert_ids_to_tokens(ids[n, decoy[:, 2]].tolist()), ex))


def test_aggregate_focus_against_a_naive_loop():
    m = MODELS["llama"].eval()
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(2))
    seg = torch.tensor([[8, 7, 6], [5, 4, 3], [2, 1, 0]])
    got = ga.aggregate_focus(m, ids, seg, (1, 2))
    with torch.no_grad():
        A = m(input_ids=ids, output_attentions=True).attentions[1][:, :, -1]  # (n, H, T): the last rows
    mass, ent = torch.zeros(4), torch.zeros(4)
    for h in range(4):
        for i in range(3):
            p = A[i, h].abs() / A[i, h].abs().sum()
            mass[h] += p[seg[i]].sum() / 3
            ent[h] -= sum(float(x * math.log(x)) for x in p if x > 0) / 3
    best = int(mass.argmax())
    assert got["best head"] == best
    want = {"A mass": mass[2], "A entropy": ent[2], "best mass": mass[best], "best entropy": ent[best]}
    for key, value in want.items():
        assert got[key] == pytest.approx(float(value), abs=1e-5)
    # with `pick`, the best head is the one with most mass on the other prompts, scored on these
    other = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(5))
    there, seg2 = next((h, s2) for s2 in (torch.tensor([[k, k + 1, k + 2]] * 3) for k in range(7))
                       if (h := ga.aggregate_focus(m, other, s2, (1, 2))["best head"]) != best)
    picked = ga.aggregate_focus(m, ids, seg, (1, 2), pick=(other, seg2))  # a head that is not the best here
    assert picked["best head"] == there and picked["best mass"] == pytest.approx(float(mass[there]), abs=1e-5)


def test_retrieval_vs_options_against_heads_zeroed_by_hand():
    task = LetterRetrieval(max_filler=0, n_labels=8, n_options=4)
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(task.tokenizer), d_model=32, n_layers=2, n_heads=4).eval()
    got = ga.retrieval_vs_options(m, task.tokenizer, task, (1, 2), [2, 4], 30, seed=1)
    cut_a, cut_all = copy.deepcopy(m), copy.deepcopy(m)
    with torch.no_grad():
        cut_a.model.layers[1].self_attn.o_proj.weight[:, 16:24] = 0  # head 2's 8 inputs
        cut_all.model.layers[1].self_attn.o_proj.weight.zero_()
    want = {"intact": [], "without A": [], "without L1 heads": []}
    for k in (2, 4):
        ex = task.examples(30, torch.Generator().manual_seed(20_000 + 100 + k), "letter", n_options=k)
        for cond, model in zip(want, (m, cut_a, cut_all)):
            want[cond].append(choice_accuracy(model, task.tokenizer, ex, task.letters))
    assert got == want


def test_discovery_heads_merge_a_shared_layer():
    d = ga.Discovery(1.0, 1.0, [0, 1], torch.zeros(2, 4), torch.zeros(2, 4), (0, 2), (1, 1), {}, 0.0, {})
    assert d.heads == {0: [2], 1: [1]}
    d = ga.Discovery(1.0, 1.0, [1, 1], torch.zeros(2, 4), torch.zeros(2, 4), (1, 2), (1, 0), {}, 0.0, {})
    assert d.heads == {1: [2, 0]}


def test_answer_rows_masked_against_the_rows_zeroed_by_hand():
    task = LetterRetrieval(max_filler=0, n_questions=4, n_labels=8, n_options=4, min_options=2)
    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=len(task.tokenizer), d_model=32, layout="MAM", n_heads=2, head_dim=16).eval()
    g = torch.Generator().manual_seed(0)
    letter_ex, cloze_ex = task.examples(40, g, "letter"), task.examples(20, g, "cloze")
    letter = lambda: choice_accuracy(m, task.tokenizer, letter_ex, task.letters)
    logits = lambda ex: choice_logprobs(m, task.tokenizer, [e["prompt"] for e in ex], task.letters)
    rows = ga.answer_rows_masked(m, letter, None)
    assert list(rows) == ["intact", "every attention block", "L0 SSM", "L1 attention", "L2 SSM"]
    assert all(math.isnan(c) for _, c in rows.values())
    full = logits(letter_ex)
    for name, layer in (("L0 SSM", 0), ("L1 attention", 1), ("L2 SSM", 2)):
        with hooks.zero_rows(m, [layer]):
            assert rows[name][0] == letter()
            assert not torch.allclose(logits(letter_ex), full)  # the answer row mattered
    assert rows["every attention block"][0] == rows["L1 attention"][0]
    both = ga.answer_rows_masked(m, letter, lambda: choice_accuracy(m, task.tokenizer, cloze_ex, task.contents))
    assert both["intact"][0] == rows["intact"][0] and 0 <= both["intact"][1] <= 1
    torch.testing.assert_close(logits(letter_ex), full)  # nothing left behind
