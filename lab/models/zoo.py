"""Tiny models built from `transformers` configs, offline, in milliseconds.

Each builder takes keyword-only sizes and returns a randomly initialised `*ForCausalLM`; full scale
loads real checkpoints of the same families with `lab.models.load_model`, so notebook code that
works on the toy works on the checkpoint. Attention is `eager` so attention weights can be read.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    BambaConfig,
    BambaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)


def tiny_llama(*, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
               d_ff: int | None = None, max_len: int = 128, rope: bool = True) -> LlamaForCausalLM:
    """Llama-style dense decoder (RMSNorm, RoPE, SwiGLU MLP of width `d_ff`, default 4·d_model).

    `rope=False` gives a NoPE model (no positional encoding; the causal mask still orders tokens):
    RoPE with positions scaled by 1e-9, a config-level setting that survives save/load."""
    no_rope = {"rope_type": "linear", "factor": 1e9, "rope_theta": 10000.0}
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff or 4 * d_model,
                      num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                      max_position_embeddings=max_len, tie_word_embeddings=False,
                      attn_implementation="eager", **({} if rope else {"rope_parameters": no_rope}))
    return LlamaForCausalLM(cfg)


def tiny_mixtral(*, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 d_ff: int | None = None, n_experts: int = 4, top_k: int = 2,
                 max_len: int = 128) -> MixtralForCausalLM:
    """Mixtral-style sparse MoE decoder: `n_experts` SwiGLU experts of width `d_ff`, top-`top_k` routing.

    transformers 5.x stores the experts fused: `mlp.experts.gate_up_proj` (E, 2·d_ff, d_model) and
    `mlp.experts.down_proj` (E, d_model, d_ff); the router is `mlp.gate`.
    """
    cfg = MixtralConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff or 2 * d_model,
                        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                        num_local_experts=n_experts, num_experts_per_tok=top_k, max_position_embeddings=max_len,
                        tie_word_embeddings=False, attn_implementation="eager")
    return MixtralForCausalLM(cfg)


def tiny_qwen2_moe(*, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                   d_ff: int | None = None, n_experts: int = 4, top_k: int = 2, d_shared: int | None = None,
                   max_len: int = 128) -> Qwen2MoeForCausalLM:
    """Qwen-MoE-style sparse decoder: `n_experts` routed SwiGLU experts of width `d_ff` (top-`top_k`, renormalised)
    plus a shared expert of width `d_shared` (default 2·d_ff) behind a sigmoid gate, in every layer.

    Fused experts as in Mixtral (`mlp.experts.gate_up_proj`, `down_proj`), router `mlp.gate`, shared expert
    `mlp.shared_expert` with `mlp.shared_expert_gate`; the expert count is `config.num_experts`.
    """
    d_ff = d_ff or 2 * d_model
    cfg = Qwen2MoeConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_shared or 2 * d_ff,
                         moe_intermediate_size=d_ff, shared_expert_intermediate_size=d_shared or 2 * d_ff,
                         num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                         num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                         decoder_sparse_step=1, max_position_embeddings=max_len, tie_word_embeddings=False,
                         attn_implementation="eager")
    return Qwen2MoeForCausalLM(cfg)


def tiny_mamba2(*, vocab_size: int, d_model: int = 64, n_layers: int = 2, d_state: int = 16,
                head_dim: int = 16, expand: int = 2, chunk_size: int = 16) -> Mamba2ForCausalLM:
    """Mamba-2 SSM (selective state space, one group); expand·d_model = n_heads·head_dim.

    On CPU transformers uses its reference PyTorch scan (no `mamba_ssm` kernels): correct, slower.
    """
    n_heads, rest = divmod(expand * d_model, head_dim)
    if rest:
        raise ValueError(f"head_dim={head_dim} must divide expand*d_model={expand * d_model}.")
    cfg = Mamba2Config(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, state_size=d_state,
                       expand=expand, head_dim=head_dim, num_heads=n_heads, n_groups=1, chunk_size=chunk_size,
                       tie_word_embeddings=False)
    return Mamba2ForCausalLM(cfg)


def tiny_hybrid(*, vocab_size: int, d_model: int = 64, layout: str = "MMA", n_heads: int = 4, head_dim: int = 16,
                d_state: int = 16, expand: int = 2, d_ff: int | None = None, chunk_size: int = 16) -> BambaForCausalLM:
    """Mamba-2/attention hybrid, one letter of `layout` per block: M a Mamba-2 mixer (SSD heads of `head_dim`, as
    `tiny_mamba2`), A Llama-style attention (RoPE, `n_heads`); every block has a SwiGLU MLP of width `d_ff`
    (default 2·d_model). transformers' Bamba classes (IBM's Mamba-2 hybrid; Zamba2 and Jamba interleave the same
    way), eager attention."""
    if not layout or set(layout) - {"M", "A"}:
        raise ValueError(f"layout={layout!r} must be a string of M (Mamba-2) and A (attention) blocks.")
    n_ssm_heads, rest = divmod(expand * d_model, head_dim)
    if rest:
        raise ValueError(f"head_dim={head_dim} must divide expand*d_model={expand * d_model}.")
    cfg = BambaConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=len(layout),
                      attn_layer_indices=[i for i, c in enumerate(layout) if c == "A"], num_attention_heads=n_heads,
                      num_key_value_heads=n_heads, intermediate_size=d_ff or 2 * d_model, mamba_n_heads=n_ssm_heads,
                      mamba_d_head=head_dim, mamba_d_state=d_state, mamba_n_groups=1, mamba_expand=expand,
                      mamba_chunk_size=chunk_size, tie_word_embeddings=False, attn_implementation="eager")
    return BambaForCausalLM(cfg)


ZOO: dict[str, Callable[..., PreTrainedModel]] = {
    "llama": tiny_llama,
    "mixtral": tiny_mixtral,
    "mamba2": tiny_mamba2,
    "qwen2_moe": tiny_qwen2_moe,
}


def build(family: str, **sizes) -> PreTrainedModel:
    """`build("llama", vocab_size=32)`: a tiny model of a zoo family by name."""
    if family not in ZOO:
        raise ValueError(f"family={family!r} is not in the zoo; use one of {', '.join(map(repr, ZOO))}.")
    return ZOO[family](**sizes)
