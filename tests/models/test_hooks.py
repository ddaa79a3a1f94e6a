"""lab.models.hooks against references: plain forward hooks, the module's own forward, manual surgery."""

import pytest
import torch
from torch import nn

from lab.models import hooks, tiny_llama, tiny_mamba2, tiny_mixtral

V = 20
X = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["llama", "mixtral", "mamba2"])
def model(request):
    torch.manual_seed(0)
    build = {"llama": lambda: tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
             "mixtral": lambda: tiny_mixtral(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
             "mamba2": lambda: tiny_mamba2(vocab_size=V, d_model=32, n_layers=2, head_dim=16)}[request.param]
    return build().eval()


def logits(m):
    with torch.no_grad():
        return m(input_ids=X, use_cache=False).logits


def test_capture_inputs_and_outputs_are_what_the_blocks_see(model):
    blocks = list(hooks.layers(model))
    seen_in, seen_out = [], []  # the reference: hooks registered by hand
    h1 = [b.register_forward_pre_hook(lambda _m, a, k: seen_in.append(a[0] if a else k["hidden_states"]),
                                      with_kwargs=True) for b in blocks]
    h2 = [b.register_forward_hook(lambda _m, a, o: seen_out.append(o[0] if isinstance(o, tuple) else o))
          for b in blocks]
    want = logits(model)
    for h in h1 + h2:
        h.remove()
    with hooks.capture(model, blocks) as xs, hooks.capture(model, blocks, output=True) as ys:
        got = logits(model)
    assert torch.equal(got, want)
    assert [x[0].shape for x in xs] == [s.shape for s in seen_in]
    assert all(torch.equal(x[0], s) for x, s in zip(xs, seen_in))
    assert all(torch.equal(y[0], s) for y, s in zip(ys, seen_out))
    # the last block's output is what the final norm reads
    out, cache = hooks.run_with_cache(model, [blocks[-1]], output=True, input_ids=X, use_cache=False)
    assert torch.equal(cache[0], seen_out[-1]) and torch.equal(out.logits, want)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in blocks)  # hooks removed


def test_capture_removes_its_hooks_after_an_exception(model):
    blocks = list(hooks.layers(model))
    with pytest.raises(RuntimeError), hooks.capture(model, blocks):
        raise RuntimeError
    assert all(not b._forward_pre_hooks for b in blocks)


def test_swap_replaces_and_restores_a_submodule(model):
    name = "model.norm" if hasattr(model, "model") else "backbone.norm_f"
    original = model.get_submodule(name)
    want = logits(model)
    with hooks.swap(model, {name: nn.Identity()}):
        assert isinstance(model.get_submodule(name), nn.Identity)
        assert not torch.allclose(logits(model), want)
    assert model.get_submodule(name) is original and torch.equal(logits(model), want)
    assert hooks.name_of(model, original) == name
    with pytest.raises(ValueError):
        hooks.name_of(model, nn.Linear(1, 1))


def test_skipping_every_block_leaves_the_embedding_alone(model):
    base = getattr(model, "model", None) or model.backbone
    emb = base.embed_tokens if hasattr(base, "embed_tokens") else base.embeddings
    norm = base.norm if hasattr(base, "norm") else base.norm_f
    with torch.no_grad():
        want = model.lm_head(norm(emb(X)))
    with hooks.pruned(model, keep_layers=0):
        assert torch.allclose(logits(model), want, atol=1e-6)
    assert not any(isinstance(b, hooks.Skip) for b in hooks.layers(model))


def test_layers_of_a_model_without_blocks_is_one_sentence():
    with pytest.raises(TypeError, match="no decoder blocks"):
        hooks.layers(nn.Linear(2, 2))
