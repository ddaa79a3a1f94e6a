"""`setup()` — the one call in every notebook's setup cell — and the progress-bar wrapper."""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Iterable
from typing import Any

from lab.core import records
from lab.core.params import TINY, ParamError, Params, validate

log = logging.getLogger(__name__)
_quiet = os.environ.get("LAB_QUIET", "") not in ("", "0")


def seed_everything(seed: int, *, cuda: bool = False) -> None:
    """Seed python, numpy and torch (all devices); deterministic kernels where torch has them."""
    import numpy as np
    import torch

    if cuda:  # must be set before the first cuBLAS call, or deterministic mode raises there
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    if cuda or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:  # the same switch for eager kernels; torch's wrapper also sets inductor's flag, and importing inductor's
        # config costs ~2 s in every notebook kernel (nothing here uses torch.compile on CPU)
        torch._C._set_deterministic_algorithms(True, warn_only=True)


def setup(scale: str = "smoke", device: str = "auto", seed: int = 0, model: str = "tiny", control: str = "", *,
          controls: dict[str, list[str]] | None = None, quiet: bool | None = None,
          threads: int | None = None) -> Params:
    """Validate the parameters, seed everything, configure threads, logging, progress and plotly.

    `controls` declares the notebook's controls, `{name: [names of the claims it must break]}`: the
    substitutions a skeptic would make (the method replaced by its baseline, or a known-wrong variant).
    `control=name` runs one; `verdict()` then reports whether every claim it names did fail. The runner
    reads this literal from the setup cell to reject an unknown control before a kernel starts.

    At smoke scale torch uses one thread (tiny models run ~40x faster than with two contending
    threads on a 2-core machine) and the hub is switched off (`HF_HUB_OFFLINE=1`): smoke runs never
    touch the network. `quiet=True` hides progress bars (default: the `LAB_QUIET` environment variable).
    """
    global _quiet
    params = validate(scale, device, seed, model, control, controls)
    _interactive_knobs()
    records.start(params.control, tuple((controls or {}).get(params.control, ())))
    if params.device != "cuda":  # Triton kernels (lab/kernels/) then run on CPU through the interpreter; the flag is
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton first loads (set_seed, torch.compile, ...)
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    if quiet is not None:
        _quiet = quiet
    from lab.core import stages

    stages.configure(params.scale == "smoke")  # stage results cached by value at smoke scale (lab.core.stages)
    if params.scale == "smoke":
        os.environ["HF_HUB_OFFLINE"] = "1"
        torch.set_num_threads(threads or 1)
    elif threads:
        torch.set_num_threads(threads)
    seed_everything(params.seed, cuda=params.device == "cuda")
    _headless_autoreload_off()
    _library_notices(tiny=params.model == TINY)
    try:
        import plotly.io as pio

        # JupyterLab renders this mimetype itself; the report step converts it to offline HTML
        pio.renderers.default = "plotly_mimetype"
    except ImportError:
        pass
    log.info("params: scale=%s device=%s seed=%d model=%s control=%r",
             params.scale, params.device, params.seed, params.model, params.control)
    return params


def _interactive_knobs() -> None:
    """In JupyterLab (the kernel knows its notebook: `JPY_SESSION_NAME`), the paper's knobs as the parameters cell now
    sets them are checked as the runner checks `-p` overrides (`runner.check_knobs`). Under the runner they already
    were; a kernel without a notebook file (a console) has nothing to check."""
    from pathlib import Path

    from lab.papers import LIMITS

    name = os.environ.get("JPY_SESSION_NAME", "")
    if os.environ.get(records.RECORD_FILE_ENV) or Path(name).stem not in LIMITS or not Path(name).is_file():
        return  # the runner's run, a console, or a notebook that is not one of the lab's (a scratch copy)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        from lab.core.runner import UsageError, check_knobs

        try:
            check_knobs(Path(name), ip.user_ns)
        except ParamError:
            raise
        except (UsageError, ValueError, SyntaxError):  # a parameters cell being edited (unparsable): nothing to check
            pass


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _library_notices(tiny: bool) -> None:
    """Silence what the pinned libraries print about each other, which a reader can do nothing about: peft reads
    transformers' deprecated `is_gradient_checkpointing` (a FutureWarning in every LoRA arm), and transformers'
    assisted generation passes its assistant both a `generation_config` and generation arguments (a deprecation
    notice in every assisted `generate`). On the tiny path also transformers' progress bars, which saving and
    reloading a model of a few kB drew into every report; a checkpoint's run (setup again) turns them back on."""
    import warnings

    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    gen = logging.getLogger("transformers.generation.utils")
    if not any(isinstance(f, _DropMessages) for f in gen.filters):
        gen.addFilter(_DropMessages("Passing `generation_config` together with generation-related"))
    from transformers.utils import logging as hf_logging

    (hf_logging.disable_progress_bar if tiny else hf_logging.enable_progress_bar)()


def _headless_autoreload_off() -> None:
    """Under the runner (`python -m lab run`: it sets `records.RECORD_FILE_ENV`) nobody edits the library mid-run, so
    the setup cell's `%autoreload 2` is switched off again: it re-scans every loaded module (~4,000 with torch and
    transformers) before each cell, ~50 ms a cell, about two minutes of one CI run. Interactive sessions keep it."""
    if not os.environ.get(records.RECORD_FILE_ENV):
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None and {"autoreload", "IPython.extensions.autoreload"} & ip.extension_manager.loaded:
        ip.run_line_magic("autoreload", "0")


def progress(iterable: Iterable | None = None, *, quiet: bool | None = None, **kw: Any):
    """`tqdm.auto` with an explicit switch (tqdm ignores TQDM_DISABLE inside kernels)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=_quiet if quiet is None else quiet, **kw)
