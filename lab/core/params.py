"""The five contract parameters every notebook takes, and their validation; and the checks of each paper's own
knobs (`check_type`, `check_limits`), which the runner applies before any kernel starts.

`validate` is called twice with the same code: by the runner before any kernel starts (so a bad
value costs nothing and writes nothing), and by `lab.core.setup` inside the notebook (so a user in
JupyterLab gets the same sentence). Each failure is one `ParamError` sentence naming the bad value
and the allowed ones.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from typing import Any

SCALES = ("smoke", "full")
DEVICES = ("auto", "cpu", "cuda")
TINY = "tiny"  # the notebook builds and trains its own tiny model
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ParamError(ValueError):
    """A notebook parameter has a value the notebook cannot run with."""


@dataclass(frozen=True)
class Params:
    """Validated parameters; `device` is resolved (`auto` -> `cuda` or `cpu`)."""

    scale: str = "smoke"
    device: str = "cpu"
    seed: int = 0
    model: str = TINY
    control: str = ""  # "" runs the paper's method; a name runs one of the notebook's declared controls

    @property
    def is_control(self) -> bool:
        return bool(self.control)

    @property
    def tiny(self) -> bool:
        return self.model == TINY

    def require_tiny(self, what: str) -> None:
        """Refuse a pretrained `model` in a notebook whose pretrained path is not built yet."""
        if not self.tiny:
            raise ParamError(f"model={self.model!r} is not supported here yet: {what}; use model='tiny'.")


def _looks_like_path(model: str) -> bool:
    # hub ids are `name` or `org/name`; anything else path-shaped is a local folder
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.path.exists(os.path.expanduser(model))


def check_model(model: Any) -> str:
    """`tiny`, an existing local folder, or a hub id `org/name` (resolved only when loaded)."""
    if not isinstance(model, str) or not model:
        raise ParamError(f"model={model!r} is not valid; use 'tiny', a local folder path, or a hub id like 'org/name'.")
    if model == TINY:
        return model
    if _looks_like_path(model):
        path = os.path.expanduser(model)
        if not os.path.isdir(path):
            raise ParamError(f"model path {model!r} does not exist (or is not a folder); use 'tiny', an existing "
                             "folder written by save_pretrained, or a hub id like 'org/name'.")
        return model
    if not _HUB_ID.match(model):
        raise ParamError(f"model={model!r} is neither 'tiny', an existing folder, nor a hub id like 'org/name'.")
    return model


def check_device(device: Any) -> str:
    if device not in DEVICES:
        raise ParamError(f"device={device!r} is not a known device; use one of {', '.join(map(repr, DEVICES))}.")
    return device


def resolve_device(device: Any) -> str:
    check_device(device)
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ParamError("device='cuda' was asked for, but this machine has no CUDA GPU "
                         "(torch.cuda.is_available() is False); use device='cpu' or 'auto'.")
    return ("cuda" if has_cuda else "cpu") if device == "auto" else device


def check_control(control: Any, controls: dict[str, Any] | None) -> str:
    """`""` or one of the notebook's declared controls (`{name: [claims it must break]}`)."""
    known = list(controls or {})
    if control == "":
        return control
    if not isinstance(control, str) or control not in known:
        listed = ", ".join(map(repr, known)) if known else "none (this notebook declares no control)"
        raise ParamError(f"control={control!r} is not a control of this notebook; its controls are {listed} "
                         "(or '' for the paper's method).")
    return control


def validate(scale: Any = "smoke", device: Any = "auto", seed: Any = 0, model: Any = TINY, control: Any = "",
             controls: dict[str, Any] | None = None, *, resolve: bool = True) -> Params:
    """Check the contract parameters; raise one `ParamError` sentence on the first bad value. `resolve=False` (the
    runner, before a kernel starts) leaves device "auto" unresolved and imports torch only to check "cuda"."""
    if scale not in SCALES:
        raise ParamError(f"scale={scale!r} is not a known scale; use one of {', '.join(map(repr, SCALES))}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ParamError(f"seed={seed!r} is not valid; use a non-negative integer.")
    model = check_model(model)
    control = check_control(control, controls)
    device = resolve_device(device) if resolve or device == "cuda" else check_device(device)
    return Params(scale=scale, device=device, seed=seed, model=model, control=control)


# ------------------------------------------------------------------------------------- the papers' own knobs
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_type(name: str, value: Any, default: Any) -> Any:
    """An override of a paper knob in its default's type: int for an int, int or float for a float (as a float),
    bool for a bool; a string knob takes what was typed, as text (`-p data 2024`), and `none` as empty (off). Else one
    `ParamError`."""
    kind = type(default)
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: not isinstance(value, bool)}.get(kind, True)
    if not ok:
        raise ParamError(f"{name}={value!r} is not {_TYPE_NAMES[kind]} (its default is {default!r}).")
    if kind is str:
        return "" if value is None else str(value)  # `-p draft none`: the knob off, as its empty default
    return float(value) if kind is float else value


_OPS = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
        ast.GtE: lambda a, b: a >= b, ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _value(node: ast.AST, params: dict[str, Any]) -> Any:
    """A limit evaluated on `params`: `or` / `and` of chained comparisons (<, <=, >, >=) of arithmetic (+, −, ×, /)
    on parameter names and numbers; anything else is a ValueError (a limit is data, not code)."""
    if isinstance(node, ast.BoolOp):
        parts = [_value(v, params) for v in node.values]
        return any(parts) if isinstance(node.op, ast.Or) else all(parts)
    if isinstance(node, ast.Compare) and all(type(op) in _OPS for op in node.ops):
        vals = [_value(v, params) for v in (node.left, *node.comparators)]
        return all(_OPS[type(op)](a, b) for op, a, b in zip(node.ops, vals, vals[1:]))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, params), _value(node.right, params))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, params)
    if isinstance(node, ast.Name):
        return params[node.id]
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    raise ValueError(f"{ast.unparse(node)!r}: a limit holds names, numbers, + - * /, <, <=, >, >=, and, or")


def limit_names(limit: str) -> list[str]:
    """The parameter names a limit ("1 <= held_out < n_pairs") reads, in order; ValueError if it is not a
    comparison in `_value`'s grammar (no ==: "rounds <= 0 or rounds >= 8")."""
    node = ast.parse(limit, mode="eval").body
    if not isinstance(node, (ast.Compare, ast.BoolOp)):
        raise ValueError(f"limit {limit!r} is not a comparison")
    names = list(dict.fromkeys(n.id for n in ast.walk(node) if isinstance(n, ast.Name)))
    _value(node, dict.fromkeys(names, 1))
    return names


def check_limits(limits: tuple[str, ...], params: dict[str, Any]) -> None:
    """Each limit ("0 < s < 1", "1 <= held_out < n_pairs", "s <= 0.4 or 2 * k * s < 1 + k") holds for `params`,
    else one `ParamError` naming the values and the limit (`lab.papers.LIMITS`; checked by the runner before
    any kernel starts)."""
    for limit in limits:
        names = limit_names(limit)
        if not set(names) <= set(params):  # a knob this copy of the notebook does not have: nothing to check
            continue
        if not _value(ast.parse(limit, mode="eval").body, params):
            shown = ", ".join(f"{n}={params[n]!r}" for n in names)
            raise ParamError(f"{shown}: out of range; this notebook needs {limit}.")
