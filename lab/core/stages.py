"""Stage results cached on disk, so a control run (or a re-run) recomputes only what actually changed.

`@stage` wraps a deterministic, expensive step of a paper's pipeline — a sweep of trained arms, a rollout study. Its
key hashes everything the step can depend on: every argument (tensors by their bytes, modules by their weights,
dataclasses by their fields, generators by their state, tokenizers by their vocabulary, an object with a
`__stage_key__()` method by what it returns), the global random states it may draw from (torch, numpy, python) and
the source of the whole `lab` and `kernels` packages, so an edit anywhere in the library, another seed or any
changed input is a miss. A hit returns the stored result and puts every random state (the global ones and every
generator among the arguments, however deep) where the computation left it, so the rest of the notebook runs exactly
as if the step had been computed: cached and computed runs are bit-identical (tests/core/test_stages.py). This is
what lets a control that only swaps the scores a step trains with skip the rollout study it does not touch.

Entries live in `<LAB_CACHE>/stages/<module.function>/<key>.pt` (`lab.models.train.cache_dir`); an unreadable
entry is deleted and recomputed. It is on at smoke scale (`lab.core.setup` calls `configure`) and off at full scale,
where hashing a large model's weights would cost more than it saves; `LAB_STAGE_CACHE=1` / `0` forces it on / off.
`hits()` lists this process's hits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FunctionType, MethodType, ModuleType
from typing import Any, TypeVar

import numpy as np
import torch

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)
_hits: list[str] = []
_digest: list[str] = []
_enabled = [True]


def configure(enabled: bool) -> None:
    """Turn the cache on or off for this process (the `LAB_STAGE_CACHE` variable, when set, wins)."""
    _enabled[0] = enabled


def enabled() -> bool:
    flag = os.environ.get("LAB_STAGE_CACHE", "")
    return flag != "0" if flag else _enabled[0]


def code_digest() -> str:
    """sha256 of every .py file of the `lab` package, its Triton kernels included (computed once per process)."""
    if not _digest:
        root = Path(__file__).resolve().parents[2]
        h = hashlib.sha256()
        for f in sorted((root / "lab").rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
        _digest.append(h.hexdigest())
    return _digest[0]


def _feed(h, x: Any, seen: dict[int, Any], gens: list[torch.Generator]) -> None:
    """Hash `x` into `h` by value, appending every generator met to `gens` (in a fixed order); an object with no
    value identity (a bare address in its repr) is an error."""
    tag = lambda s: h.update(f"<{s}>".encode())
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return tag(f"{type(x).__name__}:{x!r}")
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous().reshape(-1)
        tag(f"tensor {t.dtype} {tuple(x.shape)}")
        return h.update(t.view(torch.uint8).numpy().tobytes())
    if isinstance(x, np.ndarray):
        tag(f"ndarray {x.dtype} {x.shape}")
        return h.update(np.ascontiguousarray(x).tobytes())
    if isinstance(x, np.generic):
        return tag(f"{x.dtype}:{x!r}")
    if isinstance(x, torch.Generator):
        gens.append(x)
        return _feed(h, x.get_state(), seen, gens)
    if isinstance(x, (ModuleType, type)) or inspect.isbuiltin(x):
        return tag(f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', x.__name__)}")
    if isinstance(x, FunctionType):  # its code is in `code_digest`; what it closes over is hashed here
        tag(f"function {x.__module__}.{x.__qualname__}")
        cells = [c.cell_contents for c in x.__closure__ or ()]
        return _feed(h, (x.__defaults__, x.__kwdefaults__, cells), seen, gens)
    if isinstance(x, MethodType):
        return _feed(h, (x.__func__, x.__self__), seen, gens)
    if id(x) in seen:
        return tag("cycle")
    seen[id(x)] = x  # kept alive while hashing, so a temporary's id is never reused for another object
    if callable(getattr(type(x), "__stage_key__", None)):  # an object that says what identifies it
        tag(f"keyed {type(x).__qualname__}")
        return _feed(h, x.__stage_key__(), seen, gens)
    if isinstance(x, torch.nn.Module):
        tag(f"module {type(x).__qualname__} training={x.training}")
        return _feed(h, x.state_dict(), seen, gens)
    if isinstance(x, Mapping):
        tag(f"map {len(x)}")
        for k in sorted(x, key=repr):
            _feed(h, k, seen, gens)
            _feed(h, x[k], seen, gens)
        return None
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x
        tag(f"{type(x).__name__} {len(items)}")
        for v in items:
            _feed(h, v, seen, gens)
        return None
    if dataclasses.is_dataclass(x):
        tag(f"dataclass {type(x).__qualname__}")
        return _feed(h, {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}, seen, gens)
    if callable(getattr(x, "get_vocab", None)):  # a tokenizer: its class and vocabulary
        tag(f"tokenizer {type(x).__qualname__}")
        return _feed(h, x.get_vocab(), seen, gens)
    if isinstance(x, functools.partial):
        return _feed(h, (x.func, x.args, x.keywords), seen, gens)
    if hasattr(x, "__dict__") and not callable(x):
        tag(f"object {type(x).__qualname__}")
        return _feed(h, vars(x), seen, gens)
    text = repr(x)
    if " at 0x" in text:
        raise TypeError(f"the stage cache cannot key an argument of type {type(x).__qualname__} (no value identity).")
    return tag(f"{type(x).__qualname__}:{text}")


def key_of(*parts: Any, gens: list[torch.Generator] | None = None) -> str:
    """A hex key for `parts` hashed by value (see `_feed`); the generators met are appended to `gens`."""
    h = hashlib.sha256()
    _feed(h, parts, {}, [] if gens is None else gens)
    return h.hexdigest()[:32]


def _global_states() -> dict:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_global_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def hits() -> list[str]:
    """The stages this process loaded from the cache, in order."""
    return list(_hits)


def stage(fn: F) -> F:
    """Cache `fn`'s result on disk by the value of its arguments, the random states and the library's source
    (module docstring). `fn` must be deterministic given those; every generator among its arguments is restored."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not enabled():
            return fn(*args, **kwargs)
        from lab.models.train import cache_dir

        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        gens: list[torch.Generator] = []  # every generator among the arguments, however deep
        key = key_of(name, code_digest(), bound.arguments, _global_states(), gens=gens)
        path = cache_dir() / "stages" / name / f"{key}.pt"
        if path.exists():
            try:
                entry = torch.load(path, weights_only=False)
                _set_global_states(entry["global"])
                for g, s in zip(gens, entry["generators"], strict=True):
                    g.set_state(s)
                _hits.append(name)
                log.info("%s: loaded from the stage cache", name)
                return entry["result"]
            except Exception as err:  # a truncated or stale entry is rebuilt, never trusted
                log.warning("%s: unreadable stage cache entry %s (%s); recomputing", name, path, err)
                path.unlink(missing_ok=True)
        result = fn(*args, **kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"result": result, "global": _global_states(), "generators": [g.get_state() for g in gens]}, tmp)
        os.replace(tmp, path)
        return result

    return wrapper  # type: ignore[return-value]
