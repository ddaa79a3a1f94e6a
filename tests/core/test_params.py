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


@pytest.mark.parametrize("value, default, want", [
    (3, 1, 3), (2, 0.5, 2.0), (0.25, 0.5, 0.25), (False, True, False), (2024, "", "2024"), ("x.jsonl", "", "x.jsonl"),
    (None, "", "")])
def test_knob_overrides_take_their_defaults_type(value, default, want):
    from lab.core.params import check_type

    got = check_type("knob", value, default)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value, default", [("abc", 0.5), (2.5, 3), (True, 3), (True, 0.5), (1, True), (True, "")])
def test_knob_overrides_of_another_type_are_one_sentence(value, default):
    from lab.core.params import check_type

    with pytest.raises(ParamError) as e:
        check_type("knob", value, default)
    assert str(e.value).startswith(f"knob={value!r} is not ") and "\n" not in str(e.value)


def test_limits_are_chained_comparisons_checked_at_their_bounds():
    from lab.core.params import check_limits, limit_names

    limits = ("0 < s < 1", "1 <= held_out < n", "lr > 0", "-1 <= t", "s <= 0.4 or 2 * k * s < 1 + k",
              "r <= 0 or r >= 8")
    ok = {"s": 0.5, "held_out": 1, "n": 2, "lr": 1e-9, "t": -1, "k": 3.0, "r": 0}
    check_limits(limits, ok)
    for bad, words in [({"s": 0.0}, "s=0.0: out of range; this notebook needs 0 < s < 1."),
                       ({"s": 1}, "needs 0 < s < 1"), ({"held_out": 2}, "held_out=2, n=2: out of range"),
                       ({"held_out": 0}, "needs 1 <= held_out < n"), ({"lr": 0}, "lr=0"), ({"t": -1.5}, "t=-1.5"),
                       ({"s": 0.7}, "s=0.7, k=3.0: out of range; this notebook needs s <= 0.4 or 2 \\* k \\* s"),
                       ({"r": 3}, "r=3: out of range")]:
        with pytest.raises(ParamError, match=words.replace("(", r"\(")):
            check_limits(limits, {**ok, **bad})
    check_limits(limits, {**ok, "s": 0.6, "r": 8})  # Olica's Q/K rank at k = 3 stays positive up to s < 2/3
    check_limits(limits, {k: v for k, v in ok.items() if k != "k"})  # a copy without knob k: its limit is moot
    assert limit_names("1 <= held_out < n") == ["held_out", "n"] and limit_names("s <= 0.4 or 2 * k * s < 1") == [
        "s", "k"]
    for wrong in ("s == 1", "s + 1", "f(s) < 1", "s", "s < 1 if s else 0", "s ** 2 < 1", "s < 'a'"):
        with pytest.raises(ValueError):
            limit_names(wrong)
