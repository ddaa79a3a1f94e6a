"""Kernels forked from the zygote (`lab.core.zygote`) against plain `ipykernel_launcher` kernels: the same outputs for
what a notebook sees (working directory, per-run variables, transformers' log lines, tqdm's notebook bar, plotly's
renderer, torch), interrupts reach them, they die with their launcher, and whatever cannot be served warm falls back
to a plain kernel."""

from __future__ import annotations

import os
import re
import time

import nbformat
import pytest
from nbclient import NotebookClient

from lab.core import zygote

pytestmark = pytest.mark.notebook

PROBE = [
    "import os, sys\nwarm = 'torch' in sys.modules  # before this notebook imported anything\n"
    "print(os.getcwd(), os.environ.get('LAB_RECORD_FILE'), 'JPY_PARENT_PID' in os.environ,\n"
    "      os.environ.get('CUBLAS_WORKSPACE_CONFIG'))",
    "from transformers.utils import logging as tl\n"
    "tl.get_logger('transformers.probe').warning('a transformers warning')",
    "from tqdm.auto import tqdm\nprint(tqdm.__mro__[1].__name__)",
    "import plotly.io as pio\nprint(pio.renderers.default)",
    "import torch\nprint(torch.ones(300, 300).matmul(torch.ones(300, 300))[0, 0].item())",
    "print(os.getpid(), warm)",
]


def execute(cells: list[str], cwd, **kw) -> list[list[str]]:
    """Each cell's stream outputs (text), run in a kernel started by the runner's kernel manager."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}, shutdown_kernel="immediate",
                   kernel_manager_class=zygote.kernel_manager(), **kw).execute()
    return [_streams(c.outputs) for c in nb.cells]


def _streams(outputs) -> list[str]:
    """A cell's stream texts, consecutive outputs of one stream merged: under load the kernel can flush one print in
    two messages (CI once saw 'plotly_mimetype' and '\\n' apart in the forked kernel, whole in the plain one)."""
    out: list[list[str]] = []
    for o in (o for o in outputs if o.output_type == "stream"):
        if out and out[-1][0] == o.name:
            out[-1][1] += o.get("text", "")
        else:
            out.append([o.name, o.get("text", "")])
    return [text for _, text in out]


def probe_line(outputs: list[str]) -> str:
    """The probe's "<pid> <warm>" line among a cell's stream outputs (under load another stream, e.g. a stderr
    warning, can come first: CI once saw it there)."""
    lines = [ln for text in outputs for ln in text.splitlines() if re.fullmatch(r"\d+ (True|False)", ln)]
    assert len(lines) == 1, outputs
    return lines[0]


@pytest.fixture(scope="module")
def warm():
    with zygote.warm() as path:
        yield path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_forked_kernel_behaves_like_a_plain_one(warm, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RECORD_FILE", str(tmp_path / "records.jsonl"))  # per run
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # set after the zygote started, as `setup` does
    got = execute(PROBE, tmp_path)
    pid, was_warm = probe_line(got[-1]).split()
    assert was_warm == "True"  # forked after torch was imported
    monkeypatch.setenv(zygote.ENV, "off")
    plain = execute(PROBE, tmp_path)
    assert probe_line(plain[-1]).split()[1] == "False"
    assert got[:-1] == plain[:-1]  # cwd, per-run variable, jupyter's variables, the log line, tqdm, plotly, torch
    assert got[0] == [f"{tmp_path} {tmp_path / 'records.jsonl'} True :16:8\n"]
    assert "a transformers warning" in got[1][0] and got[2] == ["tqdm_notebook\n"]
    deadline = time.monotonic() + 5  # the launcher was killed (immediate shutdown): its kernel follows
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(pid))


def test_an_interrupt_reaches_the_forked_kernel(warm, tmp_path):
    got = execute(["import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted')",
                   "import sys\nprint('torch' in sys.modules)"], tmp_path, timeout=4, interrupt_on_timeout=True,
                  allow_errors=True)
    assert got == [["interrupted\n"], ["True\n"]]


@pytest.mark.parametrize("case", ["environment", "no zygote"])
def test_what_cannot_be_served_warm_starts_plain(warm, tmp_path, monkeypatch, case):
    """A variable the zygote's imports may have read differs (their state would be stale), or the exported path
    is not a serving zygote (one that refused to serve leaves a plain file): a plain kernel, at once."""
    if case == "environment":
        monkeypatch.setenv("HF_HOME", str(tmp_path))
    else:
        (tmp_path / "sock").touch()
        monkeypatch.setenv(zygote.ENV, str(tmp_path / "sock"))
    t0 = time.monotonic()
    assert execute(["import sys\nprint('torch' in sys.modules)"], tmp_path) == [["False\n"]]
    assert time.monotonic() - t0 < 30


def test_env_differences_are_the_variables_imports_read():
    base = {"A": "1", "HF_HOME": "/x", "LAB_RECORD_FILE": "r1", "JPY_PARENT_PID": "1", "TORCH_HOME": "/t"}
    env = {"A": "2", "HF_HOME": "/y", "LAB_RECORD_FILE": "r2", "JPY_SESSION_NAME": "s", "CUBLAS_WORKSPACE_CONFIG": ":8",
           "LAB_QUIET": "1", "OMP_NUM_THREADS": "1"}
    assert zygote.env_differences(base, env) == ["HF_HOME", "LAB_QUIET", "OMP_NUM_THREADS", "TORCH_HOME"]


def test_the_zygote_imports_with_what_setup_sets_first(tmp_path, monkeypatch):
    """`lab run` outside the tests sets neither TRITON_INTERPRET nor HF_HUB_OFFLINE: `lab.core.setup` sets them in the
    kernel before triton and huggingface_hub load, so the zygote must have imported them with those values too."""
    for var in ("TRITON_INTERPRET", "HF_HUB_OFFLINE", zygote.ENV):
        monkeypatch.delenv(var, raising=False)
    with zygote.warm():
        got = execute(["import os, sys, huggingface_hub.constants as c\nprint('triton' in sys.modules, "
                       "os.environ.get('TRITON_INTERPRET'), c.HF_HUB_OFFLINE)"], tmp_path)
    assert got == [["True 1 True\n"]]  # forked after triton loaded, with the interpreter and the hub offline


def test_kernels_talk_over_unix_sockets_removed_after_the_run(warm, tmp_path):
    """ipc transport at an absolute path (the kernel runs in the notebook's folder, the client elsewhere): no TCP
    port, and no socket file left behind."""
    import glob
    import tempfile

    km = zygote.kernel_manager()()
    assert km.transport == "ipc" and os.path.isabs(km.ip)
    mine = os.path.join(tempfile.gettempdir(), f"lab-kernel-{os.getpid()}-*")  # this process's kernels only
    before = set(glob.glob(mine))
    assert execute(["print(1 + 1)"], tmp_path) == [["2\n"]]
    assert set(glob.glob(mine)) == before
