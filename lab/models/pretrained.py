"""Loading real checkpoints (full scale) by the same code path as saved tiny models."""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotAvailable(RuntimeError):
    """A model is neither a local folder nor reachable on the hub."""


def placement(device: str, env=None) -> dict:
    """`from_pretrained`'s placement: on CUDA `device_map="auto"` (a model larger than one GPU spreads over the GPUs
    present); under a distributed launch (`accelerate launch`, `torchrun`: WORLD_SIZE > 1) every process holds the
    whole model on its own GPU, `{"": LOCAL_RANK}`, as data-parallel training needs (accelerate refuses to train a
    model spread by "auto" over several processes); elsewhere nothing (the model is moved to `device`)."""
    env = os.environ if env is None else env
    if device != "cuda":
        return {}
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return {"device_map": {"": int(env.get("LOCAL_RANK", "0"))}}
    return {"device_map": "auto"}


def load_model(name_or_path: str, *, device: str = "cpu", dtype=None, attn_implementation: str = "eager"):
    """`(model, tokenizer)` from a local folder (written by `save_pretrained`) or a hub id.

    On `device="cuda"` the weights load with `device_map="auto"` (accelerate), so a model larger than one
    GPU spreads over the GPUs present (and CPU memory after them), or under a distributed launch one whole copy per
    process on its own GPU (`placement`); otherwise the model moves to `device`.
    The tokenizer is None when the folder has none. Offline (no network, or `HF_HUB_OFFLINE=1`, as
    smoke scale sets) a hub id that is not in the local Hugging Face cache raises
    `ModelNotAvailable` with one sentence saying so.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(os.path.expanduser(name_or_path))
    is_local = local.is_dir()
    source = str(local) if is_local else name_or_path
    try:
        spread = placement(device)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                                     **spread)
    except (OSError, ValueError) as e:
        if is_local:
            raise ModelNotAvailable(f"{name_or_path!r} is a folder but holds no loadable model ({e}).") from e
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "the hub is switched off (HF_HUB_OFFLINE=1)" if offline else "the hub could not be reached"
        raise ModelNotAvailable(f"model {name_or_path!r} is not a local folder and is not in the local Hugging "
                                f"Face cache, and {why}; download it on a connected machine "
                                "(huggingface-cli download) and pass its folder path.") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = None
    return (model if device == "cuda" else model.to(device)).eval(), tokenizer


def load_reward_model(name_or_path: str, *, device: str = "cpu", dtype=None):
    """`(model, tokenizer)` of a scalar reward model: a `transformers` sequence-classification model with one label
    (e.g. `OpenAssistant/reward-model-deberta-v3-large-v2`, Skywork-Reward), from a folder or the local HF cache.
    Anything else is refused with one sentence (`ModelNotAvailable`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    local = Path(os.path.expanduser(name_or_path))
    source = str(local) if local.is_dir() else name_or_path
    try:
        spread = placement(device)
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype, **spread)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelNotAvailable(f"reward model {name_or_path!r} is neither a folder with a sequence-classification "
                                f"model and its tokenizer nor such a model in the local Hugging Face cache "
                                f"({type(e).__name__}).") from e
    if model.config.num_labels != 1:
        raise ModelNotAvailable(f"reward model {name_or_path!r} has {model.config.num_labels} labels; a reward model "
                                "scores with one (num_labels=1).")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return (model if device == "cuda" else model.to(device)).eval(), tokenizer
