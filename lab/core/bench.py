"""`python -m lab bench NAME`: the benchmarks papers register.

A paper's bench module registers its entry point with `@register("name")`. The entry receives the validated
contract parameters (`Params`: device and seed, at smoke scale, already set up) and the rest of the command
line, which it parses itself (its own options), prints its report and returns an exit code. The runner
imports the bench modules that `lab.papers` lists and looks the name up here, so it names no paper itself.
"""

from __future__ import annotations

from collections.abc import Callable

from lab.core.params import ParamError, Params

Bench = Callable[[Params, list[str]], int]
_BENCHES: dict[str, Bench] = {}


class BenchError(ParamError):
    """A bench option has a value the bench cannot run with: one sentence, exit code 2."""


def register(name: str) -> Callable[[Bench], Bench]:
    """Decorator: `fn(params, argv) -> exit code` runs as `python -m lab bench <name> [options]` (a module
    reloaded re-registers its entry)."""

    def deco(fn: Bench) -> Bench:
        _BENCHES[name] = fn
        return fn

    return deco


def names() -> list[str]:
    """The registered bench names, sorted."""
    return sorted(_BENCHES)


def get(name: str) -> Bench:
    """The entry registered as `name` (a `BenchError` sentence listing the known ones otherwise)."""
    if name not in _BENCHES:
        raise BenchError(f"no bench named {name!r}; known: {', '.join(names()) or 'none'}.")
    return _BENCHES[name]
