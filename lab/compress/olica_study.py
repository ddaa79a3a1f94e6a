"""The Olica notebook's measurements, toy and checkpoint path (the method itself is `lab.compress.olica`).

He & Lin, "Olica", ICML 2025 (arXiv 2506.08436); official code BetterTMrR/LLM-Olica. Perplexity, OND exactness
(the rotation alone must not change the logits), the per-layer V/O error of the paper's toy criterion (OND vs raw
neurons), per-head spectra for the explorer, every method at matched sizes (`compare`), the toy (Markov + induction
text) and a Llama-family checkpoint with calibration text (`lab.data.text`), and `save_pretrained` of the result.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager

import torch
from torch import nn

from lab.compress import pruned_llama as om
from lab.compress.olica import METHODS, Config, fast_ond, full_ond, prune, rotate
from lab.compress.olica_capture import block_inputs, energy, run_block, taps
from lab.compress.olica_ops import prune_vo, vo_scores
from lab.compress.pruned_llama import OlicaLlamaForCausalLM

# ------------------------------------------------------------------------------------- measurements (toy)

@torch.no_grad()
def ppl(model: nn.Module, ids: torch.Tensor, batch: int = 64) -> float:
    """exp(mean next-token loss) over `ids` (n, T)."""
    losses = [model(input_ids=ids[i:i + batch], labels=ids[i:i + batch]).loss * len(ids[i:i + batch])
              for i in range(0, len(ids), batch)]
    return math.exp(torch.stack(losses).sum().item() / len(ids))


@torch.no_grad()
def ond_exactness(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """max |Δ logits| / max |logits| after rotating V/O of every layer (Fast OND and full OND), before any pruning:
    relative, so that one bound serves a tiny model and a 7B checkpoint (larger logits, larger fp32 rounding)."""
    ref, out = model(input_ids=ids).logits, {}
    for how in ("fast", "full"):
        m = copy.deepcopy(model)
        x, kw = block_inputs(m, ids)
        for b in m.model.layers:
            with taps({"v": b.self_attn.v_proj, "o": b.self_attn.o_proj}) as t:
                x = run_block(b, x, kw)
            rotate(b.self_attn, how, energy(t["o"][1]), energy(t["v"][0]), m.config.num_attention_heads)
        out[how] = ((m(input_ids=ids).logits - ref).abs().max() / ref.abs().max()).item()
    return out


@torch.no_grad()
def vo_errors(model: nn.Module, ids: torch.Tensor, keep: float, how: tuple[str, str], seed: int = 0) -> list[float]:
    """Per layer ‖attn_out_pruned − attn_out‖/‖attn_out‖ on the dense stream when only V/O is pruned to `keep`
    of every head, after rotation how[0] ("fast" | "none") with neuron scores how[1] ("olica" | "wanda" | ...)."""
    g, H = torch.Generator().manual_seed(seed), model.config.num_attention_heads
    model = model if isinstance(model, OlicaLlamaForCausalLM) else om.from_llama(model)
    x, kw = block_inputs(model, ids)
    errs = []
    for b in model.model.layers:
        a = copy.deepcopy(b.self_attn)
        with taps({"v": b.self_attn.v_proj, "o": b.self_attn.o_proj}) as t:
            y = run_block(b, x, kw)
        rotate(a, how[0], energy(t["o"][1]), energy(t["v"][0]), H)
        with taps({"v": a.v_proj, "o": a.o_proj}) as t2, swap_attn(b, a):
            run_block(b, x, kw)
        dv = round(keep * a.v_proj.out_features / H)
        prune_vo(a, vo_scores(a, how[1], energy(t2["v"][0]), energy(t2["o"][0]), g), H, dv)
        with taps({"o": a.o_proj}) as t3, swap_attn(b, a):
            run_block(b, x, kw)
        errs.append(((t3["o"][1] - t["o"][1]).norm() / t["o"][1].norm()).item())
        x = y
    return errs


@contextmanager
def swap_attn(block: nn.Module, attn: nn.Module):
    old = block.self_attn
    block.self_attn = attn
    try:
        yield
    finally:
        block.self_attn = old


@torch.no_grad()
def head_spectra(model: nn.Module, ids: torch.Tensor) -> dict[tuple[int, int], dict[str, list[float]]]:
    """Per (layer, head): singular values of the output-energy-weighted W_o^h (Fast OND's S) and of the full weighted
    product W_o^h W_v^h (full OND), for the spectra explorer."""
    x, kw, out = *block_inputs(model, ids), {}
    H = model.config.num_attention_heads
    for i, b in enumerate(model.model.layers):
        with taps({"v": b.self_attn.v_proj, "o": b.self_attn.o_proj}) as t:
            x = run_block(b, x, kw)
        e_out, e_in = energy(t["o"][1]), energy(t["v"][0])
        wv, wo = b.self_attn.v_proj.weight, b.self_attn.o_proj.weight
        fast, full = fast_ond(wv, wo, e_out, H)[2], full_ond(wv, wo, e_out, e_in, H)[2]
        for h in range(H):
            out[i, h] = {"fast": fast[h].tolist(), "full": full[h].tolist()}
    return out


# ------------------------------------------------------------------------------ the toy and the checkpoint path

def toy(cfg: Config, seed: int, device: str = "cpu"):
    """(task, training run, calibration ids, held-out calibration ids, evaluation ids) of the Markov + induction toy."""
    from lab.data.markov_induction import MarkovInduction

    task = MarkovInduction(seed=seed, length=cfg.seqlen)
    run = cfg.model.fit(task, task.vocab_size, seed=seed, device=device)
    g = torch.Generator().manual_seed(10_000 + seed)  # calibration and evaluation: not the training stream
    ids = [task.batch(n, g)["input_ids"].to(device) for n in (cfg.n_calib, 16, cfg.n_eval)]
    return task, run, *ids


def compare(model, calib, held, ev, cfg: Config, sparsities, seed: int = 0) -> dict:
    """PPL and parameter count of every method at every sparsity (same plan sizes; "bias": the bias parameters among
    them, FLAP's compensation), plus each run's info."""
    out = {"ppl": {}, "params": {}, "bias": {}, "info": {}}
    for name in METHODS:
        rec = cfg.recipe(name)
        runs = [prune(model, calib, s, rec, cfg, held_out=held, seed=seed) for s in sparsities]
        out["ppl"][name] = [ppl(m, ev) for m, _ in runs]
        out["params"][name] = [om.n_params(m) for m, _ in runs]
        out["bias"][name] = [sum(p.numel() for k, p in m.named_parameters() if k.endswith(".bias")) for m, _ in runs]
        out["info"][name] = [i for _, i in runs]
    return out


def checkpoint(path: str, data: str, cfg: Config, device: str = "cpu", n_blocks: int = 160):
    """(model, tokenizer, calibration ids, held-out ids) of a Llama-family checkpoint (`load_model`) with text
    `data` (`lab.data.text`) cut into blocks of `cfg.seqlen` tokens; the last quarter of the blocks is held out."""
    from lab.core.params import ParamError
    from lab.data.text import load_texts, token_blocks
    from lab.models import load_model

    if not data:
        raise ParamError("the checkpoint path needs calibration text: pass data=<a .txt/.jsonl file or a datasets "
                         "name>.")
    model, tok = load_model(path, device=device, dtype=torch.float32)
    if model.config.model_type != "llama" or tok is None:
        raise ParamError(f"model={path!r} is a {model.config.model_type!r} model (or has no tokenizer); Olica here "
                         "prunes Llama-family checkpoints (LlamaForCausalLM with a tokenizer).")
    blocks = token_blocks(load_texts(data, seed=0), tok, n_blocks, cfg.seqlen).to(model.device)
    n_ev = max(1, len(blocks) // 4)
    return model, tok, blocks[:-n_ev], blocks[-n_ev:]


def save(model: nn.Module, tokenizer, out_dir: str) -> dict:
    """`save_pretrained` of the pruned model (and tokenizer) -> {"folder", "bytes" of its weights}."""
    from pathlib import Path

    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return {"folder": str(out_dir), "bytes": sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))}


def without_lc(model: OlicaLlamaForCausalLM) -> OlicaLlamaForCausalLM:
    """A copy of a pruned model with its linear-calibration terms removed (the paper's "Fast-OND" ablation row)."""
    m = copy.deepcopy(model)
    for b in m.model.layers:
        b.mlp.lc = None
    om.sync_config(m)
    return m
