"""Triton kernels, each beside its torch reference.

Every kernel has a fixed-config entry point that runs under the Triton interpreter on CPU
(`TRITON_INTERPRET=1`, set by `tests/conftest.py` before this package is imported) and an autotuned
variant used only on CUDA. The first kernels are the FloE paper's sparse expert GEMVs (`lab.kernels.floe`).
"""
