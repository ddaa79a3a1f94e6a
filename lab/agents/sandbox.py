"""Model-written code in a subprocess: a timeout, no network, bounded memory and CPU, a clean environment.

`run_python(code, tables, timeout)` writes each table to a CSV in a fresh temporary folder, then runs
`python -I` (isolated: no user site, no PYTHON* variables) with an empty environment except a minimal PATH, the
folder as cwd and HOME, and a prelude that (1) replaces `socket.socket`, `socket.create_connection` and
`socket.getaddrinfo` with functions that raise, so the code cannot reach the network, (2) sets RLIMIT_AS / RLIMIT_CPU
with `resource`, (3) loads the tables into the dict `tables` (pandas DataFrames; pandas is imported only when there
are tables). Whatever happens — a syntax error, an exception, a timeout, a killed process — the result is a `Result`
with `ok=False` and one sentence in `error`, never an exception in the caller: POPPER records it as a failed test
(the official code runs the executor's code in a REPL with a `time_limit` in minutes).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

PRELUDE = textwrap.dedent("""
    import resource, socket
    def _no_network(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
    resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
    resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
    del resource, socket
""")


@dataclass(frozen=True)
class Result:
    ok: bool
    stdout: str
    error: str = ""
    seconds: float = 0.0


def run_python(code: str, tables: dict | None = None, *, timeout: float = 20.0, memory_mb: int = 2048) -> Result:
    """Run `code` (with `tables` as DataFrames) in an isolated subprocess; `Result.ok` is False on any failure."""
    import time

    tables = tables or {}
    with tempfile.TemporaryDirectory(prefix="lab-sandbox-") as tmp:
        for name, frame in tables.items():
            frame.to_csv(Path(tmp) / f"{name}.csv", index=False)
        prelude = PRELUDE.format(mem=memory_mb * 2**20, cpu=max(1, int(timeout) + 1))
        if tables:
            prelude += f"import pandas as pd\ntables = {{n: pd.read_csv(n + '.csv') for n in {list(tables)!r}}}\n"
        else:
            prelude += "tables = {}\n"
        script = Path(tmp) / "experiment.py"
        script.write_text(prelude + "\n# --- model-written code ---\n" + code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-I", str(script)], cwd=tmp, env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
            return Result(False, out, f"the experiment ran past its {timeout:g} s time limit",
                          time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return Result(False, proc.stdout, f"the experiment failed: {last[:300]}", seconds)
    return Result(True, proc.stdout, "", seconds)
