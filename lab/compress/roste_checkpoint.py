"""RoSTE on a researcher's checkpoint (notebook 14's `model=<folder or hub id>` path): `load_checkpoint` refuses what
the rotations cannot handle, `checkpoint` runs the rotation search and STE QA-SFT through `accelerate`, `save` writes
a plain `from_pretrained` folder plus what the fake quantizer needs (`roste.json`) and the packed 4-bit codes, and
`load` rebuilds the fake-quantized model from it. The method itself is `lab.compress.roste` (module docstring)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lab.compress.gptq import gptq_model
from lab.compress.roste import Config, adaptive
from lab.compress.rotate import KINDS, QuantSpec, Rotations, quantize_model

FAMILIES = ("llama", "mistral", "qwen2")


@torch.no_grad()
def lm_loss(model: nn.Module, ids: Tensor, chunk: int = 8) -> float:
    """Mean next-token NLL over token blocks ids (N, T)."""
    losses = [model(input_ids=ids[i:i + chunk], labels=ids[i:i + chunk]).loss.item() for i in range(0, len(ids), chunk)]
    return sum(losses) / len(losses)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def load_checkpoint(model: str, device: str = "cpu"):
    """`load_model` with RoSTE's checks: a Llama-family causal LM whose rotated dims are powers of 2."""
    from lab.core.params import ParamError
    from lab.models import load_model

    net, tok = load_model(model, device=device, dtype=torch.float32)
    c = net.config
    if c.model_type not in FAMILIES:
        raise ParamError(f"model={model!r} is a {c.model_type!r} model; RoSTE here needs a Llama-family causal LM "
                         f"({', '.join(FAMILIES)}) with RMSNorm and separate q/k/v projections.")
    dh = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if not all(map(_pow2, (c.hidden_size, dh, c.intermediate_size))):
        raise ParamError(f"model={model!r} has hidden {c.hidden_size}, head dim {dh}, FFN {c.intermediate_size}; the "
                         "Walsh–Hadamard rotations here need powers of 2 (QuaRot's get_hadK factorisation is not "
                         "built).")
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; save one beside the weights.")
    return net, tok


def checkpoint(model: str, data: str, cfg: Config, *, steps: int = 20, lr: float = 1e-5, n_blocks: int = 8,
               block_len: int = 128, batch: int = 4, seed: int = 0, device: str = "cpu", out_dir: str = "") -> dict:
    """RoSTE on a checkpoint: calibration blocks from `data` (`lab.data.text`), the rotation search on the first
    half (R1 + adaptive R2/R3/R4), `steps` of STE QA-SFT (next-token loss, AdamW, through `accelerate`'s
    `Accelerator`, so `accelerate launch` spreads it over GPUs), held-out loss of the FP model, of RTN, of QuaRot
    with GPTQ weights (calibrated on the search's blocks) and of the rotated model before and after QA-SFT; the
    result written by `save`. Measurements only (no toy threshold)."""
    from accelerate import Accelerator

    from lab.core.params import ParamError
    from lab.data.text import halves

    if not data:
        raise ParamError("a checkpoint needs fine-tuning text: pass -p data <a .txt/.jsonl file or a datasets name>.")
    net, tok = load_checkpoint(model, device)
    dev = next(net.parameters()).device
    train_ids, ev = (x.to(dev) for x in halves(data, tok, n_blocks, block_len, seed=seed, method="RoSTE"))
    qs, rot = cfg.quant(), Rotations.draw(net.config, seed)
    search = adaptive(net, qs, rot, train_ids)
    q = quantize_model(net, qs, rot, r1=True, choice=search["choice"])
    on = [dict.fromkeys(KINDS, True) for _ in search["choice"]]  # QuaRot: R1 + every R2–R4, GPTQ weights
    res = {"loss": {"FP": lm_loss(net, ev), "RTN PTQ": lm_loss(quantize_model(net, qs), ev),
                    "QuaRot-like PTQ, GPTQ weights": lm_loss(gptq_model(quantize_model(net, qs.off(), rot, r1=True,
                                                                                      choice=on), train_ids, qs), ev),
                    "rotated, before QA-SFT": lm_loss(q, ev)}, "choice": search["choice"]}
    acc = Accelerator(cpu=dev.type == "cpu")
    opt = torch.optim.AdamW([p for p in q.parameters() if p.requires_grad], lr=lr)
    q, opt = acc.prepare(q, opt)
    g = torch.Generator().manual_seed(seed)
    q.train()
    for _ in range(steps):
        b = train_ids[torch.randint(0, len(train_ids), (batch,), generator=g)]
        acc.backward(q(input_ids=b, labels=b).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    q = acc.unwrap_model(q).eval()
    res["loss"]["RoSTE (after QA-SFT)"] = lm_loss(q, ev)
    del net, opt  # the FP model and AdamW's moments: freed before `save` reloads a copy beside q on its device
    acc.free_memory()
    res["saved"] = save(q, tok, rot, out_dir or None, ids=ev[:2])
    return res


def save(qmodel: nn.Module, tokenizer, rot: Rotations, out_dir: str | None, *, ids: Tensor | None = None) -> dict:
    """The rotated model with `save_pretrained` (its latent weights, rotated; a plain Llama folder that
    `from_pretrained` reads), `roste.json` (quantizer, chosen R2/R3/R4, the rotations' signs — what the online
    R3/R4 and the fake quantizer need) and `roste_w4.safetensors` (every quantized linear's 4-bit codes packed two
    a byte + fp16 scale/zero per output channel: the deployable W4). `load` rebuilds the fake-quant model, on the
    model's device, and its logits on `ids` are compared with the model's there (the model is not moved)."""
    import json
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    from lab.compress.quant import pack, quant_codes

    out = Path(out_dir or tempfile.mkdtemp(prefix="roste-"))
    qmodel.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    spec = qmodel.config.roste
    (out / "roste.json").write_text(json.dumps({**spec, "rotations": rot.to_dict()}))
    qs, packed, lin_bytes = QuantSpec(**spec["quant"]), {}, 0
    for name, mod in qmodel.named_modules():
        if isinstance(mod, nn.Linear) and hasattr(mod, "qs"):
            codes, s, z = quant_codes(mod.weight, qs.w_bits, clip=qs.clip_w)
            packed.update({f"{name}.codes": pack(codes, qs.w_bits), f"{name}.scale": s.half(),
                           f"{name}.zero": z.half()})
            lin_bytes += mod.weight.numel() * 2  # the same linears in bf16, the paper's training precision
    save_file({k: v.contiguous().cpu() for k, v in packed.items()}, str(out / "roste_w4.safetensors"))
    dev = next(qmodel.parameters()).device
    back = load(out, device=dev)
    x = (ids if ids is not None else torch.ones(1, 4, dtype=torch.long)).to(dev)
    with torch.no_grad():
        dl = (back(input_ids=x).logits - qmodel(input_ids=x).logits).abs().max().item()
    del back
    return {"out_dir": str(out), "reload_max_abs_logit_diff": dl, "linear_bytes_bf16": lin_bytes,
            "linear_bytes_w4": (out / "roste_w4.safetensors").stat().st_size}


def load(folder, device: str | torch.device | None = None) -> nn.Module:
    """A folder written by `save` back as the fake-quantized RoSTE model (from_pretrained + the online parts),
    loaded straight onto `device` (default: where `from_pretrained` puts it)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from lab.compress.rotate import wrap

    spec = json.loads((Path(folder) / "roste.json").read_text())
    m = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                             device_map=None if device is None else str(device)).eval()
    return wrap(m, QuantSpec(**spec["quant"]), Rotations.from_dict(spec["rotations"]), spec["choice"],
                r1=spec["r1"], wrong_side=spec["wrong_side"])
