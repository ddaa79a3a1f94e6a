"""A model that answers prompts: one small interface for the agents (02 POPPER, 18 SGU-SQL).

An agent loop is written once against `Backend.complete(messages) -> str` (OpenAI chat messages) and runs unchanged on

- `Offline(fn)`: a python function, the seeded rule-based agents each paper needs in CI (no model at all);
- `LocalLM(folder or hub id)`: a `transformers` causal LM in this process (its chat template when it has one);
- `OpenAIHTTP()`: any OpenAI-compatible server through the `openai` client: OpenAI itself, or a local vLLM, SGLang
  or llama.cpp server (`OPENAI_BASE_URL=http://127.0.0.1:8000/v1`, `LAB_AGENT_MODEL=<served name>`).

`complete_json` is the structured-output path the papers use (parse the first JSON object, check its keys, retry
with the parse error). `serve` puts any backend behind a minimal OpenAI-compatible endpoint on 127.0.0.1 — the tests
use it to drive `OpenAIHTTP` against a real server with a tiny saved model, and it serves a local model to several
notebooks at once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

Messages = list[dict]


class BackendError(RuntimeError):
    """A backend could not produce a usable answer (the message is one sentence for the notebook)."""


class Backend(Protocol):
    name: str

    def complete(self, messages: Messages, *, max_tokens: int = 256, temperature: float = 0.0) -> str: ...


class Offline:
    """A python function `fn(messages) -> str` as a backend: the offline agents of the papers."""

    def __init__(self, fn: Callable[[Messages], str], name: str):
        self.fn, self.name = fn, name

    def complete(self, messages: Messages, *, max_tokens: int = 256, temperature: float = 0.0) -> str:
        return self.fn(messages)


class LocalLM:
    """A `transformers` causal LM answering in this process (greedy at temperature 0, else sampled)."""

    def __init__(self, model_or_path, tokenizer=None, *, device: str = "cpu"):
        if isinstance(model_or_path, str):
            from lab.models.pretrained import load_model

            self.name = model_or_path
            model_or_path, tokenizer = load_model(model_or_path, device=device)
        else:
            self.name = type(model_or_path).__name__
        if tokenizer is None:
            raise BackendError(f"the model {self.name!r} has no tokenizer, so it cannot answer text prompts.")
        self.model, self.tokenizer = model_or_path.eval(), tokenizer

    def prompt(self, messages: Messages) -> str:
        """The chat template when the tokenizer has one, else `role: content` lines and an open assistant turn."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"

    def complete(self, messages: Messages, *, max_tokens: int = 256, temperature: float = 0.0) -> str:
        import torch

        enc = self.tokenizer(self.prompt(messages), return_tensors="pt").to(self.model.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=max_tokens, pad_token_id=pad, **sampling)
        return self.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


class OpenAIHTTP:
    """An OpenAI-compatible chat endpoint through the `openai` client (timeouts and retries are the client's)."""

    def __init__(self, model: str | None = None, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 60.0, max_retries: int = 2):
        from openai import OpenAI

        self.name = model or os.environ.get("LAB_AGENT_MODEL", "")
        if not self.name:
            raise BackendError("the HTTP backend has no model name: use agent='openai:<model>' or LAB_AGENT_MODEL.")
        key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # local servers accept any key
        self.client = OpenAI(base_url=base_url or os.environ.get("OPENAI_BASE_URL"), api_key=key, timeout=timeout,
                             max_retries=max_retries)

    def complete(self, messages: Messages, *, max_tokens: int = 256, temperature: float = 0.0) -> str:
        import openai

        try:
            r = self.client.chat.completions.create(model=self.name, messages=messages, max_tokens=max_tokens,
                                                    temperature=temperature)
        except openai.OpenAIError as e:
            raise BackendError(f"the endpoint {self.client.base_url} did not answer for model {self.name!r}: "
                               f"{type(e).__name__}.") from e
        return r.choices[0].message.content or ""


def first_json(text: str) -> dict:
    """The first JSON object in `text` (models wrap JSON in prose or code fences); ValueError when there is none."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                obj, _ = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError("no JSON object in the reply")


def complete_json(backend: Backend, messages: Messages, keys: tuple[str, ...] | list[str], *, retries: int = 2,
                  max_tokens: int = 256) -> dict:
    """Ask, parse the first JSON object, check it has `keys`; on failure retry with the error appended."""
    messages = list(messages)
    for _ in range(retries + 1):
        reply = backend.complete(messages, max_tokens=max_tokens)
        try:
            obj = first_json(reply)
            missing = [k for k in keys if k not in obj]
            if missing:
                raise ValueError(f"the JSON object lacks {', '.join(map(repr, missing))}")
            return obj
        except ValueError as e:
            error = str(e)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"{error}. Answer with one JSON object with keys {list(keys)}."}]
    raise BackendError(f"{backend.name} gave no JSON object with keys {list(keys)} in {retries + 1} tries ({error}).")


def from_spec(spec: str, offline: dict[str, Backend] | None = None, *, device: str = "cpu") -> Backend:
    """A notebook's `agent` parameter as a backend: a key of `offline`, `openai[:<model>]`, or a folder / hub id; a
    spec none of them serves is one `ParamError` sentence (bad input: the runner writes no report)."""
    offline = offline or {}
    if spec in offline:
        return offline[spec]
    if spec == "openai" or spec.startswith("openai:"):
        return OpenAIHTTP(spec.partition(":")[2] or None)
    from lab.core.params import ParamError
    from lab.models.pretrained import ModelNotAvailable

    try:
        return LocalLM(spec, device=device)
    except ModelNotAvailable as e:
        names = ", ".join(map(repr, offline)) or "none"
        raise ParamError(f"agent {spec!r} is not an offline agent ({names}), not 'openai[:<model>]', and {e}") from e


def serve(backend: Backend, *, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Serve `backend` as a minimal OpenAI-compatible `POST /v1/chat/completions` in a daemon thread.

    Returns `(server, base_url)`; `server.shutdown()` stops it. Requests are answered one at a time (a lock), as a
    local model in this process can only answer one at a time.
    """
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self.send_error(404, "only /v1/chat/completions is served")
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with lock:
                text = backend.complete(req["messages"], max_tokens=int(req.get("max_tokens") or 256),
                                        temperature=float(req.get("temperature") or 0.0))
            body = json.dumps({"id": "lab-0", "object": "chat.completion", "created": int(time.time()),
                               "model": req.get("model", backend.name),
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": text}}],
                               "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/v1"
