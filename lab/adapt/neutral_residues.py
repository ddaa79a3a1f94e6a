"""Neutral residues (Signe Talla, Grave & Jégou, ICML 2025): gated residual adapters that extend a frozen LM to a
new domain (language) while outputting ≈ 0 on the original one.

arXiv 2410.02744 (no official code is published). In every layer ℓ an adapter runs **in parallel to the FFN**
and reads the FFN's (normalised) input x (the paper's architecture lever):

    out_ℓ(x) = FFN_ℓ(x) + r_ℓ(x),   r_ℓ(x) = g_ℓ(x) · W_o (σ(W_g x) ⊙ W_i x),   g_ℓ(x) = ReLU(w_ℓᵀ x)

with σ = SiLU (a GLU block), a scalar block gate per token (`gate_dim="vector"`: g ∈ R^d, elementwise), W_o = 0
at initialisation (the model is the backbone exactly at step 0) and W_i, W_g, w drawn from N(0, 1/(d·L)) — the
"low-variance" init instead of He's 2/d (the training-procedure lever; low next to nn.Linear's default 1/(3d) only
when L > 3: at the toy's d = 64, L = 2 it is 1.5× that default). Training mixes a fraction p of
original-domain data into the new-domain data (the data lever; p = 0.1) and adds the local sparsity loss on
original-domain tokens only:

    ℓ = ℓ_LM + α · ℓ_local,   ℓ_local = mean_ℓ mean_{t ∈ original} ||r_ℓ(x_t)||₁ / d   (α = 0.01).

The paper's ablations are flags here: `gate="sigmoid"` + `aux="bce"` (a sigmoid gate trained as a domain classifier,
target 0 on original tokens and 1 on new ones), `gate="none"` + ℓ1 (no gate), and the vanilla adapter
(`gate="none"`, no auxiliary loss, nn.Linear's default init, W_o still 0). With no published code, the gate's
granularity, its input and σ are the reading above (a scalar gate on the FFN's input, SiLU), not checked against
code. Baselines full fine-tuning and LoRA (`peft`) train through the same loop
(`lab.adapt.neutral_residues_study.adapt`), via `accelerate.Accelerator`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lab.core import params

GATES = ("relu", "sigmoid", "none")
INITS = ("low", "default")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2")  # dense `layer.mlp`
CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "l1_on_new_domain": "the ℓ1 neutrality loss taken on the new-language (B) tokens instead of the original ones",
    "vanilla": "neutral residues replaced by vanilla adapters (no gate, no ℓ1, default init) in every NR arm",
    "no_replay": "no original-domain data in the mixture (p = 0 in every arm, so ℓ1 sees no original token)",
    "replay_new_language": "the replayed fraction p is new-language (B) text flagged as original: the same mixture "
                           "and ℓ1 schedule, with nothing of the original domain in it",
}


def check_control(control: str) -> str:
    """`""` or one of the `CONTROLS` (else one `ParamError` sentence naming them)."""
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter configuration: width `hidden`, gate kind and granularity, init, whether W_o starts at 0."""

    hidden: int
    gate: str = "relu"  # "relu" (NR) | "sigmoid" (the BCE ablation) | "none" (vanilla, or no-gate + ℓ1)
    gate_dim: str = "scalar"  # "scalar": one gate per token; "vector": one per output channel
    init: str = "low"  # "low": N(0, 1/(d·L)) for W_i, W_g, w; "default": nn.Linear's (variance 1/(3d))
    zero_out: bool = True  # W_o = 0 at init

    def __post_init__(self):
        if self.gate not in GATES or self.init not in INITS or self.gate_dim not in ("scalar", "vector"):
            raise ValueError(f"gate={self.gate!r} / init={self.init!r} / gate_dim={self.gate_dim!r}: use gate in "
                             f"{GATES}, init in {INITS}, gate_dim 'scalar' or 'vector'.")


class GatedAdapter(nn.Module):
    """r(x) = g(x) · W_o(SiLU(W_g x) ⊙ W_i x); keeps the last `r` and gate `g` for the losses and the views."""

    def __init__(self, d: int, spec: AdapterSpec, n_layers: int):
        super().__init__()
        self.spec = spec
        self.w_i = nn.Linear(d, spec.hidden, bias=False)
        self.w_g = nn.Linear(d, spec.hidden, bias=False)
        self.w_o = nn.Linear(spec.hidden, d, bias=False)
        self.gate = None if spec.gate == "none" else nn.Linear(d, 1 if spec.gate_dim == "scalar" else d, bias=False)
        if spec.init == "low":
            for lin in (self.w_i, self.w_g, self.gate):
                if lin is not None:
                    nn.init.normal_(lin.weight, std=math.sqrt(1.0 / (d * n_layers)))
        if spec.zero_out:
            nn.init.zeros_(self.w_o.weight)
        self.r: Tensor | None = None
        self.g: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        a = self.w_o(nn.functional.silu(self.w_g(x)) * self.w_i(x))
        if self.gate is None:
            self.g = None
            r = a
        else:
            z = self.gate(x)
            self.g = torch.relu(z) if self.spec.gate == "relu" else torch.sigmoid(z)
            r = self.g * a
        self.r = r
        return r


class ParallelFFN(nn.Module):
    """The layer's frozen FFN and an adapter side by side on the same input: FFN(x) + r(x)."""

    def __init__(self, mlp: nn.Module, adapter: GatedAdapter):
        super().__init__()
        self.mlp, self.adapter = mlp, adapter

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x) + self.adapter(x)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-family causal LM (one sentence naming the family otherwise)."""
    kind = getattr(model.config, "model_type", "?")
    if kind not in FAMILIES:
        raise params.ParamError(f"model type {kind!r} is not a Llama-family dense decoder; neutral residues here "
                                f"wrap `layer.mlp` of {', '.join(FAMILIES)}.")
    return model.model.layers


def hidden_for(model: nn.Module, extra: float, spec_gate: str = "relu", gate_dim: str = "scalar") -> int:
    """Adapter width h that adds about `extra` × the backbone's parameter count over all layers
    (per layer: W_i, W_g (d·h each), W_o (h·d) and the gate (d, or d² for a vector gate))."""
    d, L = model.config.hidden_size, model.config.num_hidden_layers
    n = sum(p.numel() for p in model.parameters())
    gate = 0 if spec_gate == "none" else (d if gate_dim == "scalar" else d * d)
    return max(1, round((extra * n / L - gate) / (3 * d)))


def attach(model: nn.Module, spec: AdapterSpec) -> list[GatedAdapter]:
    """Freeze the whole backbone and put one adapter beside every layer's FFN (in place); returns the adapters."""
    layers = decoder_layers(model)
    for p in model.parameters():
        p.requires_grad_(False)
    d, L = model.config.hidden_size, len(layers)
    adapters = []
    for layer in layers:  # on its layer's device (a model loaded with device_map="auto" spans several)
        ref = next(layer.mlp.parameters())
        a = GatedAdapter(d, spec, L).to(device=ref.device, dtype=ref.dtype)
        layer.mlp = ParallelFFN(layer.mlp, a)
        adapters.append(a)
    return adapters


def adapters_of(model: nn.Module) -> list[GatedAdapter]:
    return [m.adapter for m in model.modules() if isinstance(m, ParallelFFN)]


def adapter_params(d: int, n_layers: int, spec: AdapterSpec) -> int:
    """Hand count: L · (3·d·h + gate), gate = 0 (none), d (scalar) or d² (vector)."""
    gate = 0 if spec.gate == "none" else (d if spec.gate_dim == "scalar" else d * d)
    return n_layers * (3 * d * spec.hidden + gate)


def local_loss(adapters: list[GatedAdapter], mask: Tensor) -> Tensor:
    """ℓ_local: mean over layers of the mean over the tokens where `mask` (B, T) is True of ||r_ℓ||₁ / d.
    Zero (with a graph) when no token is masked."""
    if not bool(mask.any()):
        return adapters[0].r.sum() * 0.0
    dev = adapters[0].r.device
    return torch.stack([a.r.abs().mean(-1)[mask.to(a.r.device)].mean().to(dev) for a in adapters]).mean()


def domain_loss(adapters: list[GatedAdapter], new: Tensor) -> Tensor:
    """The sigmoid-gate ablation's auxiliary loss: BCE of every layer's gate (per token, averaged over channels
    for a vector gate) against the domain, 1 on new-domain tokens and 0 on original ones."""
    g = torch.stack([a.g.mean(-1).to(adapters[0].g.device) for a in adapters])  # (L, B, T)
    target = new.to(device=g.device, dtype=g.dtype).expand_as(g)
    return nn.functional.binary_cross_entropy(g.clamp(1e-6, 1 - 1e-6), target)


def aux_loss(adapters: list[GatedAdapter], orig: Tensor, aux: str, l1_on: str = "original") -> Tensor:
    """The auxiliary loss of an arm: "l1" (on the original tokens, or on the new ones under the
    `l1_on_new_domain` control), "bce" (sigmoid domain classifier) or "none"."""
    if aux == "l1":
        return local_loss(adapters, orig if l1_on == "original" else ~orig)
    if aux == "bce":
        return domain_loss(adapters, ~orig)
    return adapters[0].r.sum() * 0.0 if adapters else torch.zeros(())


def save_adapters(model: nn.Module, folder: str | Path, *, backbone: str = "") -> Path:
    """Write the adapters alone (`adapters.safetensors` + `adapter_config.json`) to `folder`; the backbone is
    not written (its path is recorded)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ads = adapters_of(model)
    save_file({f"layers.{i}.{k}": v.detach().cpu().contiguous() for i, a in enumerate(ads)
               for k, v in a.state_dict().items()}, str(folder / "adapters.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"spec": asdict(ads[0].spec), "backbone": backbone,
                                                            "n_layers": len(ads)}, indent=1))
    return folder / "adapters.safetensors"


def load_adapters(model: nn.Module, folder: str | Path) -> list[GatedAdapter]:
    """Attach adapters to a (fresh) backbone and load the weights `save_adapters` wrote."""
    from safetensors.torch import load_file

    folder = Path(folder)
    conf = json.loads((folder / "adapter_config.json").read_text())
    ads = attach(model, AdapterSpec(**conf["spec"]))
    state = load_file(str(folder / "adapters.safetensors"))
    for i, a in enumerate(ads):
        a.load_state_dict({k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{i}.")})
    return ads
