import pytest

from lab.core import ParamError, Params, validate


def test_defaults_resolve_device():
    p = validate()
    assert p == Params("smoke", p.device, 0, "tiny") and p.device in ("cpu", "cuda")
    assert p.scale == "smoke" and validate("full").scale == "full"


@pytest.mark.parametrize("kw, words", [
    (dict(scale="huge"), ["'huge'", "'smoke'", "'full'"]),
    (dict(device="tpu"), ["'tpu'", "'auto'", "'cpu'", "'cuda'"]),
    (dict(seed=-1), ["-1"]), (dict(seed=True), ["True"]), (dict(seed="3"), ["'3'"]),
    (dict(model="/no/such/dir"), ["'/no/such/dir'", "does not exist"]),
    (dict(model="./relative/missing"), ["does not exist"]),
    (dict(model="not a hub id!"), ["not a hub id!"]),
])
def test_bad_values_are_one_sentence(kw, words):
    with pytest.raises(ParamError) as e:
        validate(**kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".")
    for w in words:
        assert w in msg


def test_cuda_without_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ParamError, match="no CUDA GPU"):
        validate(device="cuda")
    assert validate(device="auto").device == "cpu"


def test_models_tiny_folder_or_hub_id(tmp_path):
    assert validate(model="tiny").tiny
    assert validate(model=str(tmp_path)).model == str(tmp_path)
    assert validate(model="meta-llama/Llama-3.1-8B-Instruct").model == "meta-llama/Llama-3.1-8B-Instruct"
    assert validate(model="gpt2").model == "gpt2"
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ParamError, match="not a folder"):
        validate(model=str(tmp_path / "file.bin"))


def test_require_tiny_names_the_model_and_the_way_out(tmp_path):
    validate().require_tiny("x")  # tiny passes
    with pytest.raises(ParamError, match=r"model='gpt2' is not supported here yet: the LM path is not built; use"):
        validate(model="gpt2").require_tiny("the LM path is not built")
