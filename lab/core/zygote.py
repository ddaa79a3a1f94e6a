"""Pre-warmed notebook kernels for headless runs: a zygote process imports torch, transformers and `lab.models` once,
and every kernel the runner starts is forked from it, ready, instead of paying those imports again (~5 s of CPU
each; a CI run starts ~110 kernels on two cores).

Three pieces, one module:

- `warm()` (the runner, `lab.cli`; it serves smoke-scale runs, on a CPU-only torch build): starts
  `python -m lab.core.zygote --serve SOCKET` and exports `LAB_KERNEL_ZYGOTE=SOCKET`, which `lab run` processes
  and their kernels inherit (a test session starts one per worker, `tests/conftest.py`); without it every kernel is
  a plain `ipykernel_launcher`.
- `kernel_manager()`: the runner's kernel manager; with a zygote exported, it starts kernels through
  `python -m lab.core.zygote -f CONNECTION_FILE` (the launcher) instead of `-m ipykernel_launcher`.
- the launcher asks the zygote to fork a kernel with its own stdio, working directory, environment and argv, then
  stands in for it: jupyter_client's interrupts and terminations reach the launcher and are forwarded; when the
  launcher dies (even by SIGKILL, nbclient's immediate shutdown) the kernel's lifeline pipe closes and it exits;
  the launcher exits when the kernel does. Anything that cannot be served warm falls back, silently, to the plain
  launcher: no zygote, a dead zygote, or an environment differing from the zygote's in a variable the preloaded
  libraries may read when imported (`IMPORT_TIME`: Hugging Face's, torch's, the thread pools', Python's, the lab's —
  their values are already read); other variables (a run's record file, jupyter's, `CUBLAS_WORKSPACE_CONFIG`,
  which `lab.core.setup` sets) are simply the kernel's, as the launcher's environment becomes the kernel's.

What the fork changes, and how the kernel is made the same as a plain one: loggers' stream handlers created during
the preload write to the kernel's stderr (as they would have, created inside it), `tqdm.auto` is chosen again inside
the kernel (it picks the notebook bar by looking for a running kernel at import), and nothing that decides its
output at import time by looking for IPython (plotly's renderer, matplotlib's backend) is preloaded. The zygote runs
no torch operation, so torch's thread pools do not exist yet when it forks, and it refuses to serve if a Python
thread other than its own runs; the worker threads numpy's and scipy's OpenBLAS start at import are shut down by
OpenBLAS's own fork handler, as when `multiprocessing` or a torch DataLoader forks after these imports.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

ENV = "LAB_KERNEL_ZYGOTE"
_SOCKETS = itertools.count()  # the runner's kernels' socket names
PRELOAD = ("torch", "transformers", "sklearn", "lab.core", "lab.models", "ipykernel.kernelapp", "ipykernel.ipkernel")
# (sklearn: several notebooks use it, and it sets Intel OpenMP's KMP_ variables at import, as joblib does: a runner
# that imported it would otherwise differ from the zygote in them)
NOT_PRELOADED = ("plotly", "matplotlib")  # they choose their output for IPython at import time
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SAFETENSORS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "CUDA_",
               "NCCL_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "TRITON_", "PYTHON", "LD_", "TQDM_", "XDG_",
               "HOME", "LANG", "LC_", "TZ", "JUPYTER_", "IPYTHON", "MPL", "PLOTLY", "LAB_")
PER_RUN = ("LAB_RECORD_FILE",)  # read by the kernel's cells, not at import
_MSG = 1 << 20


# --------------------------------------------------------------------------------------------- the runner's side

@contextlib.contextmanager
def warm():
    """A zygote for the duration of the block, exported in `LAB_KERNEL_ZYGOTE` (kept if one is exported already)."""
    if os.environ.get(ENV):  # one exported already, or "off"
        yield os.environ[ENV]
        return
    folder = tempfile.mkdtemp(prefix="lab-zygote-")
    path = str(Path(folder) / "sock")
    proc = subprocess.Popen([sys.executable, "-m", "lab.core.zygote", "--serve", path], stdin=subprocess.DEVNULL,
                            env={**os.environ, ENV: path})
    os.environ[ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(ENV, None)
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        shutil.rmtree(folder, ignore_errors=True)


@cache
def kernel_manager() -> type:
    """jupyter_client's kernel manager, starting `ipykernel_launcher` kernels through the zygote when one is
    exported (defined on first use: the launcher, which imports this module, does not need jupyter_client)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class KernelManager(AsyncKernelManager):
        # Unix sockets: a headless kernel needs no TCP port (and ipykernel ≥ 7 warns at every start that TCP is
        # unencrypted). Their path is absolute: the kernel runs in the notebook's folder, the client does not.
        @default("transport")
        def _transport_default(self) -> str:
            return "ipc"

        @default("ip")
        def _ip_default(self) -> str:
            if self.transport != "ipc":
                return "127.0.0.1"
            return os.path.join(tempfile.gettempdir(), f"lab-kernel-{os.getpid()}-{next(_SOCKETS)}")

        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if _served() and cmd[1:3] == ["-m", "ipykernel_launcher"]:
                cmd[1:3] = ["-m", "lab.core.zygote"]
            return cmd

    return KernelManager


def _served() -> str:
    """The exported zygote's socket, or "" (none, or `LAB_KERNEL_ZYGOTE=off`: plain kernels)."""
    path = os.environ.get(ENV, "")
    return "" if path == "off" else path


def _read_at_import(key: str) -> bool:
    return key not in PER_RUN and key.startswith(IMPORT_TIME)


def env_differences(base: dict, env: dict) -> list[str]:
    """The variables that preloaded libraries may have read at import in which `env` differs from `base`."""
    return sorted(k for k in set(base) | set(env) if base.get(k) != env.get(k) and _read_at_import(k))


# --------------------------------------------------------------------------------------------- the launcher

def _plain(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])


def launch(argv: list[str]) -> None:
    """Start a kernel forked from the exported zygote (argv: the kernel's, `-f CONNECTION_FILE`); stand in for it
    until it exits. Falls back to the plain launcher when the zygote cannot serve."""
    path = _served()
    deadline = time.monotonic() + 60
    while path and not os.path.exists(path) and os.path.isdir(os.path.dirname(path)) \
            and time.monotonic() < deadline:  # still preloading
        time.sleep(0.05)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
    except OSError:
        return _plain(argv)
    life_r, life_w = os.pipe()
    done_r, done_w = os.pipe()
    req = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    with conn:
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2, life_r, done_w])
        os.close(life_r)
        os.close(done_w)
        reply = json.loads(conn.recv(_MSG) or b"{}")
    if "pid" not in reply:
        return _plain(argv)
    pid = reply["pid"]

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, forward)
    code = os.read(done_r, 1)  # the kernel's exit status, or EOF if it died
    os._exit(code[0] if code else 1)


# --------------------------------------------------------------------------------------------- the zygote

def serve(path: str) -> None:
    """Preload, then fork a kernel for each request until the process that started it exits."""
    parent, base = os.getppid(), dict(os.environ)
    try:
        import torch

        if torch.version.cuda or torch.version.hip:
            raise RuntimeError("a GPU build of torch: CUDA must not be initialised before a fork")
        # What `lab.core.setup` sets before its own imports at smoke scale on a CPU machine (the runner sends only
        # smoke-scale runs here): triton and huggingface_hub read these when imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["HF_HUB_OFFLINE"] = "1"
        for name in PRELOAD:
            importlib.import_module(name)
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        preloaded = [m for m in NOT_PRELOADED if m in sys.modules]
        if threads or preloaded:
            raise RuntimeError(f"threads {threads} or modules {preloaded} after the preload")
    except BaseException as e:
        Path(path).touch()  # not a socket: launchers fall back at once
        print(f"lab.core.zygote: not serving ({e}); kernels start plain", file=sys.stderr)
        return
    preload_env = {k: v for k, v in os.environ.items() if base.get(k) != v}  # what the imports set, as they would
    base, refused = dict(os.environ), set()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the OS reaps the kernels
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # appears only once it can be served
    srv.listen(64)
    while os.getppid() == parent:
        if not select.select([srv], [], [], 1.0)[0]:
            continue
        conn, _ = srv.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, _MSG, 8)
            req = json.loads(msg)
            diff = env_differences(base, {**req["env"], **preload_env})
            _log(f"plain kernel: the environment differs in {', '.join(diff)}" if diff else "forked kernel")
            if len(fds) != 5 or diff:
                if tuple(diff) not in refused:  # said once per set of variables
                    refused.add(tuple(diff))
                    print(f"lab.core.zygote: a plain kernel: the environment differs in {', '.join(diff)}",
                          file=sys.stderr)
                for fd in fds:
                    os.close(fd)
                conn.send(b"{}")
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                _kernel({**req, "env": {**req["env"], **preload_env}}, fds)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())


def _log(line: str) -> None:
    """A line per kernel request in `LAB_KERNEL_ZYGOTE_LOG`, when set (to see how many kernels a run forked)."""
    if os.environ.get("LAB_KERNEL_ZYGOTE_LOG"):
        with open(os.environ["LAB_KERNEL_ZYGOTE_LOG"], "a") as f:
            f.write(f"{os.getpid()} {line}\n")


def _kernel(req: dict, fds: list[int]) -> None:
    """In the forked child: become the kernel the launcher asked for. Never returns."""
    code = 1
    try:
        stdin, stdout, stderr, life_r, done_w = fds
        os.setsid()
        for fd, std in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, std)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = req["cwd"]
        sys.argv = ["ipykernel_launcher", *req["argv"]]
        threading.Thread(target=lambda: (os.read(life_r, 1), os._exit(1)), name="lifeline", daemon=True).start()
        from ipykernel.kernelapp import IPKernelApp

        app = IPKernelApp.instance(parent_handle=int(os.environ.get("JPY_PARENT_PID") or 0))  # read at import
        app.initialize()
        _as_if_imported_here()
        app.start()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # report, then exit like a kernel that failed to start
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            os.write(fds[4], bytes([code & 255]))
        os._exit(code)


def _as_if_imported_here() -> None:
    """Undo what the preload decided outside a kernel: stream handlers bound to the process's stderr/stdout now write
    to the kernel's, and `tqdm.auto` is chosen again (it picks the notebook bar only inside a kernel)."""
    streams = {id(sys.__stderr__): sys.stderr, id(sys.__stdout__): sys.stdout}
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in streams:
                h.setStream(streams[id(h.stream)])
    for name in ("tqdm.auto", "tqdm.autonotebook"):
        sys.modules.pop(name, None)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        launch(sys.argv[1:])
