import copy

import torch

from lab.data.letters import LetterRetrieval
from lab.models import hooks, tiny_llama, tiny_mamba2
from lab.models.score import choice_logprobs
from lab.widgets.heads import attention_figure, drop_figure, head_explorer, head_maps, minmax

TASK = LetterRetrieval()
EX = TASK.examples(40, torch.Generator().manual_seed(0))


def evaluate(model, tok):
    """Soft accuracy: the mean probability of the right letter among the letters (sensitive to any head)."""
    logp = choice_logprobs(model, tok, [e["prompt"] for e in EX], TASK.letters).log_softmax(1)
    right = torch.tensor([TASK.letters.index(e["answer"]) for e in EX])
    return logp.gather(1, right[:, None]).exp().mean().item()


def make():
    torch.manual_seed(0)
    V = len(TASK.tokenizer)
    transformer = tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_len=64).eval()
    mamba2 = tiny_mamba2(vocab_size=V, d_model=32, n_layers=2, head_dim=16).eval()
    return {"transformer": (transformer, TASK.tokenizer), "mamba2": (mamba2, TASK.tokenizer)}


def attention_map(model, prompt, layer, head):
    """The head's softmax attention straight from the model, min-max normalised by hand."""
    ids = TASK.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a = model(input_ids=ids, output_attentions=True).attentions[layer][0, head].float()
    return (a - a.min()) / (a.max() - a.min())


def test_explorer_follows_its_controls_and_reports_the_ablation():
    models = make()
    drops = {"transformer": torch.rand(2, 4)}
    box = head_explorer(models, [e["prompt"] for e in EX[:3]], evaluate, drops=drops)
    c = box.controls
    T = len(EX[0]["prompt"].split())
    z = torch.tensor(box.figure.data[0].z)
    assert z.shape == (T, T) and box.figure.data[0].x[0] == "0:<bos>"
    torch.testing.assert_close(z, attention_map(models["transformer"][0], EX[0]["prompt"], 0, 0))
    c["layer"].value, c["head"].value = 1, 2
    want = attention_map(models["transformer"][0], EX[0]["prompt"], 1, 2)
    torch.testing.assert_close(torch.tensor(box.figure.data[0].z), want)
    assert "L1H2: accuracy" in box.readout.value and "removed" not in box.readout.value
    base = evaluate(*models["transformer"])
    W0 = hooks.out_proj(models["transformer"][0], 1).weight.clone()
    c["ablate"].value = True
    cut_model = copy.deepcopy(models["transformer"][0])  # head 2 of layer 1 removed by hand: its 8 o_proj inputs
    with torch.no_grad():
        cut_model.model.layers[1].self_attn.o_proj.weight[:, 2 * 8:3 * 8] = 0
    cut = evaluate(cut_model, TASK.tokenizer)
    assert cut != base  # the head matters to this model, so the readout must change
    assert box.accuracy[("transformer", 1, 2, True)] == cut
    assert f"accuracy {base:.3f} → <b>{cut:.3f}</b>" in box.readout.value
    assert torch.equal(hooks.out_proj(models["transformer"][0], 1).weight, W0)  # no ablation leaks
    torch.testing.assert_close(torch.tensor(box.drop_fig.data[0].z), drops["transformer"])
    c["model"].value = "mamba2"  # an SSM: hidden attention, its own head count
    assert c["head"].max == 3 and torch.tensor(box.figure.data[0].z).shape == (T, T)
    assert box.drop_fig is None and box.children[-1].outputs == ()  # no sweep for it: the other map is gone
    c["prompt"].value = 2
    assert box.figure.data[0].y[-1].endswith(EX[2]["prompt"].split()[-1])


def test_precomputed_views():
    maps = {(0, 0): torch.eye(3), (1, 2): torch.ones(3, 3)}
    fig = attention_figure(maps, ["a", "b", "a"])
    assert len(fig.data) == 2 and [t.visible for t in fig.data] == [True, False]
    assert list(fig.data[0].x) == ["0:a", "1:b", "2:a"]
    assert [b.args[0]["visible"] for b in fig.layout.updatemenus[0].buttons] == [[True, False], [False, True]]
    assert torch.equal(torch.tensor(drop_figure(torch.zeros(2, 3)).data[0].z), torch.zeros(2, 3))
    torch.testing.assert_close(minmax(torch.tensor([-1.0, 0.0, 3.0])), torch.tensor([0.0, 0.25, 1.0]))


def test_head_maps_are_each_heads_map_on_one_prompt():
    transformer = make()["transformer"][0]
    maps, toks = head_maps(transformer, TASK.tokenizer, EX[1]["prompt"], [(1, 2), (0, 3), (1, 2)])
    assert list(maps) == [(1, 2), (0, 3)] and toks == EX[1]["prompt"].split()
    for layer, head in maps:
        torch.testing.assert_close(maps[layer, head], attention_map(transformer, EX[1]["prompt"], layer, head))
