"""Zero-shot evaluation goes through lm-eval's own `simple_evaluate` (stubbed here: its tasks need the network)."""

from __future__ import annotations

import sys
import types

import pytest

from lab.models.evaluate import zero_shot


def test_zero_shot_calls_lm_eval_and_keeps_the_numbers(monkeypatch):
    calls = []

    def simple_evaluate(**kw):
        calls.append(kw)
        return {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.01},
                            "boolq": {"acc,none": 1, "flag": True}}}

    pkg = types.ModuleType("lm_eval")
    pkg.evaluator = types.SimpleNamespace(simple_evaluate=simple_evaluate)
    monkeypatch.setitem(sys.modules, "lm_eval", pkg)
    got = zero_shot("/models/merged", ["arc_easy", "boolq"], device="cuda", limit=10)
    assert got == {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.01}, "boolq": {"acc,none": 1.0}}
    assert calls == [{"model": "hf", "model_args": "pretrained=/models/merged,dtype=auto",
                      "tasks": ["arc_easy", "boolq"], "num_fewshot": 0, "batch_size": "auto", "device": "cuda",
                      "limit": 10}]


def test_missing_lm_eval_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` raise ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[eval\]'"):
        zero_shot("/x", ["arc_easy"])
