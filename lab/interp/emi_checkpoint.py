r"""EMI on a researcher's vision-language model and image–question sets (notebook 04's `model=<folder or hub id>`
path): Oh, Fang, Im, Du & Li, ICML 2025 (arXiv 2502.00577), following the official `deeplearning-wisc/mllmshift-emi`
`main.py` step by step.

1. **Answers.** The model (`lab.models.vlm.load_vlm`: LLaVA-1.5/1.6 as `llava-hf/*`, any `transformers`
   image-text-to-text model) answers every query greedily (temperature 0, as LLaVA-Bench's evaluation that produced
   the repo's responses) through `generate`, the prompt built by the processor's chat template.
2. **Embeddings** (the repo's `EMI.forward`): image → the CLIP vision tower's last hidden state, mean over the
   patch tokens (CLS excluded); question, model answer, reference answer → the text encoder's `hidden_states[0]`
   (the embedding layer's output, non-contextual, as the repo; `Config.text_layer`), mean over the non-padding
   tokens after the first (XLM-R's `<s>`). All four L2-normalised; the query is z = (z_v + z_t)/2.
3. **EMI, EMID, bound** with `lab.interp.emi`'s estimators, unchanged: EMI = Î(z; ŷ) − Î(z; y) per scenario
   with one CLUB, EMID = EMI(ID) − EMI(shift), and the repo's scale-adjusted bound √JSD_v + √JSD_t + JSD_PY^¼ +
   JSD_QY^¼ per shift (`jsd_cov`, un-normalised second moments as the repo's `JSD_cov`).

The CLUB is the repo's own when `club` names its state dict (`estimator_ckpt/CLUB_global.pt`: 768-d embeddings,
hidden 500, trained by the authors on the LLaVA-Bench shift family; our `CLUB` has its layer names), else it is
trained here on the pooled (query, reference) and (query, answer) pairs of all scenarios, as the notebook's toy
does (the repo's training data is not published; its README advises retraining for other tasks). Measurements only:
a checkpoint run asserts no claim. No RP: the paper's relative preference needs a GPT-4 judge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.core.params import ParamError
from lab.core.stats import pearson, spearman
from lab.interp import emi as E


@dataclass(frozen=True)
class Config:
    """Sizes of a checkpoint run: queries per scenario (0: all), answer length, batch size (generation and
    encoders), the text encoder's layer, and the CLUB trained when no state dict is given (hidden 500 as the repo's
    `mi_est_dim`)."""

    n_queries: int = 0
    max_new_tokens: int = 64
    batch_size: int = 8
    text_layer: int = 0
    club_hidden: int = 500
    club_steps: int = 500
    club_lr: float = 1e-3
    club_batch: int = 256

    @classmethod
    def for_scale(cls, scale: str, **given) -> Config:
        """"smoke": 64-token answers, 500 CLUB steps; "full": 512-token answers (LLaVA-Bench's answers are
        paragraphs), 2,000 CLUB steps. A `given` value of 0 or None keeps the scale's."""
        sized = cls() if scale == "smoke" else cls(max_new_tokens=512, club_steps=2000)
        return replace(sized, **{k: v for k, v in given.items() if v})


def prompt(processor, question: str) -> str:
    """One image and the question in the model's chat template; LLaVA-1.5's format when the processor has none."""
    if getattr(processor, "chat_template", None):
        conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        return processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    return f"USER: <image>\n{question} ASSISTANT:"


@torch.no_grad()
def answers(model, processor, rows: list[dict], *, max_new_tokens: int = 64, batch_size: int = 8) -> list[str]:
    """The model's greedy answer to each `{image, question}` row (left-padded batches, special tokens dropped)."""
    processor.tokenizer.padding_side = "left"
    out = []
    for i in range(0, len(rows), batch_size):
        batch = rows[i: i + batch_size]
        inputs = processor(images=[r["image"] for r in batch], text=[prompt(processor, r["question"]) for r in batch],
                           return_tensors="pt", padding=True).to(model.device, dtype=model.dtype)
        ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = ids[:, inputs["input_ids"].shape[1]:]  # (B, generated)
        out += [t.strip() for t in processor.batch_decode(new, skip_special_tokens=True)]
    return out


@torch.no_grad()
def embed_images(enc, images: list, *, batch_size: int = 8) -> Tensor:
    """(n, d) L2-normalised: CLIP's last hidden state averaged over the patch tokens, CLS (index 0) excluded."""
    p = next(enc.image.parameters())
    out = []
    for i in range(0, len(images), batch_size):
        px = enc.image_processor(images=images[i: i + batch_size], return_tensors="pt")["pixel_values"]
        h = enc.image(pixel_values=px.to(p.device, p.dtype), output_hidden_states=True).hidden_states[-1]
        out.append(h[:, 1:].mean(1).float().cpu())  # (B, 1 + patches, d) -> (B, d)
    return F.normalize(torch.cat(out), dim=-1)


@torch.no_grad()
def embed_texts(enc, texts: list[str], *, layer: int = 0, batch_size: int = 8) -> Tensor:
    """(n, d) L2-normalised: the text encoder's `hidden_states[layer]` averaged over the non-padding tokens after
    the first (truncated at 512 tokens, as the repo)."""
    dev = next(enc.text.parameters()).device
    out = []
    for i in range(0, len(texts), batch_size):
        t = enc.tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True, truncation=True,
                          max_length=512).to(dev)
        h = enc.text(**t, output_hidden_states=True).hidden_states[layer][:, 1:].float()  # (B, T - 1, d)
        m = t["attention_mask"][:, 1:, None].float()
        out.append(((h * m).sum(1) / m.sum(1).clamp_min(1)).cpu())
    return F.normalize(torch.cat(out), dim=-1)


def embed(enc, rows: list[dict], responses: list[str], cfg: Config) -> dict:
    """One scenario's embeddings: zv, zt, the query z = (zv + zt)/2, the answers `ym` and the references `yr`."""
    b = cfg.batch_size
    zv = embed_images(enc, [r["image"] for r in rows], batch_size=b)
    zt, ym, yr = (embed_texts(enc, texts, layer=cfg.text_layer, batch_size=b)
                  for texts in ([r["question"] for r in rows], responses, [r["reference"] for r in rows]))
    return {"zv": zv, "zt": zt, "z": (zv + zt) / 2, "ym": ym, "yr": yr}


def estimator(scen: dict, cfg: Config, *, club: str = "", seed: int = 0) -> E.CLUB:
    """The repo's CLUB from its state dict `club`, or one trained on the pooled pairs of all scenarios."""
    d = next(iter(scen.values()))["z"].shape[1]
    if not club:
        return E.fit_club(*E.club_pairs(scen), hidden=cfg.club_hidden, steps=cfg.club_steps, lr=cfg.club_lr,
                          batch_size=cfg.club_batch, seed=seed)
    if not os.path.isfile(os.path.expanduser(club)):
        raise ParamError(f"club={club!r} is not a file; pass a CLUB state dict (the repo's CLUB_global.pt) or ''.")
    state = torch.load(os.path.expanduser(club), map_location="cpu", weights_only=True)
    hidden, x_dim = state["p_mu.0.weight"].shape
    if x_dim != d or state["p_mu.2.weight"].shape[0] != d:
        raise ParamError(f"club={club!r} scores {x_dim}-d embeddings; the encoders give {d}-d ones.")
    net = E.CLUB(d, d, 2 * hidden)
    net.load_state_dict(state)
    return net.eval().requires_grad_(False)


def measure(scen: dict, club: E.CLUB, id_name: str) -> tuple[dict, dict]:
    """Per scenario: n, the two MI estimates and EMI; per shift (every scenario but `id_name`): EMID, the four
    JSDs against ID and the scale-adjusted bound."""
    rows = {}
    with torch.no_grad():
        for name, s in scen.items():
            rows[name] = {"n": len(s["z"]), "I(query; answer)": club(s["z"], s["ym"]).item(),
                          "I(query; reference)": club(s["z"], s["yr"]).item(),
                          "EMI": E.emi(club, s["z"], s["ym"], s["yr"])}
    ID, shifts = scen[id_name], {}
    for name, s in scen.items():
        if name != id_name:
            jsd = (E.jsd_cov(ID["zv"], s["zv"]), E.jsd_cov(ID["zt"], s["zt"]), E.jsd_cov(ID["ym"], ID["yr"]),
                   E.jsd_cov(s["ym"], s["yr"]))
            shifts[name] = {"EMID": E.emid(rows[id_name]["EMI"], rows[name]["EMI"]), "bound": E.upper_bound(*jsd),
                            **dict(zip(("JSD_v", "JSD_t", "JSD_PY", "JSD_QY"), jsd))}
    return rows, shifts


def checkpoint(model: str, data: str, image_encoder: str, text_encoder: str, cfg: Config, *, id_shift: str = "",
               club: str = "", seed: int = 0, device: str = "cpu", control: str = "") -> dict:
    """EMI, EMID and the bound of `model` on the scenarios of `data` (module docstring). The model's config is
    checked first, then the data, and only then are weights read."""
    from lab.data.load import image_questions
    from lab.models.vlm import load_encoders, load_vlm, vision_language_config

    if control:
        raise ParamError(f"control={control!r} substitutes parts of the toy's pipeline and runs on model='tiny' only; "
                         "drop -p control for a checkpoint.")
    vision_language_config(model)
    if not data:
        raise ParamError("a checkpoint needs image–question–answer sets: pass -p data <a folder of images with a "
                         "metadata.jsonl (file_name, question, answer, shift) or a cached `datasets` name>.")
    sets = image_questions(data, n=cfg.n_queries or None)
    id_name = id_shift or next(iter(sets))
    if id_name not in sets or len(sets) < 2:
        raise ParamError(f"EMID needs an ID scenario and at least one shift; data={data!r} has the scenarios "
                         f"{', '.join(map(repr, sets))} and id_shift={id_shift!r}.")
    net, processor = load_vlm(model, device=device)
    enc = load_encoders(image_encoder, text_encoder, device=device)
    responses = {name: answers(net, processor, rows, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size)
                 for name, rows in sets.items()}
    scen = {name: embed(enc, rows, responses[name], cfg) for name, rows in sets.items()}
    rows, shifts = measure(scen, estimator(scen, cfg, club=club, seed=seed), id_name)
    out = {"model": {"type": net.config.model_type, "params": sum(p.numel() for p in net.parameters())},
           "id": id_name, "scenarios": rows, "shifts": shifts,
           "examples": {name: [{"question": r["question"], "reference": r["reference"], "answer": a}
                               for r, a in zip(sets[name][:2], responses[name])] for name in sets}}
    if len(shifts) >= 3:
        gap, bound = (torch.tensor([s[k] for s in shifts.values()]) for k in ("EMID", "bound"))
        out["pearson(EMID, bound)"], out["spearman(EMID, bound)"] = pearson(bound, gap), spearman(bound, gap)
    return out
