"""FloE on a researcher's MoE checkpoint (notebook 05's `model=<folder or hub id>` path): the toy's measurements on
the given model, calibrated and evaluated on the given text.

`load_moe` refuses, from the config alone and before any weight is read, a model that has no sparse-MoE experts
(FloE compresses and offloads experts; a dense model has none). `checkpoint` cuts the text (`lab.data.text`) into
token blocks, half to calibrate the per-expert thresholds (Eq. 6, on |a_up| of the INT2 W_up, the activation the FloE
mask thresholds: `floe.floe_thresholds`) and half held out, and measures what the toy measures: the sparsity
sensitivity of each matrix (Table 5), the kept fraction the INT2 W_up mask reaches on held-out inputs beside the one
that thresholds calibrated on the full-precision up projection would reach, the FloE expert against its baselines at
equal sparsity (loss and layer error), and the offload engine's bytes per token, tokens per second (modelled by the
device-tier simulator on CPU, measured with CUDA events on a GPU), misses and device-resident expert bytes per
policy. Measurements only: the toy's thresholds say nothing about another model.

Precision and memory: the model is held in float32 (default) or bfloat16 (`dtype`); the analysis — thresholds,
activations, HQQ, layer errors, the experts swapped into the loss — runs in float32 either way, each expert's weights
upcast when used (a bfloat16 model's MoE inputs are its own bfloat16 states, upcast; its router and every other
module run in bfloat16, as the model does; the offload engine decodes in the model's dtype). A model whose analysis
would not fit the device it loads on (one GPU, or the host's available memory; `need_bytes`: the model, one layer's
experts in float32, and on CPU the simulator's expert forms) is refused from its config, before any weight is read:
Mixtral-8x7B needs 192 GB in float32, more than one 141 GB H200, and 99 GB in bfloat16. Layer 0 stays dense, as in
the notebook's toy.
"""

from __future__ import annotations

import torch
from torch import nn

from lab.core.params import ParamError
from lab.moe import blocks
from lab.moe import floe as fl
from lab.moe import floe_bench as fb
from lab.moe import floe_decode as fd

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")  # fused `experts` + `gate` router per layer in transformers 5


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # how the model is held; the analysis is float32


def load_moe(model: str, device: str = "cpu", dtype: str = "float32") -> tuple[nn.Module, object]:
    """`(model, tokenizer)` of a sparse MoE of `FAMILIES`, held in `dtype`; any other model, or one whose analysis
    would not fit the device, is refused with one sentence before its weights are read."""
    if dtype not in DTYPES:
        raise ParamError(f"dtype={dtype!r} is not a precision the model can be held in; use one of "
                         f"{', '.join(DTYPES)}.")
    from transformers import AutoConfig

    from lab.models import load_model

    try:
        kind = AutoConfig.from_pretrained(model).model_type
    except (OSError, ValueError):
        kind = None  # not loadable: `load_model` says why, in one sentence
    if kind is not None and kind not in FAMILIES:
        raise ParamError(f"model={model!r} is a {kind!r} model without sparse-MoE experts; FloE compresses and "
                         f"offloads experts, so it needs an MoE of the Mixtral or Qwen-MoE family "
                         f"({', '.join(FAMILIES)}).")
    if kind is not None:
        need, have = need_bytes(model, device, dtype), memory(device)
        if need > have:
            hint = "hold it in bfloat16 (-p dtype bfloat16, about half), " if dtype == "float32" else ""
            raise ParamError(f"model={model!r} needs {need / 1e9:.0f} GB for this analysis with the model in {dtype}, "
                             f"and this {device} has {have / 1e9:.0f} GB; {hint}use a smaller MoE, or a machine "
                             "with more memory.")
    net, tok = load_model(model, device=device, dtype=DTYPES[dtype])
    if not all(hasattr(m, "experts") and hasattr(m, "gate") for m in blocks.moe_blocks(net)):
        raise ParamError(f"model={model!r} has decoder layers without a sparse-MoE block; FloE needs experts in "
                         "every layer.")
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; save one beside the weights.")
    return net, tok


SIM_FORMS = 1.25  # the simulator's memoised expert forms, in float32 experts (FP16 whole + FP16 rows + INT2 + ...)


def counts(model: str) -> dict[str, int]:
    """The model's parameters, expert parameters and layers from its config alone (built on the meta device: no
    weight is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    mlps = blocks.moe_blocks(net)
    return {"params": sum(p.numel() for p in net.parameters()), "layers": len(mlps),
            "experts": sum(p.numel() for m in mlps if hasattr(m, "experts") for p in m.experts.parameters())}


def need_bytes(model: str, device: str, dtype: str = "float32") -> int:
    """Bytes `checkpoint` holds at its peak, from the config: the model in `dtype` and one layer's experts in float32
    (the HQQ-expert baseline holds one layer at a time; the FloE experts hold views and packed codes; the engine
    runs while no analysis holds the experts it releases); on CPU also the simulator's expert forms, memoised for
    all policies (`SIM_FORMS`; on a GPU the host tier holds one policy's forms, in host memory)."""
    c = counts(model)
    sim = SIM_FORMS * c["experts"] if not str(device).startswith("cuda") else 0
    return int(DTYPES[dtype].itemsize * c["params"] + 4 * (c["experts"] / max(1, c["layers"]) + sim))


def memory(device: str) -> int:
    """Bytes the model can be loaded into: the GPU's memory on CUDA (one GPU: the offload engine's device tier is
    one GPU), else the host's available memory."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    import psutil

    return psutil.virtual_memory().available


def checkpoint(model: str, data: str, cfg: fl.Config, *, k: float = 0.8, n_blocks: int = 8, block_len: int = 128,
               n_decode: int = 1, pcie_gbps: float = 25.0, seed: int = 0, device: str = "cpu",
               dtype: str = "float32") -> dict:
    """FloE's measurements on `model` (held in `dtype`) with calibration / held-out text from `data` (module
    docstring)."""
    from lab.data.text import halves

    if not data:
        raise ParamError("a checkpoint needs calibration text: pass -p data <a .txt/.jsonl file or a datasets name>.")
    if not 0 < k < 1:
        raise ParamError(f"k={k} must be a sparsity in (0, 1): the share of each expert's up neurons dropped.")
    net, tok = load_moe(model, device, dtype)
    dev = next(net.parameters()).device
    cal, ev = (x.to(dev) for x in halves(data, tok, n_blocks, block_len, seed=seed, method="FloE"))
    # the engine first, while no analysis holds views of the experts it releases (held bytes stay on the device)
    dec = fd.Decoder(net, ev[:n_decode], device, pcie_gbps, seed=seed)
    engine = {name: {key: v for key, v in r.items() if key != "spans"}
              for name, r in dec.decode_all(fd.engine_policies(1 - k)).items()}
    batch = {"input_ids": ev, "labels": ev}
    xs_cal, xs_ev = ([x.float() for x in blocks.moe_inputs(net, ids)] for ids in (cal, ev))  # the analysis: float32
    base = blocks.eval_loss(net, batch)
    t_fp = fl.thresholds(net, xs_cal, k, "up")  # full-precision a_up: the up-only and random-mask baselines
    experts = fl.floe_experts(net, fl.floe_thresholds(net, xs_cal, k, cfg.nbits, cfg.group_size), cfg.nbits,
                              cfg.group_size)
    variants = fb.expert_variants(net, xs_cal, t_fp, k, experts, group_size=cfg.group_size)
    layers = list(range(1, len(xs_ev)))
    mlp0 = blocks.moe_blocks(net)[0]
    return {"model": {"type": net.config.model_type, "layers": len(xs_ev), "experts": mlp0.experts.down_proj.shape[0],
                      "top_k": mlp0.gate.top_k, "params": sum(p.numel() for p in net.parameters()), "dtype": dtype},
            "loss": base, "sparsity_errors": fb.sparsity_errors(net, xs_cal, xs_ev, cfg.ks),
            "kept_fraction": {"target": 1 - k, "reached with INT2 W_up": fl.kept_fraction(experts, net, xs_ev),
                              "thresholds of the full-precision W_up": fl.kept_fraction(experts, net, xs_ev, t=t_fp)},
            "variants": fb.variant_quality(net, batch, xs_ev, variants, base, layers), "engine": engine,
            "dense_decode_loss": dec.dense_loss()}
