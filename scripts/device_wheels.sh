#!/usr/bin/env bash
# Wheels for a lent GPU machine that cannot reach a package index (run here, where pip can).
#
# Such a machine has Python 3.12 with torch, triton, transformers, peft, accelerate, scipy, pandas, scikit-learn and
# statsmodels, but not the notebook stack the runner needs (papermill, nbconvert, ipykernel, ipywidgets, plotly) nor
# sqlglot / openai. This downloads those and everything they depend on, as CPython 3.12 manylinux wheels, into
# .whl/ (git-ignored, ~40 MB): `scripts/device_check.sh` installs from it with `pip --no-index`, and pip takes from
# it only what the machine lacks, at the versions constraints.txt pins. Carry `.whl` in the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(papermill nbconvert nbformat nbclient ipykernel ipywidgets plotly sqlglot openai)
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -c constraints.txt -d .whl "${PKGS[@]}"
# the set must be closed: resolve it from .whl alone, as the machine will
python3 -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed --no-index --find-links .whl \
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any --target /tmp/device-wheels-check \
  "${PKGS[@]}"
echo "device_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry it: carry=['.whl'])"
