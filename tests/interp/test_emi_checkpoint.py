"""EMI on a checkpoint: image–question sets by scenario through `datasets`, the VLM and encoder loaders (a text-only
model refused before its weights are read), greedy answers against a hand-written argmax loop, the repo's pooled
embeddings against one-by-one runs, the CLUB loaded or trained, EMI / EMID / bound per shift, and notebook 04 run
end to end on a tiny saved LLaVA, CLIP and text encoder."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lab.core.params import ParamError
from lab.data.load import DataNotAvailable, image_questions
from lab.interp import emi as E
from lab.interp import emi_checkpoint as ec
from lab.models import ModelNotAvailable

WORDS = "USER: ASSISTANT: what is in the image a red blue cat dog square circle left right".split()
TEMPLATE = ("{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:"
            "{% endif %}")
ROWS = [("coco", "what is in the image", "a red cat"), ("coco", "what is left", "a blue dog"),
        ("coco", "what is right", "a red square"), ("wild", "what is in the image", "a blue circle"),
        ("wild", "what is left", "a cat"), ("wild", "what is right", "a dog"),
        ("hard", "what is in the image", "a red dog"), ("hard", "what is left", "a blue square")]


def _tokenizer():
    """The word-level tokenizer with `<image>` as a special token and a `<bos>` before every text (as LLaMA's and
    XLM-R's tokenizers put `<s>`)."""
    from tokenizers import processors

    from lab.models.tokenizer import SPECIALS, word_tokenizer

    tok = word_tokenizer(WORDS, specials=(*SPECIALS, "<image>"))
    tok.add_tokens(["<image>"], special_tokens=True)
    bos = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.backend_tokenizer.post_processor = bos
    return tok


def _image_processor():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _save_models(tmp_path) -> dict:
    """A tiny LLaVA with its processor, a tiny CLIP, a tiny XLM-R text encoder and a text-only Llama, saved."""
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    from lab.models import tiny_llama

    tok = _tokenizer()
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=len(tok), max_position_embeddings=64, num_key_value_heads=2, pad_token_id=0,
                       bos_token_id=2, eos_token_id=3, **small)
    vlm = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=8, **small), text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=16, vision_feature_layer=-1))
    vlm.save_pretrained(tmp_path / "vlm")
    LlavaProcessor(image_processor=_image_processor(), tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default", chat_template=TEMPLATE).save_pretrained(tmp_path / "vlm")
    clip = CLIPModel(CLIPConfig(text_config=dict(vocab_size=50, max_position_embeddings=16, **small),
                                vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16))
    clip.save_pretrained(tmp_path / "clip")
    _image_processor().save_pretrained(tmp_path / "clip")
    XLMRobertaModel(XLMRobertaConfig(vocab_size=len(tok), max_position_embeddings=40, pad_token_id=0, bos_token_id=2,
                                     eos_token_id=3, **small)).save_pretrained(tmp_path / "text")
    tok.save_pretrained(tmp_path / "text")
    tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    return {k: str(tmp_path / k) for k in ("vlm", "clip", "text", "llama")}


def _save_images(folder, rows=ROWS) -> list:
    """PNG images of varied sizes beside a metadata.jsonl (file_name, question, answer, shift); the images back."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g, images, meta = torch.Generator().manual_seed(0), [], []
    for i, (shift, q, a) in enumerate(rows):
        px = torch.randint(0, 256, (32 + 8 * (i % 3), 40, 3), dtype=torch.uint8, generator=g).numpy()
        Image.fromarray(px).save(folder / f"{i}.png")
        images.append(Image.open(folder / f"{i}.png").convert("RGB"))
        meta.append({"file_name": f"{i}.png", "question": q, "answer": a, "shift": shift})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    return images


def _same_image(a, b) -> bool:
    return a.size == b.size and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------------------------------------ data

def test_image_questions_from_an_image_folder_a_jsonl_and_splits(tmp_path, monkeypatch):
    import datasets

    images = _save_images(tmp_path / "folder")
    sets = image_questions(str(tmp_path / "folder"))
    assert list(sets) == ["coco", "wild", "hard"]  # order of first appearance
    flat = [r for rows in sets.values() for r in rows]
    assert [(r["question"], r["reference"]) for r in flat] == [(q, a) for _, q, a in ROWS]
    assert all(_same_image(r["image"], im) for r, im in zip(flat, images))
    assert [len(v) for v in image_questions(str(tmp_path / "folder"), n=2).values()] == [2, 2, 2]
    # a JSONL whose `image` column holds paths relative to the file, reference as `reference_answer`
    lines = [{"image": f"folder/{i}.png", "question": q, "reference_answer": a, "shift": s}
             for i, (s, q, a) in enumerate(ROWS)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    again = image_questions(str(tmp_path / "qa.jsonl"))
    assert list(again) == list(sets) and all(_same_image(a["image"], b["image"]) and a["reference"] == b["reference"]
                                             for k in sets for a, b in zip(again[k], sets[k]))
    # a cached dataset whose splits are the scenarios (the LLaVA-Bench shift sets' layout)
    ds = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "folder"), split="train").remove_columns("shift")
    splits = datasets.DatasetDict({"coco": ds.select([0, 1]), "wild": ds.select([2])})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None: splits)
    got = image_questions("org/shifts")
    assert {k: [r["question"] for r in v] for k, v in got.items()} == {"coco": [ROWS[0][1], ROWS[1][1]],
                                                                        "wild": [ROWS[2][1]]}


def test_image_questions_names_the_missing_columns(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"image": "x.png", "prompt": "q"}) + "\n")
    with pytest.raises(DataNotAvailable, match=r"lacks the column\(s\) 'question', 'reference_answer' or 'answer'.*"
                                               r"it has image, prompt"):
        image_questions(str(tmp_path / "bad.jsonl"))


# ---------------------------------------------------------------------------------------------------- models

def test_a_text_only_model_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from lab.models import load_vlm

    paths = _save_models(tmp_path)

    def read_weights(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(read_weights))
    with pytest.raises(ModelNotAvailable, match="text-only 'llama' model .* LLaVA-style"):
        load_vlm(paths["llama"])
    with pytest.raises(ModelNotAvailable, match="text-only 'llama' model"):  # before the data is even looked at
        ec.checkpoint(paths["llama"], "", paths["clip"], paths["text"], ec.Config())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailable, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE=1"):
        load_vlm("no-such-org/no-such-vlm-xyz")


def test_loaders_give_the_saved_models_and_refuse_a_non_clip_image_encoder(tmp_path):
    from transformers import CLIPModel

    from lab.models import load_encoders, load_vlm

    paths = _save_models(tmp_path)
    vlm, processor = load_vlm(paths["vlm"])
    assert vlm.config.model_type == "llava" and not vlm.training and processor.chat_template == TEMPLATE
    enc = load_encoders(paths["clip"], paths["text"])
    clip = CLIPModel.from_pretrained(paths["clip"])
    assert enc.image.state_dict().keys() == clip.vision_model.state_dict().keys()
    assert all(torch.equal(a, clip.vision_model.state_dict()[k]) for k, a in enc.image.state_dict().items())
    with pytest.raises(ModelNotAvailable, match="is a 'xlm-roberta' model; the image encoder is a CLIP model"):
        load_encoders(paths["text"], paths["text"])


# ------------------------------------------------------------------------------------------- answers, embeddings

def test_answers_are_the_greedy_argmax_continuation(tmp_path):
    from lab.models import load_vlm

    paths = _save_models(tmp_path)
    vlm, processor = load_vlm(paths["vlm"])
    images = _save_images(tmp_path / "data")
    rows = [{"image": im, "question": q} for im, (_, q, _) in zip(images, ROWS)][:5]
    assert ec.prompt(processor, "what is left") == "USER: <image> what is left ASSISTANT:"
    got = ec.answers(vlm, processor, rows, max_new_tokens=5, batch_size=2)  # batches of unequal prompt lengths
    tok = processor.tokenizer
    for row, answer in zip(rows, got):  # one row at a time, argmax by hand, stop at <eos>
        x = processor(images=[row["image"]], text=[ec.prompt(processor, row["question"])], return_tensors="pt")
        ids, new = x["input_ids"], []
        for _ in range(5):
            with torch.no_grad():
                nxt = vlm(input_ids=ids, pixel_values=x["pixel_values"]).logits[0, -1].argmax().item()
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert answer == tok.decode(new, skip_special_tokens=True).strip()


def test_embeddings_are_the_repos_pooled_and_normalised_features(tmp_path):
    from transformers import CLIPVisionModel, XLMRobertaModel

    from lab.models import load_encoders

    paths = _save_models(tmp_path)
    enc = load_encoders(paths["clip"], paths["text"])
    images = _save_images(tmp_path / "data")
    texts = ["a red cat", "what is in the image left right", "", "dog"]
    clip, xlmr, tok = CLIPVisionModel.from_pretrained(paths["clip"]), XLMRobertaModel.from_pretrained(paths["text"]), \
        enc.tokenizer
    with torch.no_grad():
        for layer in (0, 1):
            got = ec.embed_texts(enc, texts, layer=layer, batch_size=3)  # padded batches
            for t, g in zip(texts, got):
                ids = tok(t, return_tensors="pt")["input_ids"]  # alone: no padding
                assert ids[0, 0] == 2  # <bos>, the token the mean skips
                h = xlmr(input_ids=ids, output_hidden_states=True).hidden_states[layer][0, 1:]
                ref = h.mean(0) / h.mean(0).norm() if len(h) else torch.zeros_like(g)
                torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
        got = ec.embed_images(enc, images, batch_size=3)
        for im, g in zip(images, got):
            px = enc.image_processor(images=[im], return_tensors="pt")["pixel_values"]
            h = clip(pixel_values=px).last_hidden_state
            ref = h[0, 1:].mean(0)
            torch.testing.assert_close(g, ref / ref.norm(), atol=1e-5, rtol=1e-5)
    assert got.shape == (len(images), 16)


# ----------------------------------------------------------------------------------------------- EMI per shift

def _scen(d: int = 6, n: int = 10) -> dict:
    g = torch.Generator().manual_seed(0)
    unit = lambda: torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
    out = {}
    for name in ("id", "a", "b"):
        zv, zt, ym, yr = unit(), unit(), unit(), unit()
        out[name] = {"zv": zv, "zt": zt, "z": (zv + zt) / 2, "ym": ym, "yr": yr}
    return out


def test_measure_is_emi_emid_and_the_scale_adjusted_bound_by_hand():
    scen = _scen()
    torch.manual_seed(1)
    club = E.CLUB(6, 6, 8).eval()

    def club_by_hand(x, y):  # the repo's CLUB.forward, written out
        mu, var = club.p_mu(x), club.p_logvar(x).exp()
        pos = (-(mu - y) ** 2 / 2 / var).sum(1)
        neg = torch.stack([(-(y - mu[i]) ** 2).mean(0) / 2 / var[i] for i in range(len(x))]).sum(1)
        return (pos - neg).mean().item()

    rows, shifts = ec.measure(scen, club, "id")
    emi = {k: club_by_hand(s["z"], s["ym"]) - club_by_hand(s["z"], s["yr"]) for k, s in scen.items()}
    assert list(shifts) == ["a", "b"] and rows["id"]["n"] == 10
    for k in scen:
        assert rows[k]["EMI"] == pytest.approx(emi[k], abs=1e-5)
        assert rows[k]["I(query; answer)"] - rows[k]["I(query; reference)"] == pytest.approx(emi[k], abs=1e-5)
    for k, s in shifts.items():
        assert s["EMID"] == pytest.approx(emi["id"] - emi[k], abs=1e-5)  # ID − OOD
        assert s["JSD_v"] == E.jsd_cov(scen["id"]["zv"], scen[k]["zv"])
        assert s["JSD_t"] == E.jsd_cov(scen["id"]["zt"], scen[k]["zt"])
        assert s["JSD_PY"] == E.jsd_cov(scen["id"]["ym"], scen["id"]["yr"])
        assert s["JSD_QY"] == E.jsd_cov(scen[k]["ym"], scen[k]["yr"])
        assert s["bound"] == pytest.approx(math.sqrt(s["JSD_v"]) + math.sqrt(s["JSD_t"]) + s["JSD_PY"] ** 0.25
                                           + s["JSD_QY"] ** 0.25)


def test_estimator_loads_the_repos_state_dict_or_trains_on_the_pooled_pairs(tmp_path):
    scen = _scen()
    torch.manual_seed(2)
    saved = E.CLUB(6, 6, 10)
    torch.save(saved.state_dict(), tmp_path / "club.pt")
    cfg = ec.Config(club_hidden=8, club_steps=20, club_batch=16)
    loaded = ec.estimator(scen, cfg, club=str(tmp_path / "club.pt"))
    s = scen["a"]
    assert loaded(s["z"], s["ym"]).item() == saved(s["z"], s["ym"]).item()
    trained = ec.estimator(scen, cfg, seed=3)
    ref = E.fit_club(torch.cat([torch.cat([s["z"], s["z"]]) for s in scen.values()]),
                     torch.cat([torch.cat([s["yr"], s["ym"]]) for s in scen.values()]),
                     hidden=8, steps=20, lr=cfg.club_lr, batch_size=16, seed=3)
    for a, b in zip(trained.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    torch.save(E.CLUB(5, 5, 10).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ParamError, match="scores 5-d embeddings; the encoders give 6-d ones"):
        ec.estimator(scen, cfg, club=str(tmp_path / "other.pt"))


def test_config_keeps_the_scale_unless_given():
    assert ec.Config.for_scale("smoke", n_queries=0, max_new_tokens=None).max_new_tokens == 64
    full = ec.Config.for_scale("full", n_queries=30, club_steps=0)
    assert (full.n_queries, full.max_new_tokens, full.club_steps) == (30, 512, 2000)


# ---------------------------------------------------------------------------------------------- the notebook

@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_llava_and_image_sets_is_measured(tmp_path):
    from lab.models import load_encoders, load_vlm

    from ..conftest import run_lab

    paths = _save_models(tmp_path)
    _save_images(tmp_path / "data")
    torch.manual_seed(0)
    torch.save(E.CLUB(16, 16, 12).state_dict(), tmp_path / "club.pt")
    proc = run_lab("run", "04_emi", "-p", "model", paths["vlm"], "-p", "data", str(tmp_path / "data"),
                   "-p", "image_encoder", paths["clip"], "-p", "text_encoder", paths["text"], "-p", "id_shift", "wild",
                   "-p", "max_new_tokens", "4", "-p", "club_checkpoint", str(tmp_path / "club.pt"),
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "04_emi.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["id"] == "wild" and list(ck["shifts"]) == ["coco", "hard"] and ck["model"]["type"] == "llava"
    # the same numbers from lab.interp.emi on the same answers and embeddings
    cfg = ec.Config(max_new_tokens=4)
    sets, (vlm, processor) = image_questions(str(tmp_path / "data")), load_vlm(paths["vlm"])
    enc = load_encoders(paths["clip"], paths["text"])
    scen = {}
    for name, rows in sets.items():
        said = ec.answers(vlm, processor, rows, max_new_tokens=4)
        assert [e["answer"] for e in ck["examples"][name]] == said[:2]
        scen[name] = ec.embed(enc, rows, said, cfg)
    club = ec.estimator(scen, cfg, club=str(tmp_path / "club.pt"))
    for name, s in scen.items():
        value = ck["scenarios"][name]["EMI"]
        assert math.isfinite(value) and value == pytest.approx(E.emi(club, s["z"], s["ym"], s["yr"]), abs=1e-6)
    ID = scen["wild"]
    for name, s in ck["shifts"].items():
        jsd = (E.jsd_cov(ID["zv"], scen[name]["zv"]), E.jsd_cov(ID["zt"], scen[name]["zt"]),
               E.jsd_cov(ID["ym"], ID["yr"]), E.jsd_cov(scen[name]["ym"], scen[name]["yr"]))
        assert all(math.isfinite(v) for v in s.values())
        assert s["EMID"] == pytest.approx(ck["scenarios"]["wild"]["EMI"] - ck["scenarios"][name]["EMI"], abs=1e-9)
        assert s["bound"] == pytest.approx(E.upper_bound(*jsd), abs=1e-6)
