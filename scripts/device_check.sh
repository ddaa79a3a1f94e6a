#!/usr/bin/env bash
# The GPU checks as one prepared script, for a lent CUDA machine with no network (see README, "On a lent GPU").
#
# Runs from the repository root with the machine's own python3 (torch, triton, transformers there); installs what
# it lacks from .whl/ (`scripts/device_wheels.sh`, run beforehand where pip can reach an index). Steps, each under
# its own time limit so that one that hangs still leaves the others their turn (510 s at most in all; give the call
# ~560 s). Its run on an H200 on 2026-12-04 took 442 s under earlier limits: scripts/device_runs/2026-12-04_h200/.
#   1. the GPU-marked tests: the Triton kernels compiled for this GPU and checked against their torch references,
#      FloE's offload engine with the kernels against the torch path, CudaLink's causal timeline, and the kernel
#      benchmark at Mixtral's expert shape (autotuned, and at the engine's fixed tiles), printed into pytest.log
#   2. scripts/gpu_floe.py: every offload policy on a Mixtral-shaped bf16 model (tok/s, bytes/token, memory, the
#      host gather and pinned H2D bandwidths), FloE against Mixtral-offloading at FloE's device bytes first
#   3. notebook 05 with device=cuda (its claims, the engine on the toy through CudaLink, max_memory_allocated, the
#      kernels at the engine's tiles)
# (`python -m lab bench floe --device cuda`, a step until 2026-12-05, repeated 1 and 3: its policy table is the
# notebook's, its kernel benchmark the tests', and its autotuning ran again.)
# Writes to $OUT (or reports/device): summary.txt, a log per step, floe_engine.json, the notebook's record and
# executed copy, at most 8 files. Exit status: the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 LAB_STAGE_CACHE=0
# the lab is not pip-installed there: the notebook's kernel (run in notebooks/) finds it through PYTHONPATH
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
fails=0
step() {  # step NAME LIMIT_S CMD...: run CMD under `timeout`, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || fails=$((fails + 1))
  printf '%-10s rc=%-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
}
: >"$OUT/summary.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --disable-pip-version-check --no-index --find-links .whl --no-cache-dir \
    papermill nbconvert nbformat nbclient ipykernel ipywidgets plotly sqlglot openai >"$OUT/pip.log" 2>&1 \
    || { echo "device_check: installing from .whl failed (see pip.log)"; tail -n 20 "$OUT/pip.log"; exit 100; }
  rm -f "$OUT/pip.log"
fi
$PY - <<'PY' | tee -a "$OUT/summary.txt"
import torch, triton, transformers
p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"{'GPU ' + p.name + f' {p.total_memory / 2**30:.0f} GiB' if p else 'no GPU'}")
PY
# -s: the kernel benchmark the tests time (autotuned; the engine's fixed tiles as compact_fixed) prints into pytest.log
step pytest 110 $PY -m pytest -m gpu -q -s -rsx -p no:cacheprovider tests/kernels/test_floe.py tests/kernels/test_int2.py \
  tests/moe/test_links.py
step engine 200 $PY scripts/gpu_floe.py --budget 140 --out "$OUT/floe_engine.json"
rm -rf /tmp/device-nb
step nb05 200 $PY -m lab run 05_floe -p device cuda --out /tmp/device-nb --no-page
cp /tmp/device-nb/05_floe.json "$OUT/nb05_record.json" 2>/dev/null
cp /tmp/device-nb/05_floe.ipynb "$OUT/nb05_executed.ipynb" 2>/dev/null
echo "device_check: $fails step(s) failed; $SECONDS s" | tee -a "$OUT/summary.txt"
exit $fails
