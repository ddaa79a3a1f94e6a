"""FloE on a checkpoint: the family check (before any weight is read), and notebook 05 run end to end on a tiny saved
Mixtral loaded back by path (the kept fraction it reports is `floe.kept_fraction`, tested in test_floe.py)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from lab.core.params import ParamError
from lab.models.tokenizer import word_tokenizer
from lab.models.zoo import tiny_llama, tiny_mixtral
from lab.moe import blocks
from lab.moe import floe as fl
from lab.moe import floe_checkpoint as fc

from ..conftest import save_tiny_moe

WORDS = [f"w{i}" for i in range(30)]


def test_a_dense_model_is_refused_from_its_config_alone(tmp_path):
    tok = word_tokenizer(WORDS)
    tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4).save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # no weights: a refusal that reads them could not say "llama"
    with pytest.raises(ParamError, match="is a 'llama' model without sparse-MoE experts") as e:
        fc.load_moe(str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_model_larger_than_the_device_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    tok = word_tokenizer(WORDS)
    net = tiny_mixtral(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4, d_ff=64, n_experts=4)
    net.save_pretrained(tmp_path)
    n = sum(p.numel() for p in net.parameters())
    n_exp = sum(p.numel() for m in blocks.moe_blocks(net) for p in m.experts.parameters())
    assert fc.counts(str(tmp_path)) == {"params": n, "experts": n_exp, "layers": 2}
    assert fc.need_bytes(str(tmp_path), "cuda") == int(4 * (n + n_exp / 2))
    need = fc.need_bytes(str(tmp_path), "cpu")
    assert need == int(4 * (n + n_exp / 2 + fc.SIM_FORMS * n_exp))
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # a refusal that read the weights could not get past this
    monkeypatch.setattr(fc, "memory", lambda device: need - 1)
    msg = "needs 0 GB for this analysis with the model in float32, and this cpu has 0 GB; hold it in bfloat16"
    with pytest.raises(ParamError, match=msg) as e:
        fc.load_moe(str(tmp_path))
    assert "\n" not in str(e.value)
    assert fc.need_bytes(str(tmp_path), "cpu", "bfloat16") == need - 2 * n
    with pytest.raises(ParamError, match="dtype='float16' is not a precision"):
        fc.load_moe(str(tmp_path), dtype="float16")
    monkeypatch.setattr(fc, "memory", lambda device: need)  # fits: on to loading, which finds no weights
    with pytest.raises(Exception, match="no loadable model|safetensors|weights"):
        fc.load_moe(str(tmp_path))


def _live_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process (each storage once)."""
    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu":
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_analysis_holds_no_more_than_it_asks_for(tmp_path, monkeypatch, dtype):
    """`need_bytes`, the bound `load_moe` refuses a model by, holds for what `checkpoint` keeps alive: the tensor
    bytes live after every decode, loss and layer-error pass stay under it (measured over the process's tensors),
    with the model held in float32 or bfloat16; and every engine ran while no analysis held the experts it released
    (held bytes 0)."""
    from lab.moe import offload

    ckpt, text = save_tiny_moe(tmp_path, WORDS, lines=20, d_model=64, n_layers=3, n_heads=4, d_ff=256, n_experts=8)
    base, peak = _live_bytes(), [0]

    def sampled(fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            peak[0] = max(peak[0], _live_bytes() - base)
            return out
        return wrapped

    for mod, name in ((blocks, "layer_errors"), (blocks, "eval_loss"), (offload.OffloadEngine, "run")):
        monkeypatch.setattr(mod, name, sampled(getattr(mod, name)))
    ck = fc.checkpoint(str(ckpt), str(text), fl.Config.for_scale("smoke"), n_blocks=2, block_len=16, dtype=dtype)
    need = fc.need_bytes(str(ckpt), "cpu", dtype)
    model = fc.DTYPES[dtype].itemsize * fc.counts(str(ckpt))["params"]
    assert model < peak[0] <= need, (peak[0] / model, need / model)
    assert all(r["held"] == 0 for r in ck["engine"].values())


@pytest.mark.timeout(300)
def test_a_bfloat16_model_is_measured_as_its_float32_twin(tmp_path, monkeypatch):
    """With the model held in bfloat16 the analysis still runs in float32 (every activation and reference expert
    output computed on float32 inputs): on weights that bfloat16 holds exactly, the bfloat16 run's measurements match
    those of the same weights held in float32, up to the bfloat16 rounding of the hidden states; and the bfloat16
    model's engine moves half-precision bytes as the float32 one does."""
    from transformers import AutoModelForCausalLM

    seen = set()

    def spied(fn):
        def spy(x, *W):
            seen.add(x.dtype)
            return fn(x, *W)
        return spy

    for mod, name in ((fl, "activations"), (blocks, "expert")):
        monkeypatch.setattr(mod, name, spied(getattr(mod, name)))

    ckpt, text = save_tiny_moe(tmp_path, WORDS, lines=20, d_model=64, n_layers=3, n_heads=4, d_ff=128, n_experts=4)
    net = AutoModelForCausalLM.from_pretrained(ckpt)
    net.to(torch.bfloat16).to(torch.float32).save_pretrained(ckpt)  # float32 weights bfloat16 holds exactly
    run = {dt: fc.checkpoint(str(ckpt), str(text), fl.Config.for_scale("smoke"), n_blocks=2, block_len=16, dtype=dt)
           for dt in fc.DTYPES}
    a, b = run["float32"], run["bfloat16"]
    assert b["model"]["dtype"] == "bfloat16" and a["model"]["params"] == b["model"]["params"]
    assert b["loss"] == pytest.approx(a["loss"], rel=0.01)
    kept = "reached with INT2 W_up"
    assert abs(b["kept_fraction"][kept] - a["kept_fraction"][kept]) <= 0.02
    for on in fl.MATRICES:
        assert b["sparsity_errors"][on] == pytest.approx(a["sparsity_errors"][on], rel=0.1)
    for name, v in a["variants"].items():
        assert b["variants"][name]["err"] == pytest.approx(v["err"], rel=0.1), name
    assert {n: r["bytes"] for n, r in b["engine"].items()} == {n: r["bytes"] for n, r in a["engine"].items()}
    assert seen == {torch.float32}


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_mixtral_is_measured(tmp_path):
    from ..conftest import run_lab

    ckpt, text = save_tiny_moe(tmp_path, WORDS, lines=40, d_model=32, n_layers=3, n_heads=4, d_ff=64, n_experts=4)
    proc = run_lab("run", "05_floe", "-p", "model", str(ckpt), "-p", "data", str(text),
                   "-p", "n_blocks", "2", "-p", "block_len", "32", "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "05_floe.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["model"]["type"] == "mixtral" and ck["model"]["experts"] == 4
    assert set(ck["engine"]) >= {"FP16 on demand", "FloE keep 0.2"} and set(ck["sparsity_errors"]) == set(fl.MATRICES)
    eng = ck["engine"]
    assert eng["FloE keep 0.2"]["bytes"] < eng["FP16 on demand"]["bytes"]  # FloE moves fewer bytes than FP16 experts
    kept = ck["kept_fraction"]
    assert kept["target"] == pytest.approx(0.2) and 0 < kept["reached with INT2 W_up"] < 1
    assert 0 < kept["thresholds of the full-precision W_up"] < 1
