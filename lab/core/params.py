"""The five contract parameters every notebook takes, and their validation.

`validate` is called twice with the same code: by the runner before any kernel starts (so a bad
value costs nothing and writes nothing), and by `lab.core.setup` inside the notebook (so a user in
JupyterLab gets the same sentence). Each failure is one `ParamError` sentence naming the bad value
and the allowed ones.
"""

from __future__ import annotations

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
