"""Hadamard rotations of a Llama-family model (QuaRot / SpinQuant / RoSTE): fast Walsh–Hadamard transform,
RMSNorm folding, and the offline rotations R1 (residual stream), R2 (per head, v/o) and R4's weight side.

A random Hadamard Q = Diag(s)·H_n/√n (H_n the Sylvester matrix, s random signs; QuIP#-style, RoSTE Sec. 3.2) is
orthogonal, so for an RMSNorm without gain RMSNorm(xQ) = RMSNorm(x)·Q, and rotating every weight that reads from
or writes to the residual stream leaves the network's function unchanged (computational invariance, QuaRot
Sec. 4; RoSTE Eq. 5 is exact when Q = identity). Official code: Hong-Lab-UMN-ECE/RoSTE
(`rotation_utils/fuse_norm.py`, `rotation_utils/rotation.py`, `rotate_model_r1.py`). The rotations are done in
float64 and cast back, as there. `x @ Q` on the last dim runs through `fwht` in torch (any device), or through
the `fast-hadamard-transform` CUDA kernel when it is installed and the tensor is on CUDA.

The second half builds the rotated, fake-quantized model RoSTE trains (`quantize_model`): `QuantLinear`
(Q_x(x·R4?)·Q_w(W)ᵀ with the STE quantizer of `lab.compress.quant.fake_quant`) and the attention implementation
"roste" (R3 on q and k after RoPE, per-token-and-head KV-cache quantizer, then transformers' eager attention).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lab.compress.quant import fake_quant

KINDS = ("R2", "R3", "R4")

try:  # optional GPU extra (Dao-AILab/fast-hadamard-transform)
    from fast_hadamard_transform import hadamard_transform as _cuda_hadamard
except ImportError:  # pragma: no cover - absent on CPU machines
    _cuda_hadamard = None


def fwht(x: Tensor) -> Tensor:
    """x @ H_n / √n over the last dim (n a power of 2) by the butterfly: O(n log n), Sylvester ordering
    (`scipy.linalg.hadamard`), so fwht(fwht(x)) = x."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last dim must be a power of 2 for the Walsh–Hadamard transform, got {n}.")
    shape, y, h = x.shape, x.reshape(-1, n), 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(shape) / math.sqrt(n)


def hadamard(x: Tensor, signs: Tensor | None = None, *, backend: str = "auto") -> Tensor:
    """x @ Q with Q = Diag(signs)·H/√n (signs None: the plain normalised Hadamard). `backend`: "torch" (`fwht`),
    "cuda" (`fast-hadamard-transform`), "auto" (cuda when installed and x is on CUDA)."""
    if signs is not None:
        x = x * signs.to(x.dtype)
    if backend == "cuda" or (backend == "auto" and _cuda_hadamard is not None and x.is_cuda):
        if _cuda_hadamard is None:
            raise RuntimeError("backend='cuda' needs the optional `fast-hadamard-transform` package.")
        return _cuda_hadamard(x.contiguous(), scale=1 / math.sqrt(x.shape[-1]))
    return fwht(x)


def online(x: Tensor, signs: Tensor) -> Tensor:
    """x·Q for an online rotation (R3, R4): a dense matmul for n ≤ 1024 (faster than the butterfly on CPU at
    these sizes; the matrix is cached on the signs tensor), else `hadamard` (fwht or the CUDA kernel)."""
    if x.shape[-1] > 1024:
        return hadamard(x, signs.to(x.device))
    Q = getattr(signs, "_dense", None)
    if Q is None or Q.device != x.device or Q.dtype != x.dtype:
        Q = signs._dense = matrix(signs).to(device=x.device, dtype=x.dtype)
    return x @ Q


def random_signs(n: int, generator: torch.Generator) -> Tensor:
    return torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1


def matrix(signs: Tensor) -> Tensor:
    """The dense Q = Diag(signs)·H/√n (float64)."""
    return hadamard(torch.eye(len(signs), dtype=torch.float64), signs.double())


# ------------------------------------------------------------------------ norm folding and untying

def _set(lin: nn.Linear, W: Tensor) -> None:
    lin.weight.data = W.to(lin.weight.dtype).contiguous()


@torch.no_grad()
def untie(model: nn.Module) -> None:
    """Give lm_head its own copy of the embedding (tied models: Qwen2.5-0.5B, Llama-3.2), so that rotating one
    does not rotate the other twice."""
    if model.lm_head.weight is model.model.embed_tokens.weight or model.config.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.config.tie_word_embeddings = False


@torch.no_grad()
def fuse_norms(model: nn.Module) -> nn.Module:
    """RMSNorm gains g folded into the columns of the linears that read the normed stream (W ← W·Diag(g)):
    input_layernorm → q/k/v, post_attention_layernorm → gate/up, the final norm → lm_head; gains set to 1 and
    frozen. Function unchanged; untied first."""
    untie(model)
    pairs = [(layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
             for layer in model.model.layers]
    pairs += [(layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj])
              for layer in model.model.layers]
    pairs.append((model.model.norm, [model.lm_head]))
    for norm, lins in pairs:
        g = norm.weight.double()
        for lin in lins:
            _set(lin, lin.weight.double() * g)
        norm.weight.data.fill_(1.0)
        norm.weight.requires_grad_(False)
    return model


# ------------------------------------------------------------------------ R1, R2, R4 (offline parts)

@torch.no_grad()
def rotate_r1(model: nn.Module, Q: Tensor, *, wrong_side: bool = False) -> nn.Module:
    """R1 merged into the residual stream (norms must be fused first): embedding E ← E·Q, readers (q/k/v,
    gate/up, lm_head) W ← W·Q, writers (o, down) W ← Qᵀ·W. `wrong_side` (a known-wrong control) multiplies the
    readers by Qᵀ instead, which breaks the invariance."""
    copies = {}  # Q on each device the weights live on (a model loaded with device_map="auto" spans several)
    on = lambda w: copies[w.device] if w.device in copies else copies.setdefault(w.device, Q.double().to(w.device))
    R = (lambda w: on(w).T) if wrong_side else on
    emb = model.model.embed_tokens
    emb.weight.data = (emb.weight.double() @ on(emb.weight)).to(emb.weight.dtype)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            _set(lin, lin.weight.double() @ R(lin.weight))
        for lin in (a.o_proj, m.down_proj):
            _set(lin, on(lin.weight).T @ lin.weight.double())
            if lin.bias is not None:
                lin.bias.data = (lin.bias.double() @ on(lin.bias)).to(lin.bias.dtype)
    _set(model.lm_head, model.lm_head.weight.double() @ R(model.lm_head.weight))
    return model


@torch.no_grad()
def rotate_r2(attn: nn.Module, Qh: Tensor) -> None:
    """R2 (head_dim × head_dim, shared by all heads): every value head v_h ← v_h·Qh (rows of v_proj: W_h ← Qhᵀ·W_h)
    and undone inside o_proj (its columns of head h: W ← W·Qh), so o_proj's input is the rotated one."""
    Qh = Qh.double().to(attn.v_proj.weight.device)
    dh = Qh.shape[0]
    Wv = attn.v_proj.weight.double()
    _set(attn.v_proj, (Qh.T @ Wv.view(-1, dh, Wv.shape[1])).reshape_as(Wv))
    if attn.v_proj.bias is not None:
        attn.v_proj.bias.data = (attn.v_proj.bias.double().view(-1, dh) @ Qh).reshape(-1).to(attn.v_proj.bias.dtype)
    Wo = attn.o_proj.weight.double()
    _set(attn.o_proj, (Wo.view(Wo.shape[0], -1, dh) @ Qh).reshape_as(Wo))


@torch.no_grad()
def fuse_r4_weight(mlp: nn.Module, Q4: Tensor) -> None:
    """R4's weight side: W_down ← W_down·Q4; the activation side (u ← u·Q4) runs online before down_proj."""
    _set(mlp.down_proj, mlp.down_proj.weight.double() @ Q4.double().to(mlp.down_proj.weight.device))


# ------------------------------------------------------------------------ the rotated, fake-quantized model

@dataclass(frozen=True)
class QuantSpec:
    """W/A/KV bits and clip ratios (the paper's W4A4KV4, asymmetric; the Qwen recipe clips at 0.95)."""

    w_bits: int = 4
    a_bits: int = 4
    kv_bits: int = 4
    clip_w: float = 1.0
    clip_a: float = 1.0
    clip_kv: float = 1.0
    sym: bool = False

    def off(self) -> QuantSpec:
        return QuantSpec(16, 16, 16, self.clip_w, self.clip_a, self.clip_kv, self.sym)


@dataclass
class Rotations:
    """The random signs of every Hadamard (one draw per seed, shared by all passes): R1 (d), and per layer
    R2/R3 (head dim) and R4 (FFN width)."""

    r1: Tensor
    per_layer: list[dict[str, Tensor]] = field(default_factory=list)
    r1_perm: Tensor | None = None  # RoSTE's `permuted_r1` control: R1 a signed permutation instead of a Hadamard

    @classmethod
    def draw(cls, config, seed: int, *, permuted_r1: bool = False) -> Rotations:
        g = torch.Generator().manual_seed(10_000 + seed)
        dh = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        r1 = random_signs(config.hidden_size, g)
        layers = [{"R2": random_signs(dh, g), "R3": random_signs(dh, g),
                   "R4": random_signs(config.intermediate_size, g)} for _ in range(config.num_hidden_layers)]
        perm = torch.randperm(config.hidden_size, generator=g) if permuted_r1 else None
        return cls(r1, layers, perm)

    def r1_matrix(self) -> Tensor:
        """Q1 (float64): Diag(signs)·H/√d, or under `permuted_r1` the signed permutation P·Diag(signs), as orthogonal
        and as exact in full precision, but it moves each channel whole and spreads no outlier."""
        if self.r1_perm is None:
            return matrix(self.r1)
        return torch.eye(len(self.r1), dtype=torch.float64)[self.r1_perm] * self.r1.double()

    def to_dict(self) -> dict:
        d = {"r1": self.r1.tolist(), "per_layer": [{k: v.tolist() for k, v in x.items()} for x in self.per_layer]}
        return d | ({"r1_perm": self.r1_perm.tolist()} if self.r1_perm is not None else {})

    @classmethod
    def from_dict(cls, d: dict) -> Rotations:
        t = lambda v: torch.tensor(v, dtype=torch.float64)
        perm = torch.tensor(d["r1_perm"]) if "r1_perm" in d else None
        return cls(t(d["r1"]), [{k: t(v) for k, v in x.items()} for x in d["per_layer"]], perm)


# ------------------------------------------------------------------------ the fake-quantized modules

def rest_error(x: Tensor, xq: Tensor) -> float:
    """||Q(x) − x|| / ||x|| over every channel but each token's largest |x|: how much of what the outlier does not
    carry survives the quantizer (1: nothing, every other channel rounds to the zero point)."""
    keep = torch.ones_like(x).scatter_(-1, x.abs().argmax(-1, keepdim=True), 0.0)
    return (((xq - x) * keep).norm() / (x * keep).norm().clamp_min(1e-12)).item()


class QuantLinear(nn.Linear):
    """nn.Linear whose forward is Q_x(x·R4?)·Q_w(W)ᵀ (same state-dict keys, so `save_pretrained` writes a plain
    Llama). Set by `quantize_model`: `qs` (QuantSpec), `had` (R4 signs or None), `log` (a list, when logging)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.had is not None:
            x = online(x, self.had)
        xq = fake_quant(x, self.qs.a_bits, clip=self.qs.clip_a, sym=self.qs.sym)
        wq = fake_quant(self.weight, self.qs.w_bits, clip=self.qs.clip_w, sym=self.qs.sym)
        if self.log is not None:
            self.log.append({"x": x.detach().abs().reshape(-1, x.shape[-1]).mean(0),
                             "err_x": F.mse_loss(xq.detach(), x.detach()).item(),
                             "err_w": F.mse_loss(wq.detach(), self.weight.detach()).item(),
                             "rest": rest_error(x.detach(), xq.detach())})
        return F.linear(xq, wq, self.bias)


def roste_attention(module, query, key, value, attention_mask, **kw):
    """Attention with R3 (Hadamard of the head dim on q and k, after RoPE) and the per-token, per-head KV-cache
    quantizer, then transformers' eager attention. Registered as the attention implementation "roste"."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    spec = getattr(module, "roste", None)
    if spec is not None:
        if spec["r3"] is not None:
            query, key = online(query, spec["r3"]), online(key, spec["r3"])
        qs = spec["qs"]
        kq = fake_quant(key, qs.kv_bits, clip=qs.clip_kv, sym=qs.sym)
        vq = fake_quant(value, qs.kv_bits, clip=qs.clip_kv, sym=qs.sym)
        if spec.get("log") is not None:
            spec["log"].append({"err_k": F.mse_loss(kq.detach(), key.detach()).item(),
                                "err_v": F.mse_loss(vq.detach(), value.detach()).item(),
                                "k": key.detach().abs().flatten(0, -2).mean(0)})
        key, value = kq, vq
    return eager_attention_forward(module, query, key, value, attention_mask, **kw)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("roste", roste_attention)
    AttentionMaskInterface.register("roste", eager_mask)  # the additive float mask eager attention expects


def linears(layer: nn.Module) -> dict[str, nn.Linear]:
    a, m = layer.self_attn, layer.mlp
    return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": m.gate_proj, "up": m.up_proj,
            "down": m.down_proj}


@torch.no_grad()
def quantize_model(model: nn.Module, qs: QuantSpec, rot: Rotations | None = None, *, r1: bool = False,
                   choice: list[dict[str, bool]] | None = None, wrong_side: bool = False) -> nn.Module:
    """A fake-quantized copy of `model`: norms folded (untied), R1 fused when `r1`, per layer the R2/R3/R4 of
    `choice` ([{"R2": bool, "R3": bool, "R4": bool}] per layer; None: none), every decoder linear a
    `QuantLinear`, attention "roste" (R3 + KV quantizer). `qs.off()` gives the rotated model in full precision."""
    _register()
    m = fuse_norms(copy.deepcopy(model))
    if r1:
        rotate_r1(m, rot.r1_matrix(), wrong_side=wrong_side)
    choice = choice or [dict.fromkeys(KINDS, False) for _ in m.model.layers]
    for layer, ch, signs in zip(m.model.layers, choice, rot.per_layer if rot else [{}] * len(choice)):
        if ch["R2"]:
            rotate_r2(layer.self_attn, matrix(signs["R2"]))
        if ch["R4"]:
            fuse_r4_weight(layer.mlp, matrix(signs["R4"]))
    return wrap(m, qs, rot, choice, r1=r1, wrong_side=wrong_side)


def wrap(m: nn.Module, qs: QuantSpec, rot: Rotations | None, choice: list[dict[str, bool]], *, r1: bool = False,
         wrong_side: bool = False) -> nn.Module:
    """The online part in place (after the offline rotations, or on a reloaded rotated model): every decoder
    linear a `QuantLinear` (R4 before down_proj where chosen), attention "roste" (R3 where chosen, KV quantizer)."""
    _register()
    for layer, ch, signs in zip(m.model.layers, choice, rot.per_layer if rot else [{}] * len(choice)):
        for name, lin in linears(layer).items():
            lin.__class__ = QuantLinear
            lin.qs, lin.log = qs, None
            lin.had = signs["R4"].float() if name == "down" and ch["R4"] else None
        layer.self_attn.roste = {"qs": qs, "r3": signs["R3"].float() if ch["R3"] else None, "log": None}
    m.set_attn_implementation("roste")
    m.config.roste = {"quant": vars(qs), "r1": bool(r1), "choice": choice, "wrong_side": wrong_side}
    if rot is not None and rot.r1_perm is not None:  # the `permuted_r1` control: its own cache key and reload
        m.config.roste["r1_perm"] = rot.r1_perm.tolist()
    return m
