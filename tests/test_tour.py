import pytest
import torch

from lab import tour
from lab.core import check


def test_config_sizes_by_scale():
    smoke, full = tour.Config.for_scale("smoke"), tour.Config.for_scale("full")
    assert full.steps > smoke.steps and full.n_pairs > smoke.n_pairs
    assert smoke.task().n_values == smoke.n_values
    assert smoke.build().config.vocab_size == len(smoke.task().tokenizer)


def test_answer_attention_matches_a_manual_readout():
    cfg = tour.Config(n_pairs=2, n_keys=4, n_values=4, d_model=16, n_heads=2)
    task = cfg.task()
    torch.manual_seed(0)
    m = cfg.build().eval()
    ex = task.examples(3, torch.Generator().manual_seed(0))
    a = tour.answer_attention(m, task.tokenizer, ex)
    assert a.shape == (cfg.n_layers, cfg.n_heads)
    want = torch.zeros_like(a)
    for e in ex:
        words = e["prompt"].split()
        pos = words.index(words[-1]) + 1  # the value after the queried key
        ids = torch.tensor([task.tokenizer(e["prompt"], add_special_tokens=False)["input_ids"]])
        att = m(input_ids=ids, output_attentions=True).attentions
        want += torch.stack([x[0, :, -1, pos] for x in att]).detach()
    torch.testing.assert_close(a, want / len(ex))


def test_recall_of_an_oracle_and_the_claim_failing_for_the_untrained_baseline():
    cfg = tour.Config()
    task = cfg.task()
    ex = task.examples(64, torch.Generator().manual_seed(0))

    class Oracle(torch.nn.Module):  # puts all mass on the true answer: accuracy 1
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **_):
            words = [task.tokenizer.convert_ids_to_tokens(r) for r in input_ids.tolist()]
            logits = torch.zeros(*input_ids.shape, len(task.tokenizer))
            for b, w in enumerate(words):
                logits[b, -1, task.tokenizer.convert_tokens_to_ids(w[w.index(w[-1]) + 1])] = 10.0
            return type("Out", (), {"logits": logits})

    acc, logp = tour.recall(Oracle(), task.tokenizer, ex, task.values)
    assert acc == 1.0 and logp.shape == (64, cfg.n_values)
    torch.manual_seed(0)
    acc0, _ = tour.recall(cfg.build().eval(), task.tokenizer, ex, task.values)
    assert acc0 < 0.3
    assert not check("the tour's recall claim on the untrained baseline", acc0, ">=", 0.9)["passed"]


def test_converge_restarts_a_plateaued_run_and_stops_at_the_criterion():
    scores = iter([0.39, 0.99, 1.0])
    calls = []

    def attempt(k):
        calls.append(k)
        return torch.nn.Linear(1, 1), [1.0] * 10, False, 2.0

    run = tour.converge(attempt, lambda m: next(scores), target=0.98, max_restarts=3)
    assert calls == [0, 1] and run.converged and [a for _, a, _ in run.attempts] == [0.39, 0.99]
    assert run.steps == 20 and run.seconds == 4.0


def test_converge_respects_the_step_cap_and_keeps_the_best_run():
    scores = iter([0.5, 0.7, 0.6])
    models = []

    def attempt(k):
        models.append(torch.nn.Linear(1, 1))
        return models[-1], [float(k)], True, 0.0

    run = tour.converge(attempt, lambda m: next(scores), target=0.98, max_restarts=2)
    assert len(models) == 3 and not run.converged
    assert run.model is models[1] and run.losses == [1.0]


def test_restarts_use_fresh_seeds_and_the_untrained_control_is_not_trained():
    cfg = tour.Config(n_pairs=2, n_keys=4, n_values=4, d_model=16, n_heads=2)
    assert cfg.train_config(3).seed == 3 and cfg.train_config(3, 1).seed != 3
    run = tour.train(cfg, seed=0, control="untrained")
    torch.manual_seed(0)
    fresh = cfg.build()
    assert not run.attempts and not run.converged and run.losses == []
    for p, q in zip(run.model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match="untrained"):
        tour.train(cfg, seed=0, control="shuffled")


def test_the_notebook_declares_the_documented_controls():
    from pathlib import Path

    from lab.core.runner import declared_controls

    nb = Path(__file__).resolve().parents[1] / "notebooks" / "00_tour.ipynb"
    assert set(declared_controls(nb)) == set(tour.CONTROLS) == {"untrained"}


def test_describe_says_how_the_model_was_reached():
    m = torch.nn.Linear(10, 100)  # 1,100 parameters
    cfg = tour.Config()
    run = tour.Trained(m, [0.5] * 3, [(0, 0.41, False), (1, 0.987, True)], True, 12.34)
    assert tour.describe(m, cfg, run) == ("1,100 parameters; converged in 2 attempt(s) of 400 steps (validation "
                                          "recall per attempt: 0.410, 0.987; trained in 12.3 s)")
    cached = tour.Trained(m, [], [(0, 0.5, True)], False)
    assert tour.describe(m, cfg, cached).endswith("NOT converged in 1 attempt(s) of 400 steps (validation recall "
                                                  "per attempt: 0.500; from the cache)")
    assert tour.describe(m, cfg, tour.Trained(m, []), "untrained") == ("1,100 parameters; control 'untrained': left "
                                                                       "at its random initialisation")
    assert tour.describe(m, cfg, None, name="gpt2") == "loaded gpt2: 1,100 parameters"
