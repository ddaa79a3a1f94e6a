"""The pruned-Llama model class that Olica's output lives in (He & Lin, ICML 2025; official code BetterTMrR/LLM-Olica).

A plain `LlamaForCausalLM` cannot hold what Olica produces: after V/O pruning every head keeps d_v' < d_h value
channels while Q/K keep d_h; Q and K become a rank-r product d → r → H·d_h (weighted SVD under RoPE); a pruned FFN has
its own width per layer; and a linearly calibrated FFN carries an extra low-rank term x·W1·W2. The official code
stores the per-layer sizes in the config (`utils.utils.get_config`) and rebuilds the modules on load
(`utils/customized_llama.py`, transformers 4.31). Here the same idea is a subclass:

- `OlicaLlamaConfig(LlamaConfig)`, `model_type="olica_llama"`, with per-layer lists `qk_ranks` (0: full Q/K),
  `v_head_dims`, `intermediate_sizes`, `lc_ranks` (0: no calibration term), and `out_bias` (o_proj and down_proj
  carry a bias: FLAP's compensation for the pruned channels' mean);
- `OlicaLlamaForCausalLM(LlamaForCausalLM)`, whose attention reshapes V with its own head width (eager and SDPA
  attention both accept a value width different from the Q/K width) and whose MLP adds the LC term.

Importing this module registers both with `AutoConfig` / `AutoModelForCausalLM`, so after `import lab.compress.olica`
`AutoModelForCausalLM.from_pretrained(folder)` reloads a pruned model (a fresh process must import it first: the
class is not a transformers built-in). Everything else (embeddings, norms, RoPE, generation) is Llama's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaMLP,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


class OlicaLlamaConfig(LlamaConfig):
    """A `LlamaConfig` plus Olica's per-layer sizes (None: the dense size in every layer)."""

    model_type = "olica_llama"

    def __init__(self, qk_ranks=None, v_head_dims=None, intermediate_sizes=None, lc_ranks=None, out_bias=False, **kw):
        super().__init__(**kw)
        self.out_bias = bool(out_bias)
        L, dh = self.num_hidden_layers, self.hidden_size // self.num_attention_heads
        self.qk_ranks = list(qk_ranks or [0] * L)
        self.v_head_dims = list(v_head_dims or [getattr(self, "head_dim", None) or dh] * L)
        self.intermediate_sizes = list(intermediate_sizes or [self.intermediate_size] * L)
        self.lc_ranks = list(lc_ranks or [0] * L)


def low_rank(d_in: int, r: int, d_out: int, bias: bool = False) -> nn.Sequential:
    """x ↦ x·W1ᵀ·W2ᵀ: `[0]` is W1 (r, d_in), `[1]` is W2 (d_out, r) (the official `SVDLinearForWidth`)."""
    return nn.Sequential(nn.Linear(d_in, r, bias=False), nn.Linear(r, d_out, bias=bias))


class OlicaAttention(LlamaAttention):
    """Llama attention with Q/K as rank-r products (when `qk_ranks[i]` > 0) and value heads of width d_v'."""

    def __init__(self, config: OlicaLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, H, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        r, self.v_head_dim = config.qk_ranks[layer_idx], config.v_head_dims[layer_idx]
        if r:
            self.q_proj = low_rank(d, r, H * self.head_dim, bias)
            self.k_proj = low_rank(d, r, config.num_key_value_heads * self.head_dim, bias)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * self.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(H * self.v_head_dim, d, bias=bias or config.out_bias)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        k = self.k_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        v = self.v_proj(hidden_states).view(*shape, -1, self.v_head_dim).transpose(1, 2)  # (B, H, T, d_v')
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights  # (B, T, H·d_v') -> (B, T, d)


class OlicaMLP(LlamaMLP):
    """SwiGLU MLP of width `intermediate_sizes[i]`, plus the linear-calibration term x·W1·W2 when `lc_ranks[i]` > 0."""

    def __init__(self, config: OlicaLlamaConfig, layer_idx: int):
        super().__init__(config)
        d, F, bias = config.hidden_size, config.intermediate_sizes[layer_idx], config.mlp_bias
        self.intermediate_size = F
        self.gate_proj, self.up_proj = nn.Linear(d, F, bias=bias), nn.Linear(d, F, bias=bias)
        self.down_proj = nn.Linear(F, d, bias=bias or config.out_bias)
        r = config.lc_ranks[layer_idx]
        self.lc = low_rank(d, r, d) if r else None

    def forward(self, x):
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return y if self.lc is None else y + self.lc(x)


class OlicaLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose blocks have Olica's per-layer sizes (see the module docstring)."""

    config_class = OlicaLlamaConfig

    def __init__(self, config: OlicaLlamaConfig):
        super().__init__(config)
        for i, block in enumerate(self.model.layers):
            block.self_attn = OlicaAttention(config, i)
            block.mlp = OlicaMLP(config, i)
        self.post_init()


AutoConfig.register("olica_llama", OlicaLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(OlicaLlamaConfig, OlicaLlamaForCausalLM, exist_ok=True)


def from_llama(model: LlamaForCausalLM) -> OlicaLlamaForCausalLM:
    """The same network as an `OlicaLlamaForCausalLM` at dense sizes (same weights, same logits)."""
    cfg = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        cfg.pop(key, None)
    if cfg.get("num_key_value_heads", cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
        raise ValueError("Olica (like its official code) needs num_key_value_heads == num_attention_heads (no GQA).")
    p = next(model.parameters())
    new = OlicaLlamaForCausalLM(OlicaLlamaConfig(**cfg)).to(device=p.device, dtype=p.dtype)
    new.load_state_dict(model.state_dict())
    new.config._attn_implementation = model.config._attn_implementation
    return new.eval()


def sync_config(model: OlicaLlamaForCausalLM) -> OlicaLlamaConfig:
    """Write the modules' actual sizes into the config (the official `get_config`), so a save reloads."""
    c = model.config
    for i, block in enumerate(model.model.layers):
        a, m = block.self_attn, block.mlp
        c.qk_ranks[i] = a.q_proj[0].out_features if isinstance(a.q_proj, nn.Sequential) else 0
        c.v_head_dims[i] = a.v_head_dim
        c.intermediate_sizes[i] = m.gate_proj.out_features
        c.lc_ranks[i] = 0 if m.lc is None else m.lc[0].out_features
    c.out_bias = any((blk.self_attn.o_proj.bias is not None and not c.attention_bias)
                     or (blk.mlp.down_proj.bias is not None and not c.mlp_bias) for blk in model.model.layers)
    return c


def n_params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def param_table(model: nn.Module) -> dict[str, dict[str, int]]:
    """Parameters per module kind and layer: {"layer i": {q, k, v, o, mlp, lc}, "other": {...}, "total": ...}."""
    rows = {}
    for i, block in enumerate(model.model.layers):
        a, m = block.self_attn, block.mlp
        rows[f"layer {i}"] = {"q": n_params(a.q_proj), "k": n_params(a.k_proj), "v": n_params(a.v_proj),
                              "o": n_params(a.o_proj),
                              "mlp": n_params(m.gate_proj) + n_params(m.up_proj) + n_params(m.down_proj),
                              "lc": n_params(getattr(m, "lc", None)),
                              "norms": n_params(block.input_layernorm) + n_params(block.post_attention_layernorm)}
    total = n_params(model)
    rows["other"] = {"embeddings + head + final norm": total - sum(sum(r.values()) for r in rows.values())}
    rows["total"] = {"all": total}
    return rows


@torch.no_grad()
def set_linear(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A new `nn.Linear` holding `weight` (out, in) (and `bias`), on `lin`'s device and dtype."""
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=lin.weight.device,
                    dtype=lin.weight.dtype)
    new.weight.copy_(weight)
    if bias is not None:
        new.bias.copy_(bias)
    return new
