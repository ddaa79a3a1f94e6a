"""The offload engine's Triton kernels (`lab.kernels.floe`, `lab.kernels.int2`) compiled ahead of time for NVIDIA
GPUs, on a machine without one.

Triton lowers a `@triton.jit` function through TTIR, TTGIR, LLVM IR and PTX to a cubin with `ptxas`, which ships in
the triton wheel; none of it needs a device (`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`,
as `triton/tools/compile.py` does). The interpreter that runs the kernels on CPU in the tests executes them with
numpy and never lowers them, so this is the check that the kernels compile, at the argument types the entry points
pass and the specialisation a real launch gets (16-byte-aligned pointers and integers divisible by 16 carry Triton's
`tt.divisibility` hint), for the fixed configs and, with `autotune=True`, every autotuner config. From `ptxas -v` it
records registers, spills and shared memory per kernel, and from the PTX the global atomics and loads (vector loads
among them: the load instructions in a thread's code, a static proxy for how wide it reads memory). It does not run
anything: timings and numerics need a GPU.

`python -m lab.kernels.floe_compile [--autotune] [--target sm_80,sm_90] [--out F.json]`; needs `TRITON_INTERPRET` unset
or 0 (the interpreter patches `triton.language`, and then nothing lowers).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

SHAPE = {"H": 4096, "F": 14336, "keep": 2867, "group": 64}  # Mixtral-8x7B's expert; FloE keeps 20 % of F
STORE = {"fp32": "fp16", "fp16": "fp16", "bf16": "bf16"}  # host/transfer dtype per model dtype (offload_store)


@dataclass(frozen=True)
class Launch:
    """One kernel at one argument signature: `args` maps each runtime argument to (Triton type, value at Mixtral's
    shape or None for pointers); `const` holds the constexprs (the config's block sizes among them)."""

    kernel: str
    dtype: str
    args: dict
    const: dict
    num_warps: int = 4
    tags: dict = field(default_factory=dict)


def launches(dtype: str, configs: dict[str, list[dict]]) -> list[Launch]:
    """What `sparse_expert`, `masked_*`, `int2_gemv` and `gather_rows` launch for a model in `dtype`: x in the model's
    dtype, transferred rows in the store dtype (strided views with row stride 2H), INT2 codes uint8, scale/zero fp16,
    the kept-neuron indices int64 (or the uint8 codes as a dummy pointer when every row is computed), fp32 outputs.
    Over all F rows of an expert ("all": Alg. 1 with a mask, and the INT2 GEMV that predicts neurons) and over the
    kept rows of FloE's transfer buffer ("kept": `sparse_expert`'s fused gate·up and unmasked down, and `int2_gemv`
    on rows); and `int2_expert`'s launches for whole INT2 experts ("g64": HQQ INT2, "g16": Mixtral-offloading's)."""
    H, Fn, n, gs = SHAPE["H"], SHAPE["F"], SHAPE["keep"], SHAPE["group"]
    x, w, f32, u8 = f"*{dtype}", f"*{STORE[dtype]}", "*fp32", "*u8"
    out = []
    for rows, n_rows, stride in (("all", Fn, H), ("kept", n, 2 * H)):
        tag = {"rows": rows}
        for c in configs["gate_up"] if rows == "all" else configs["compact"]:
            if rows == "all":
                ptrs = {"x_ptr": x, "wg_ptr": w, "a_ptr": f32, "m_ptr": u8, "h_ptr": f32}
                out.append(_launch("gate_up", dtype, ptrs, {"F": n_rows, "stride_wg": stride}, {"H": H}, c, tag))
                continue
            ptrs = {"x_ptr": x, "r_ptr": w, "q_ptr": u8, "s_ptr": "*fp16", "z_ptr": "*fp16", "idx_ptr": "*i64",
                    "h_ptr": f32}
            ints = {"N": n_rows, "stride_r": stride, "stride_q": H // 4, "stride_s": H // gs}
            out.append(_launch("compact", dtype, ptrs, ints, {"K": H, "GROUP": gs}, c, tag))
        for c in configs["down"]:
            ptrs = {"h_ptr": f32, "wd_ptr": w, "m_ptr": u8, "y_ptr": f32}
            out.append(_launch("down", dtype, ptrs, {"F": n_rows, "H": H, "stride_wd": stride},
                               {"HAS_MASK": rows == "all"}, c, tag))
        for c in configs["int2"]:
            ptrs = {"x_ptr": x, "q_ptr": u8, "s_ptr": "*fp16", "z_ptr": "*fp16", "y_ptr": f32,
                    "idx_ptr": "*i64" if rows == "kept" else u8}
            ints = {"N": n_rows, "stride_q": H // 4, "stride_s": H // gs}
            out.append(_launch("int2", dtype, ptrs, ints, {"K": H, "GROUP": gs, "HAS_IDX": rows == "kept"}, c, tag))
    ptrs = {"wg_ptr": w, "wd_ptr": w, "idx_ptr": "*i64", "out_ptr": w}
    out.append(_launch("gather", dtype, ptrs, {"H": H, "stride_wg": H, "stride_wd": H}, {}, {"BLOCK_H": 64}, {}))
    # whole INT2 experts (`lab.kernels.int2`): the gate/up GEMVs and the down kernel, HQQ INT2 (group 64, fp16
    # scale/zero) and Mixtral-offloading's (group 16, scale/zero decoded from their 8-bit codes to fp16)
    for meta, g in (("*fp16", gs), ("*fp16", 16)):
        tag = {"rows": f"g{g}"}
        for c in configs["int2"] if g != gs else []:  # HQQ INT2's gate/up GEMV is FloE's "all" launch
            ptrs = {"x_ptr": x, "q_ptr": u8, "s_ptr": meta, "z_ptr": meta, "y_ptr": f32, "idx_ptr": u8}
            ints = {"N": Fn, "stride_q": H // 4, "stride_s": H // g}
            out.append(_launch("int2", dtype, ptrs, ints, {"K": H, "GROUP": g, "HAS_IDX": False}, c, tag))
        for c in configs.get("int2_down", []):
            ptrs = {"h_ptr": f32, "q_ptr": u8, "s_ptr": meta, "z_ptr": meta, "y_ptr": f32}
            ints = {"N": Fn, "stride_q": H // 4, "stride_s": H // g}
            out.append(_launch("int2_down", dtype, ptrs, ints, {"K": H, "GROUP": g}, c, tag))
    return out


def _launch(kernel: str, dtype: str, ptrs: dict, ints: dict, const: dict, cfg: dict, tags: dict) -> Launch:
    args = {**{k: (t, None) for k, t in ptrs.items()}, **{k: ("i32", v) for k, v in ints.items()}}
    blocks = {k: v for k, v in cfg.items() if k != "num_warps"}
    return Launch(kernel, dtype, args, {**const, **blocks}, cfg.get("num_warps", 4), tags)


def configs(autotune: bool) -> dict[str, list[dict]]:
    """The fixed configs the entry points launch (on CPU tensors and on CUDA ones), or every config of their
    `@triton.autotune` wrappers."""
    from lab.kernels import floe as kf
    from lab.kernels import int2 as ki

    if not autotune:
        both = lambda a, b: [dict(a)] + ([dict(b)] if b != a else [])
        return {name: both(kf._FIXED[name], kf._CUDA[name]) for name in kf._FIXED} | {
            "int2_down": both(ki._FIXED, ki._CUDA)}
    return {name: [{**c.kwargs, "num_warps": c.num_warps} for c in kf._tuned(name).configs]
            for name in ("gate_up", "down", "int2", "compact")} | {
        "int2_down": [{**c.kwargs, "num_warps": c.num_warps} for c in ki._tuned().configs]}


def compile_one(launch: Launch, arch: int) -> dict:
    """Compile one launch for sm_<arch>: a record with ok, registers, spill bytes, shared bytes (or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lab.kernels import floe as kf
    from lab.kernels import int2 as ki

    fn = {"gate_up": kf._masked_gate_up_kernel, "down": kf._masked_down_kernel, "int2": kf._int2_gemv_kernel,
          "compact": kf._compact_gate_up_kernel, "gather": kf._gather_rows_kernel,
          "int2_down": ki._int2_down_kernel}[launch.kernel]
    sig = {name: ("constexpr" if name in launch.const else launch.args[name][0]) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in launch.args
             and (launch.args[name][0].startswith("*") or launch.args[name][1] % 16 == 0)}
    blocks = {k: v for k, v in launch.const.items() if k.startswith("BLOCK")}
    rec = {"kernel": launch.kernel, "dtype": launch.dtype, "arch": f"sm_{arch}", **launch.tags,
           "config": {**blocks, "num_warps": launch.num_warps}}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=launch.const, attrs=attrs),
                               target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps})
    except Exception as e:  # a compile error is the finding: recorded, not raised
        return {**rec, "ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"}
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {**rec, "ok": True, "registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills),
            "shared_bytes": k.metadata.shared, "ptx_lines": k.asm["ptx"].count("\n"),
            "atomics": len(re.findall(r"\b(?:red|atom)\.global", k.asm["ptx"])),
            "global_loads": len(re.findall(r"\bld\.global\.", k.asm["ptx"])),
            "vector_loads": len(re.findall(r"\bld\.global\.(?:\w+\.)*v[248]\.", k.asm["ptx"]))}


def compile_all(archs=(90,), dtypes=("fp32", "fp16", "bf16"), autotune: bool = False,
                cfgs: dict[str, list[dict]] | None = None) -> list[dict]:
    """Every launch of `launches` for each dtype (at `cfgs`, default `configs(autotune)`), compiled for each
    sm_<arch> with ptxas's report; raises if the interpreter is on."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("lab.kernels.floe_compile needs TRITON_INTERPRET unset or 0: under the interpreter Triton "
                           "does not lower kernels.")
    if unknown := set(dtypes) - set(STORE):
        raise ValueError(f"unknown dtype(s) {sorted(unknown)}; choose from {sorted(STORE)}.")
    import triton

    cfgs = configs(autotune) if cfgs is None else cfgs
    with tempfile.TemporaryDirectory() as cache:  # a cold cache: every launch is compiled, and ptxas reports it
        with triton.knobs.cache.scope(), triton.knobs.nvidia.scope():
            triton.knobs.cache.dir, triton.knobs.nvidia.dump_ptxas_log = cache, True
            done, out = {}, []
            for arch in archs:
                for dt in dtypes:
                    for lc in launches(dt, cfgs):  # an fp32 model's rows are fp16: some launches repeat
                        key = (arch, lc.kernel, repr(lc.args), repr(lc.const), lc.num_warps)
                        if key not in done:
                            done[key] = compile_one(lc, arch)
                        out.append({**done[key], "dtype": dt})
            return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="sm_90", help="comma-separated, e.g. sm_80,sm_90")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--autotune", action="store_true", help="every autotuner config, not only the fixed ones")
    ap.add_argument("--out", default=None, help="write the records to this JSON file")
    a = ap.parse_args(argv)
    try:
        archs = [int(t.removeprefix("sm_")) for t in a.target.split(",")]
        recs = compile_all(archs, a.dtypes.split(","), a.autotune)
    except (ValueError, RuntimeError) as e:
        print(f"floe_compile: {e}", file=sys.stderr)
        return 2
    for r in recs:
        status = (f"{r['registers']:>3} regs, {r['spill_bytes']:>5} B spilled, {r['shared_bytes']:>6} B shared"
                  if r["ok"] else r["error"])
        print(f"{r['arch']} {r['kernel']:>9} {r['dtype']:>4} {r.get('rows', ''):>4} {r['config']}: {status}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(recs, f, indent=1)
    bad = [r for r in recs if not r["ok"]]
    print(f"{len(recs) - len(bad)} of {len(recs)} launches compiled")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
