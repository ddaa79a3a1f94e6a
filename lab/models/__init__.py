"""Tiny model zoo, a tiny model's spec with its pre-training (`TinyLM`), word-level tokenizer, cached trainer,
pretrained loading."""

from lab.models.pretrained import ModelNotAvailable, load_model, load_reward_model
from lab.models.spec import TinyLM
from lab.models.tokenizer import word_tokenizer
from lab.models.train import TrainConfig, TrainResult, cache_dir, fit, optimize, train
from lab.models.vlm import Encoders, load_encoders, load_vlm
from lab.models.zoo import ZOO, build, tiny_hybrid, tiny_llama, tiny_mamba2, tiny_mixtral

__all__ = ["ModelNotAvailable", "load_model", "load_reward_model", "word_tokenizer", "TrainConfig", "TrainResult",
           "cache_dir", "fit", "optimize", "train", "ZOO", "build", "tiny_llama", "tiny_mamba2", "tiny_mixtral",
           "tiny_hybrid", "TinyLM"]

__all__ += ["Encoders", "load_encoders", "load_vlm"]
