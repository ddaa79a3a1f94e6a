import torch

from lab import tour
from lab.core import ClaimFailed, check


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
    try:
        check("the tour's recall claim on the untrained baseline", acc0, ">=", 0.9)
        raise AssertionError("the claim must fail on the baseline")
    except ClaimFailed:
        pass
