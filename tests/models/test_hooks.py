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
    with hooks.capture(blocks) as xs, hooks.capture(blocks, output=True) as ys:
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
    with pytest.raises(RuntimeError), hooks.capture(blocks):
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


# ------------------------------------------------------------------- head ablation (the G&A operator)

def head_models():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    mamba1 = MambaForCausalLM(MambaConfig(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2,
                                          expand=2, use_mambapy=False))
    return {"llama": tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
            "mixtral": tiny_mixtral(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
            "mamba2": tiny_mamba2(vocab_size=V, d_model=32, n_layers=2, head_dim=16),
            "mamba1": mamba1}


MODELS = head_models()
X9 = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))


def logits9(model):
    with torch.no_grad():
        return model(input_ids=X9, use_cache=False).logits


def manual_zero_head(model, layer, heads):
    """Zero the heads' slices of the output projection's *input* with a hook: the reference."""
    H, d_head = hooks.head_shape(model, layer)

    def hook(_, args):
        (x,) = args
        x = x.clone().view(*x.shape[:-1], H, d_head)
        x[..., heads, :] = 0
        return (x.view(*x.shape[:-2], H * d_head),)

    return hooks.out_proj(model, layer).register_forward_pre_hook(hook)


@pytest.mark.parametrize("name", list(MODELS))
def test_head_shapes(name):
    m = MODELS[name]
    H, d_head = hooks.head_shape(m, 0)
    assert H * d_head == hooks.out_proj(m, 0).in_features
    assert {"llama": (4, 8), "mixtral": (4, 8), "mamba2": (4, 16), "mamba1": (32, 1)}[name] == (H, d_head)


@pytest.mark.parametrize("name", list(MODELS))
def test_ablation_equals_zeroing_the_heads_output(name):
    m = MODELS[name].eval()
    heads = [1, 2]
    handle = manual_zero_head(m, 1, heads)
    want = logits9(m)
    handle.remove()
    with hooks.ablate_heads(m, {1: heads}):
        got = logits9(m)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, logits9(m))  # and it did change something


@pytest.mark.parametrize("name", list(MODELS))
def test_keep_and_remove_are_complements_and_restore_exactly(name):
    m = MODELS[name]
    W0 = {l: hooks.out_proj(m, l).weight.detach().clone() for l in (0, 1)}
    heads = {0: [0], 1: [1, 3]}
    with hooks.ablate_heads(m, heads):
        removed = {l: hooks.out_proj(m, l).weight.detach().clone() for l in heads}
    with hooks.ablate_heads(m, heads, keep=True):
        kept = {l: hooks.out_proj(m, l).weight.detach().clone() for l in heads}
    for l in heads:
        assert torch.equal(removed[l] + kept[l], W0[l])  # complementary masks: exact inverse pair
        assert torch.equal(hooks.out_proj(m, l).weight, W0[l])  # restored bit for bit
    with pytest.raises(RuntimeError), hooks.ablate_heads(m, {1: [0]}):
        raise RuntimeError("restored even on error")
    assert torch.equal(hooks.out_proj(m, 1).weight, W0[1])
    with pytest.raises(IndexError):
        with hooks.ablate_heads(m, {0: [99]}):
            pass


def test_pruned_keeps_the_first_blocks_and_restores():
    m = MODELS["llama"].eval()
    full = logits9(m)
    with hooks.pruned(m, keep_layers=1):
        one = logits9(m)
    # reference: the residual stream after the first block, then the final norm and the head
    with torch.no_grad():
        after_first = m.model(input_ids=X9, output_hidden_states=True, use_cache=False).hidden_states[1]
        torch.testing.assert_close(one, m.lm_head(m.model.norm(after_first)))
    assert not torch.allclose(one, full)
    torch.testing.assert_close(logits9(m), full)  # restored
    with hooks.pruned(m, skip=1):  # skipping the last block is the same as keeping the first
        torch.testing.assert_close(logits9(m), one)


def test_all_heads_silences_the_layer():
    m = MODELS["mamba2"].eval()
    H, _ = hooks.head_shape(m, 1)
    assert hooks.all_heads(m, 1) == {1: list(range(H))}
    with hooks.ablate_heads(m, hooks.all_heads(m, 1)):
        assert hooks.out_proj(m, 1).weight.abs().sum() == 0


# ------------------------------------------------------------------------------ rows zeroed (hybrids)

def _attention_last_row_zeroed(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention by hand, with the last query row of every head's matrix set to zero after the softmax."""
    w = (query @ key.transpose(-1, -2)) * scaling  # (B, H, T, S)
    T, S = w.shape[-2:]
    w = w.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(S - T + 1), float("-inf")).softmax(-1).clone()
    w[:, :, -1] = 0
    return (w @ value).transpose(1, 2).contiguous(), w


@pytest.mark.parametrize("name", ["hybrid", "llama"])
def test_zero_rows_equals_the_attention_rows_zeroed_after_the_softmax(name):
    from transformers import AttentionInterface

    from lab.models import tiny_hybrid

    AttentionInterface.register("lab_test_last_row_zeroed", _attention_last_row_zeroed)
    torch.manual_seed(0)
    m = (tiny_hybrid(vocab_size=V, d_model=32, layout="MA") if name == "hybrid"
         else tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4)).eval()
    attention = [i for i in range(len(hooks.layers(m))) if hooks.is_attention(m, i)]
    assert attention == ([1] if name == "hybrid" else [0, 1])
    full = logits(m)
    with hooks.zero_rows(m, attention):
        got = logits(m)
    m.set_attn_implementation("lab_test_last_row_zeroed")
    try:
        want = logits(m)
    finally:
        m.set_attn_implementation("eager")
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got[:, -1], full[:, -1])
    torch.testing.assert_close(got[:, :-1], full[:, :-1])  # causal: no earlier position sees the last row
    torch.testing.assert_close(logits(m), full)  # the hooks are gone


def test_zero_rows_silences_an_ssm_mixer_at_those_positions_only():
    from lab.models import tiny_hybrid

    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=V, d_model=32, layout="MMA").eval()
    assert [hooks.is_attention(m, i) for i in range(3)] == [False, False, True]
    with hooks.capture([hooks.mixer(m, 1)], output=True) as full:
        logits(m)
    with hooks.zero_rows(m, [1], positions=[2, -1]), hooks.capture([hooks.out_proj(m, 1)], output=True) as cut:
        logits(m)
    y, y_cut = full[0][0], cut[0][0]
    assert y_cut[:, [2, -1]].abs().sum() == 0 and y[:, [2, -1]].abs().sum() > 0
    keep = [t for t in range(X.shape[1]) if t not in (2, X.shape[1] - 1)]
    torch.testing.assert_close(y_cut[:, keep], y[:, keep])


@pytest.mark.parametrize("family", ["jamba", "granitemoehybrid"])
def test_hybrid_checkpoint_families_have_readable_mixers(family):
    """A checkpoint's hybrid blocks: which are attention, and the answer row masked on each."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, mamba_d_state=8)
    m = (tf.JambaForCausalLM(tf.JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                                            mamba_dt_rank=4)) if family == "jamba" else
         tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
             **common, layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=64,
             mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2))).eval()
    assert [hooks.is_attention(m, i) for i in range(2)] == [False, True]
    full = logits(m)
    for layer in (0, 1):
        with hooks.zero_rows(m, [layer]):
            cut = logits(m)
        torch.testing.assert_close(cut[:, :-1], full[:, :-1])
        assert not torch.allclose(cut[:, -1], full[:, -1])


def test_pruned_blocks_return_what_their_model_unpacks():
    """Bamba's blocks return (hidden states, attention weights) and its loop unpacks two values: a skipped block
    must as well (a bare tensor would be unpacked along the batch, silently for a batch of 2, as X is)."""
    from lab.models import tiny_hybrid

    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=V, d_model=32, layout="MAM").eval()
    with torch.no_grad():
        after_first = m.model(input_ids=X, output_hidden_states=True, use_cache=False).hidden_states[1]
        want = m.lm_head(m.model.final_layernorm(after_first))
    with hooks.pruned(m, keep_layers=1):
        torch.testing.assert_close(logits(m), want)
    assert hooks.Skip.n_out[type(m.model.layers[0])] == 2
    llama = tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4).eval()
    with hooks.pruned(llama, skip=1):
        logits(llama)
    assert hooks.Skip.n_out[type(llama.model.layers[0])] == 0
