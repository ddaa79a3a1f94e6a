# The lab's commands. `make run` and `make test` each set everything up first (idempotent, quick
# when already done): a .venv with torch installed first by its pin (so nothing pulls a CUDA build),
# the package with its dev extras at the versions constraints.txt pins (the set the tests last passed
# with; `make lock` refreshes it), and the report JavaScript from npm (when npm exists).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
LOCK := constraints.txt
STAMP := $(VENV)/.stamp-install

.PHONY: setup run test test-fast test-gpu audit lab lock clean

setup: $(STAMP) node_modules/.package-lock.json

$(STAMP): pyproject.toml environment.yml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -c $(LOCK) $(TORCH) -e ".[dev]"
	$(PIP) -c $(LOCK) $(TORCH) termcolor einops
	# HQQ's own quantizer, the reference tests/compress/test_quant.py checks ours against. Installed aside, not on the
	# path: transformers imports an importable hqq in every process (its quantized KV cache), ~1.5 s of CPU each.
	# DISABLE_CUDA: the sdist then skips its CUDA build.
	DISABLE_CUDA=1 $(PIP) --no-deps --upgrade --target $(VENV)/hqq-reference hqq==0.2.8.post1
	-@$(VENV)/bin/nbstripout --install 2>/dev/null  # git filter: notebooks are committed without outputs
	@touch $@

node_modules/.package-lock.json: package.json package-lock.json
	@if command -v npm >/dev/null; then npm ci --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: reports will render without widgets and MathJax (install Node.js + npm, then make setup)"; fi

## run every notebook at smoke scale -> reports/*.html, reports/index.html (ARGS="-p seed 1" to override)
run: setup
	$(PY) -m lab run all $(ARGS)

## unit tests, every notebook through the runner, offline browser and JupyterLab checks
test: setup
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

## the quick loop: unit tests only
test-fast: setup
	$(PY) -m pytest -m "not notebook and not browser" $(PYTEST_ARGS)

## on a CUDA machine: GPU-marked tests (kernels without the interpreter) and notebooks with device=cuda
test-gpu: setup
	-$(PIP) $(TORCH) -e ".[gpu]"  # optional CUDA kernels (fast-hadamard-transform); their tests skip if this fails
	TRITON_INTERPRET=0 $(PY) -m pytest -m gpu $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	TRITON_INTERPRET=0 $(PY) scripts/gpu_floe.py  # every offload policy on a Mixtral-shaped BF16 model (< 8 min)
	$(PY) -m lab run all -p device cuda --out reports/gpu

## held-out check (not in CI; ~35 min on 2 cores): every claim on seeds 10-14, every control on seeds 1-2,
## into reports/audit/results/<stem>.json and reports/audit/audit.md (the committed results files untouched)
audit: setup
	$(PY) -m lab audit all

## JupyterLab on the notebooks folder (with --allow-root when run as root, e.g. in a container)
lab: setup
	$(VENV)/bin/jupyter lab notebooks $$([ "$$(id -u)" -eq 0 ] && echo --allow-root)

## refresh constraints.txt: the newest versions pyproject.toml allows, installed into a scratch venv and frozen
## (then `make test`, and commit constraints.txt only if it passes)
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH)
	.venv-lock/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH) -e ".[dev]" termcolor einops
	{ echo "# Every Python distribution the lab's setup installs, at the versions its tests last passed with (make lock;"; \
	  echo "# $$(.venv-lock/bin/python -V), $$(date -u +%Y-%m-%d)). pyproject.toml keeps the ranges; this pins the set."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | sed 's/+[a-z0-9.]*$$//'; } > $(LOCK)
	rm -rf .venv-lock

clean:
	rm -rf reports .pytest_cache
