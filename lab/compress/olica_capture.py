"""What Olica's two passes read from a Llama-family model (`lab.compress.olica.prune`; He & Lin, ICML 2025, arXiv
2506.08436), also used by the measurements of `lab.compress.olica_study`: the hidden states entering block 0 with the
keyword arguments every block gets, one block run on them, the (input, output) of named modules on the next forward,
and per-channel energies (the official `scaler_row`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class _Stop(Exception):
    pass


def block_inputs(model: nn.Module, ids: torch.Tensor):
    """(hidden states entering block 0, the keyword arguments every block gets: mask, RoPE, positions)."""
    got = {}

    def hook(mod, args, kwargs):
        got["x"] = args[0] if args else kwargs.pop("hidden_states")
        got["kw"] = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
        raise _Stop

    h = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        h.remove()
    return got["x"], got["kw"]


@contextmanager
def taps(mods: dict[str, nn.Module]):
    """Capture (input, output) of each named module on the next forward."""
    got, hs = {}, []
    for n, m in mods.items():
        hs.append(m.register_forward_hook(lambda mod, i, o, n=n: got.__setitem__(n, (i[0].detach(), o.detach()))))
    try:
        yield got
    finally:
        for h in hs:
            h.remove()


def run_block(block: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
    out = block(x, **kw)
    return out[0] if isinstance(out, tuple) else out


def energy(x: torch.Tensor) -> torch.Tensor:
    """Per-channel mean square over all tokens (the official `scaler_row`, up to a constant)."""
    return x.float().flatten(0, -2).pow(2).mean(0)


def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and sample variance over all tokens: FLAP's E[x] and Var[x] (its WIFV score, its bias)."""
    x = x.float().flatten(0, -2)
    return x.mean(0), x.var(0)
