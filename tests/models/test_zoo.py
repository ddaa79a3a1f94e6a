import pytest
import torch

from lab.models import ZOO, build, tiny_llama, tiny_mamba2, tiny_mixtral


@pytest.mark.parametrize("family", list(ZOO))
def test_each_family_runs_forward_and_backward(family):
    torch.manual_seed(0)
    m = build(family, vocab_size=20, d_model=32, n_layers=1)
    x = torch.randint(0, 20, (2, 8))
    out = m(input_ids=x, labels=x)
    assert out.logits.shape == (2, 8, 20)
    out.loss.backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_sizes_are_keyword_only_and_honoured():
    with pytest.raises(TypeError):
        tiny_llama(20)
    m = tiny_llama(vocab_size=20, d_model=48, n_layers=3, n_heads=6, d_ff=100)
    c = m.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (48, 3, 6, 100)
    assert c._attn_implementation == "eager"


def test_mixtral_experts_are_fused():
    m = tiny_mixtral(vocab_size=20, d_model=32, n_layers=1, n_experts=4, d_ff=24)  # 2·d_ff ≠ d_model ≠ d_ff
    experts = m.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 24, 32)  # (E, 2F, H): gate rows, then up rows
    assert experts.down_proj.shape == (4, 32, 24)  # (E, H, F)


def test_mamba2_head_dim_must_divide():
    assert tiny_mamba2(vocab_size=20, d_model=32, head_dim=16).config.num_heads == 4
    with pytest.raises(ValueError, match="must divide"):
        tiny_mamba2(vocab_size=20, d_model=32, head_dim=24)


def test_unknown_family():
    with pytest.raises(ValueError, match="not in the zoo"):
        build("gpt5", vocab_size=10)


def test_eager_attention_is_exposed():
    m = tiny_llama(vocab_size=20, d_model=32, n_layers=2, n_heads=4)
    att = m(input_ids=torch.randint(0, 20, (1, 6)), output_attentions=True).attentions
    assert len(att) == 2 and att[0].shape == (1, 4, 6, 6)
    torch.testing.assert_close(att[0].sum(-1), torch.ones(1, 4, 6))
    assert torch.all(att[0].triu(1) == 0)  # causal


def test_nope_llama_ignores_position_and_survives_save_load(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = tiny_llama(vocab_size=20, d_model=32, n_layers=1, n_heads=2, rope=False).eval()
    # with no positional encoding, the first query attends equally to identical earlier tokens
    x = torch.tensor([[5, 5, 5, 7]])
    att = m(input_ids=x, output_attentions=True).attentions[0][0, :, 3, :3]  # (H, 3)
    torch.testing.assert_close(att, att[:, :1].expand(-1, 3))
    m.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(again(input_ids=x).logits, m(input_ids=x).logits)
    with_rope = tiny_llama(vocab_size=20, d_model=32, n_layers=1, n_heads=2).eval()
    att = with_rope(input_ids=x, output_attentions=True).attentions[0][0, :, 3, :3]
    assert not torch.allclose(att, att[:, :1].expand(-1, 3))


class _OldCacheApi(torch.nn.Module):
    """A model as transformers 5.0–5.1x exposes it: the KV cache only as `past_key_values` (argument and output)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        out = self.model(input_ids=input_ids, cache=past_key_values, use_cache=use_cache)
        return type("Out", (), {"logits": out.logits, "past_key_values": out.cache})()


@pytest.mark.parametrize("old_api", [False, True])
def test_cached_step_decodes_as_the_full_forward_on_either_cache_api(old_api):
    from lab.models.sample import cached_step

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=30, d_model=32, n_layers=2, n_heads=4, d_ff=48, n_experts=4).eval()
    ids = torch.randint(30, (1, 7))
    m = _OldCacheApi(model) if old_api else model
    with torch.no_grad():
        full = model(input_ids=ids).logits[0]
        past, steps = None, []
        for t in range(ids.shape[1]):
            out, past = cached_step(m, ids[:, t:t + 1], past)
            steps.append(out.logits[0, -1])
    assert past is not None
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-4, atol=1e-4)


def test_hybrid_layout_places_attention_and_mamba2_blocks():
    from lab.models import tiny_hybrid

    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=20, d_model=32, layout="MMA", n_heads=2, head_dim=16)
    kinds = ["A" if hasattr(b, "self_attn") else "M" for b in m.model.layers]
    assert kinds == ["M", "M", "A"] and m.config._attn_implementation == "eager"
    assert m.model.layers[0].mamba.num_heads == 4 and m.config.intermediate_size == 64
    x = torch.randint(0, 20, (2, 8))
    out = m(input_ids=x, labels=x)
    out.loss.backward()
    assert out.logits.shape == (2, 8, 20) and all(p.grad is not None for p in m.parameters())
    for bad in ("", "MXA"):
        with pytest.raises(ValueError, match="layout"):
            tiny_hybrid(vocab_size=20, layout=bad)
