"""The agents' model backends: JSON parsing and retry, a local LM against a hand-written greedy loop, and the
OpenAI-compatible HTTP backend against a real server on 127.0.0.1 (never a mocked client, never off this machine)."""

from __future__ import annotations

import pytest
import torch

from lab.agents.backends import BackendError, LocalLM, Offline, OpenAIHTTP, complete_json, first_json, from_spec, serve
from lab.core.params import ParamError

WORDS = "user system assistant : is the answer yes no one two three { } \" , a b c".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ..conftest import save_tiny_lm

    return str(save_tiny_lm(tmp_path_factory.mktemp("agent"), WORDS, d_model=32, n_layers=2, n_heads=4, max_len=128))


def test_first_json_skips_prose_fences_and_broken_objects():
    assert first_json('Sure! ```json\n{"a": 1, "b": {"c": [2]}}\n``` done') == {"a": 1, "b": {"c": [2]}}
    assert first_json('{broken {"x": "}"}') == {"x": "}"}
    with pytest.raises(ValueError):
        first_json("[1, 2] no object here")


def test_complete_json_retries_with_the_error_then_gives_one_sentence():
    seen = []

    def agent(messages):
        seen.append(messages)
        return 'I think {"p": 0.5}' if len(seen) == 1 else '{"p": 0.5, "stat": "t"}'

    assert complete_json(Offline(agent, "two-tries"), [{"role": "user", "content": "go"}], ["p", "stat"]) == \
        {"p": 0.5, "stat": "t"}
    assert "lacks 'stat'" in seen[1][-1]["content"] and seen[1][-2]["role"] == "assistant"
    with pytest.raises(BackendError, match="no JSON object with keys") as e:
        complete_json(Offline(lambda m: "no", "mute"), [{"role": "user", "content": "go"}], ["p"], retries=1)
    assert "\n" not in str(e.value)


def test_local_lm_is_greedy_decoding_of_the_plain_prompt(tiny):
    lm = LocalLM(tiny)
    messages = [{"role": "user", "content": "is the answer yes"}]
    text = lm.complete(messages, max_tokens=6)
    ids = lm.tokenizer(lm.prompt(messages), return_tensors="pt")["input_ids"]
    with torch.no_grad():  # an independent greedy loop without a KV cache
        for _ in range(6):
            ids = torch.cat([ids, lm.model(ids).logits[:, -1:].argmax(-1)], 1)
    n = lm.tokenizer(lm.prompt(messages), return_tensors="pt")["input_ids"].shape[1]
    assert text == lm.tokenizer.decode(ids[0, n:], skip_special_tokens=True)
    assert lm.prompt(messages).endswith("user: is the answer yes\nassistant:")


def test_http_backend_talks_to_a_real_local_server(tiny, monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    local = LocalLM(tiny)
    server, url = serve(local)
    try:
        assert url.startswith("http://127.0.0.1:")
        remote = OpenAIHTTP("tiny", base_url=url, api_key="none", timeout=30, max_retries=0)
        messages = [{"role": "user", "content": "one two three"}]
        assert remote.complete(messages, max_tokens=5) == local.complete(messages, max_tokens=5)
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        assert from_spec("openai:tiny").complete(messages, max_tokens=5) == local.complete(messages, max_tokens=5)
    finally:
        server.shutdown()
    dead = OpenAIHTTP("tiny", base_url=url, api_key="none", timeout=2, max_retries=0)
    with pytest.raises(BackendError, match="did not answer"):
        dead.complete([{"role": "user", "content": "hello"}])


def test_from_spec_names_what_it_accepts(tiny, tmp_path):
    rule = Offline(lambda m: "{}", "template")
    assert from_spec("template", {"template": rule}) is rule
    assert isinstance(from_spec(tiny), LocalLM)
    with pytest.raises(ParamError, match="not an offline agent \\('template'\\)"):  # bad input: no report
        from_spec(str(tmp_path / "missing-model"), {"template": rule})
