"""Loading a LLaVA-style vision-language model with its processor, and frozen CLIP / text encoders, by the same
conventions as `lab.models.load_model`: a local folder (written by `save_pretrained`) or a hub id already in the
local Hugging Face cache, `device_map="auto"` (accelerate) on CUDA, the dtype asked, one `ModelNotAvailable`
sentence for anything that cannot be loaded.

`load_vlm` reads the model's config first and refuses a text-only model (no vision tower, not an image-text-to-text
architecture) before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from torch import nn

from lab.models.pretrained import ModelNotAvailable

VLM_EXAMPLE = "llava-hf/llava-1.5-7b-hf"


class Encoders(NamedTuple):
    """The frozen encoders: a CLIP vision tower with its image processor, a text encoder with its tokenizer."""

    image: nn.Module
    image_processor: object
    text: nn.Module
    tokenizer: object


def _source(name: str) -> tuple[str, bool]:
    local = Path(os.path.expanduser(name))
    return (str(local), True) if local.is_dir() else (name, False)


def _unavailable(what: str, name: str, is_local: bool, e: Exception) -> ModelNotAvailable:
    """`load_model`'s sentences: a folder without a model, or a hub id not in the local cache."""
    if is_local:
        return ModelNotAvailable(f"{what} {name!r} is a folder but holds no loadable model ({e}).")
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    why = "the hub is switched off (HF_HUB_OFFLINE=1)" if offline else "the hub could not be reached"
    return ModelNotAvailable(f"{what} {name!r} is not a local folder and is not in the local Hugging Face cache, and "
                             f"{why}; download it on a connected machine (huggingface-cli download) and pass its "
                             "folder path.")


def _config(what: str, name: str):
    """`(config, source, is_local)`; reads config.json only."""
    from transformers import AutoConfig

    source, is_local = _source(name)
    try:
        return AutoConfig.from_pretrained(source), source, is_local
    except (OSError, ValueError) as e:
        raise _unavailable(what, name, is_local, e) from e


def is_vision_language(config) -> bool:
    """A config with a vision tower, or of an architecture `transformers` maps to image-text-to-text."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "vision_config", None) is not None or \
        config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vision_language_config(name: str):
    """`(config, source, is_local)` of a vision-language model, from its config.json alone; a text-only model (e.g. a
    `LlamaForCausalLM`) is refused with one sentence."""
    config, source, is_local = _config("model", name)
    if not is_vision_language(config):
        raise ModelNotAvailable(f"model={name!r} is a text-only {config.model_type!r} model (its config has no vision "
                                "tower); EMI measures a vision-language model's answers to image questions, so pass a "
                                f"LLaVA-style model (e.g. {VLM_EXAMPLE}).")
    return config, source, is_local


def load_vlm(name: str, *, device: str = "cpu", dtype=None):
    """`(model, processor)` of a vision-language model (`AutoModelForImageTextToText`, e.g. LLaVA-1.5/1.6 as
    `llava-hf/*`) and its `AutoProcessor`. A text-only model is refused from its config, before its weights are
    read; on `device="cuda"` the weights spread with `device_map="auto"`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    source, is_local = vision_language_config(name)[1:]
    try:
        spread = {"device_map": "auto"} if device == "cuda" else {}
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, **spread)
        processor = AutoProcessor.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _unavailable("model", name, is_local, e) from e
    return (model if device == "cuda" else model.to(device)).eval(), processor


def load_encoders(image_encoder: str, text_encoder: str, *, device: str = "cpu", dtype=None) -> Encoders:
    """The frozen encoders: the vision tower of a CLIP model (`CLIPModel.vision_model` of a full checkpoint such as
    `openai/clip-vit-base-patch32`, as the official EMI code, or a vision-only `CLIPVisionModel`) with its image
    processor, and a text encoder (`AutoModel`, e.g. `FacebookAI/xlm-roberta-base`) with its tokenizer. Each is one
    sentence when it cannot be loaded."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer, CLIPModel, CLIPVisionModel

    config, source, is_local = _config("image_encoder", image_encoder)
    if config.model_type not in ("clip", "clip_vision_model"):
        raise ModelNotAvailable(f"image_encoder={image_encoder!r} is a {config.model_type!r} model; the image "
                                "encoder is a CLIP model (e.g. openai/clip-vit-base-patch32).")
    try:
        tower = CLIPModel if config.model_type == "clip" else CLIPVisionModel  # a full CLIP: its vision tower
        image = tower.from_pretrained(source, dtype=dtype)
        image = getattr(image, "vision_model", image)
        image_processor = AutoImageProcessor.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _unavailable("image_encoder", image_encoder, is_local, e) from e
    _, source, is_local = _config("text_encoder", text_encoder)
    try:
        text = AutoModel.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _unavailable("text_encoder", text_encoder, is_local, e) from e
    return Encoders(image.to(device).eval(), image_processor, text.to(device).eval(), tokenizer)
