"""The adaptation loops shared by every arm (`lab.adapt.loop`), run with TLM's objective and adapter."""

import copy

import pytest
import torch

from lab.adapt import loop as L
from lab.adapt import tlm as T
from tests.adapt.tiny import V, model


def test_lora_adaptation_skips_unselected_inputs_and_leaves_the_base_intact():
    m = T.add_lora(model())
    W0 = {n: p.clone() for n, p in m.named_parameters() if "lora" not in n}
    assert all("lora" in n for n, p in m.named_parameters() if p.requires_grad)
    inputs = [torch.randint(V, (1, 10), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    with torch.no_grad():
        ce0 = [T.sample_ce(m, x).item() for x in inputs]
    threshold = sorted(ce0)[3]  # the two highest-CE inputs are selected
    objective = T.tlm_objective(threshold=threshold, lamb=0.1, base_ce=lambda x: T.sample_ce(m, x).detach())
    log = L.adapt(m, inputs, objective, lr=1e-2)
    assert sum(log.selected) == 2 and log.backward_passes == 2
    assert [loss is None for loss in log.losses] == [not s for s in log.selected]
    official = L.adapt(T.add_lora(model()), inputs, T.tlm_objective(threshold=threshold), lr=1e-2,
                       skip_unselected=False)
    assert official.backward_passes == len(inputs)  # the repo back-propagates zero losses too
    assert all(torch.equal(W0[n], p) for n, p in m.named_parameters() if "lora" not in n)
    with m.disable_adapter(), torch.no_grad():
        assert [T.sample_ce(m, x).item() for x in inputs] == pytest.approx(ce0)


def test_perplexity_minimisation_lowers_the_inputs_perplexity_and_probes_run():
    m = T.add_lora(model(), targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    x = torch.randint(V, (1, 12), generator=torch.Generator().manual_seed(0))
    before = T.sample_ce(m, x).item()
    log = L.adapt(m, [x] * 30, T.tlm_objective(sel=False), lr=1e-2, probe=lambda: {"ce": T.sample_ce(m, x).item()},
                  every=10)
    assert T.sample_ce(m, x).item() < before - 0.5
    assert [c["step"] for c in log.checkpoints] == [0, 10, 20, 30] and log.checkpoints[0]["ce"] == pytest.approx(before)


def test_online_predicts_each_chunk_before_training_on_it():
    m = T.add_lora(model())
    inputs = [torch.randint(V, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    seen = []

    def predict(part):
        seen.append(len(part))
        return [T.sample_ce(m, x).item() for x in part]

    preds, log = L.adapt_online(m, inputs, T.tlm_objective(threshold=0.0), chunk=2, lr=1e-2, predict=predict)
    assert seen == [2, 2, 1] and len(preds) == 5 and log.backward_passes == 5
    assert preds[0] == pytest.approx(T.sample_ce(T.add_lora(model()), inputs[0]).item())  # before any update


def test_online_uses_a_fresh_optimizer_per_chunk_as_the_official_online_mode():
    """Reference: a hand-written loop, a new AdamW for each chunk (the official code builds a new trainer per
    chunk); one AdamW kept across chunks (the old behaviour) ends elsewhere."""
    inputs = [torch.randint(V, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    torch.manual_seed(1)
    m = T.add_lora(model())
    ref = copy.deepcopy(m)
    L.adapt_online(m, inputs, T.tlm_objective(sel=False), chunk=3, lr=1e-2, predict=lambda part: [])
    params = [p for p in ref.parameters() if p.requires_grad]
    for start in (0, 3):
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        for x in inputs[start:start + 3]:
            ref(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
