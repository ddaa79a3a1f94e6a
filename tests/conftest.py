"""Shared test set-up: offline, one torch thread, a fresh model cache, and the notebook runs that
several tests read (each notebook is executed once per session through the real runner)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Before anything imports torch, transformers or kernels:
os.environ["HF_HUB_OFFLINE"] = "1"  # no network in any test
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU through the interpreter
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A fresh cache per session (inherited by runner subprocesses and kernels), so a test run measures
# training from scratch; shared by the pytest-xdist workers of one run (control runs reuse the models
# the notebook runs trained); set LAB_TEST_CACHE to reuse one while iterating.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_shared = os.path.join(tempfile.gettempdir(), f"lab-test-cache-{_run}") if _run else None
os.environ["LAB_CACHE"] = os.environ.get("LAB_TEST_CACHE") or _shared or tempfile.mkdtemp(prefix="lab-test-cache-")


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


def setup_cell(path: Path) -> str:
    import nbformat

    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"][1].source


_WARM = contextlib.ExitStack()  # this test process's zygote (`lab.core.zygote`), started at its first `run_lab`


def pytest_unconfigure(config):
    _WARM.close()


def run_lab(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m lab ...` in a subprocess, exactly as a user runs it (`env`: variables added to the environment).
    Its kernels are forked from this test process's zygote, as `lab run all` forks them from its own; a run whose
    `env` changes what the zygote's imports read gets plain kernels."""
    if not os.environ.get("LAB_KERNEL_ZYGOTE"):
        from lab.core import zygote

        _WARM.enter_context(zygote.warm())
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def save_tiny_lm(folder: Path, tok, *, seed: int | None = 0, **arch) -> Path:
    """A checkpoint folder as a researcher's would look: a tiny Llama (`lab.models.zoo.tiny_llama`, `arch` its
    sizes) and its tokenizer (`tok`, or a word-level one over `tok` when it is a list of words), both
    `save_pretrained` into `folder`; weights drawn after `torch.manual_seed(seed)` (None: the current random
    state). Returns `folder`."""
    import torch

    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_llama

    tok = word_tokenizer(tok) if isinstance(tok, list) else tok
    if seed is not None:
        torch.manual_seed(seed)
    tiny_llama(vocab_size=len(tok), **arch).save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


def save_tiny_moe(folder: Path, words: list[str], *, lines: int, seed: int = 0, dtype=None,
                  **arch) -> tuple[Path, Path]:
    """A researcher's MoE checkpoint and text: a tiny Mixtral (`lab.models.zoo.tiny_mixtral`, `arch` its sizes,
    weights drawn after `torch.manual_seed(seed)`, saved in `dtype`, default float32) with a word-level tokenizer
    over `words`, saved to folder/ckpt, and `lines` lines of 40 random words in folder/text.txt. Returns (ckpt,
    text)."""
    import numpy as np
    import torch

    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_mixtral

    tok = word_tokenizer(words)
    torch.manual_seed(seed)
    tiny_mixtral(vocab_size=len(tok), **arch).to(dtype or torch.float32).save_pretrained(Path(folder) / "ckpt")
    tok.save_pretrained(Path(folder) / "ckpt")
    g = np.random.default_rng(seed)
    (Path(folder) / "text.txt").write_text("\n".join(" ".join(g.choice(words, 40)) for _ in range(lines)))
    return Path(folder) / "ckpt", Path(folder) / "text.txt"


def fake_lm_eval(folder: Path) -> dict[str, str]:
    """A stand-in `lm_eval` package under `folder` (lm-eval's tasks need the network): its
    `evaluator.simple_evaluate` loads `pretrained=` with `AutoModelForCausalLM.from_pretrained`, as lm-eval's `hf`
    model does, and reports the parameter count as the task's metric. Returns the env that puts it on the path."""
    pkg = folder / "lm_eval"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "evaluator.py").write_text(
        "def simple_evaluate(model, model_args, tasks, **kw):\n"
        "    from transformers import AutoModelForCausalLM\n"
        "    args = dict(a.split('=') for a in model_args.split(','))\n"
        "    net = AutoModelForCausalLM.from_pretrained(args['pretrained'])\n"
        "    n = float(sum(p.numel() for p in net.parameters()))\n"
        "    return {'results': {t: {'alias': t, 'params': n} for t in tasks}}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


class NotebookRuns:
    """Each notebook executed once per session with default (smoke) parameters; results shared."""

    def __init__(self, out: Path):
        self.out, self.done = out, {}

    def __call__(self, stem: str) -> dict:
        if stem not in self.done:
            t0 = time.perf_counter()
            proc = run_lab("run", stem, "--out", str(self.out))
            wall = time.perf_counter() - t0
            rec_path = self.out / f"{stem}.json"
            rec = json.loads(rec_path.read_text()) if rec_path.exists() else None
            self.done[stem] = {"proc": proc, "wall": wall, "record": rec, "out": self.out}
        return self.done[stem]


@pytest.fixture(autouse=True)
def _seeded():
    """torch's global generator seeded before every test: a test that draws without its own generator draws the same
    numbers whatever ran before it in its worker (pytest-xdist shares tests out differently as the suite grows)."""
    import torch

    torch.manual_seed(0)


@pytest.fixture
def fresh_accelerate():
    """accelerate's process-wide state reset before and after a test that builds an `Accelerator` with other settings
    (mixed precision) than the rest of the session's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def notebook_runs(tmp_path_factory) -> NotebookRuns:
    return NotebookRuns(tmp_path_factory.mktemp("reports"))


@pytest.fixture(scope="session")
def tour_report(notebook_runs) -> Path:
    """The tour's offline HTML page (with `_static/` beside it), from the session's tour run."""
    run = notebook_runs("00_tour")
    assert run["proc"].returncode == 0, run["proc"].stdout + run["proc"].stderr
    return run["out"] / "00_tour.html"


def pytest_collection_modifyitems(config, items):
    """Longest first (the notebook runs, then the control runs, then unit tests), so the two pytest-xdist
    workers finish together; control runs after the notebook runs reuse the models those trained."""
    rank = {"test_notebooks.py": 0, "test_controls.py": 1}
    items.sort(key=lambda item: rank.get(item.path.name, 2))
