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
