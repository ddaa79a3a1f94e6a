"""`python -m lab bench floe`: the offload comparison in one run, printed as ratios.

Trains (or loads from the cache) the FloE notebook's toy Mixtral, then decodes held-out sequences under
each offload policy and prints bytes/token, tokens/s (modelled on CPU by the device-tier simulator,
measured with CUDA events on a GPU) and quality (decode loss; relative MoE-layer output error of the
expert variant on teacher-forced inputs), with FP16 expert offload as the reference. On CUDA it also
times the Triton kernels against the dense torch expert at Mixtral's shape (`kernels.floe.bench`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lab.data.chains import PermutationChains
from lab.models import TrainConfig, fit
from lab.models.zoo import tiny_mixtral
from lab.moe import floe as fl
from lab.moe.offload import CudaLink, OffloadEngine, SimLink, TimeModel

POLICIES = {"FP16 on demand": ("fp16", {}), "INT2 on demand": ("int2", {}),
            "LRU FP16 k=2": ("lru-fp16", {"cache_k": 2}), "LRU INT2 k=2": ("lru-int2", {"cache_k": 2}),
            "FloE k=0.8": ("floe", {"keep": 0.2}),
            "FloE k=0.9": ("floe", {"keep": 0.1})}


def toy(seed: int = 0, device: str = "cpu", steps: int = 200):
    """The notebook's trained toy Mixtral and its task."""
    task = PermutationChains()
    run = fit(lambda: tiny_mixtral(vocab_size=task.vocab_size, d_model=64, n_layers=4, n_heads=4, d_ff=192,
                                   n_experts=8, top_k=2), task,
              TrainConfig(steps=steps, batch_size=32, lr=3e-3, seed=seed), device=device, quiet=True)
    return run.model.eval(), task


def floe_bench(seed: int = 0, device: str = "cpu", pcie_gbps: float = 25.0, n_seq: int = 2,
               steps: int = 200) -> dict[str, dict]:
    """{policy: {bytes, tps, loss, layer_error, miss}} on the toy, plus each ratio to FP16 on demand."""
    model, task = toy(seed, device, steps)
    g = torch.Generator().manual_seed(1000 + seed)
    cal, ev = task.batch(64, g)["input_ids"].to(device), task.batch(64, g)["input_ids"].to(device)
    xs_cal, xs_ev = fl.capture(model, cal), fl.capture(model, ev)
    t_up = {keep: fl.thresholds(model, xs_cal, 1 - keep, "up") for keep in (0.2, 0.1)}
    variant = {"fp16": lambda l, e, x: fl.expert_out(x, *fl.weights(fl.moe_blocks(model)[l], e)),
               "int2": fl.quant_fn(model, fl.MATRICES, 2, 64)}
    seqs = task.batch(n_seq, torch.Generator().manual_seed(5000 + seed))["input_ids"].to(device)
    out = {}
    for name, (policy, kw) in POLICIES.items():
        nll, nbytes, secs, miss, calls = [], [], [], 0, 0
        for s in seqs:
            tm = TimeModel.mixtral_equivalent(64, 192, pcie=pcie_gbps * 1e9)
            link = CudaLink() if device == "cuda" else SimLink(tm)
            logits, st = OffloadEngine(model, policy, link, device=device, **kw).run(s[None])
            nll.append(F.cross_entropy(logits[:-1].float(), s[1:]).item())
            nbytes += st.bytes
            secs += st.seconds[1:]
            miss, calls = miss + st.misses, calls + st.calls
        if policy == "floe":
            ex = fl.floe_experts(model, t_up[kw["keep"]])
            fn = lambda l, e, x, ex=ex: ex[l, e](x)
        else:
            fn = variant["fp16" if "fp16" in policy else "int2"]
        out[name] = {"bytes": sum(nbytes) / len(nbytes), "tps": len(secs) / sum(secs), "loss": sum(nll) / len(nll),
                     "layer_error": fl.layer_errors(model, xs_ev, fn)[1:].mean().item(), "miss": miss / max(1, calls)}
    ref = out["FP16 on demand"]
    for r in out.values():
        r["bytes_vs_fp16"], r["speed_vs_fp16"] = ref["bytes"] / r["bytes"], r["tps"] / ref["tps"]
    return out


def h2d_bandwidth(H: int = 4096, n_rows: tuple[int, ...] = (1, 10, 50, 200, 1000), device: str = "cuda",
                  reps: int = 10) -> dict[str, dict[int, float]]:
    """Host-to-device GB/s for n neurons' weights (gate row + down column, FP16) from pinned memory:
    `compact` copies one contiguous (n, 2, H) chunk (FloE's co-located layout, Sec. 3.4.2), `per_row` copies
    the 2n rows one by one (the naive layout FloE reports 12.6x over). On CPU it times host copies instead
    (exercises the code; the numbers mean nothing for PCIe)."""
    cuda = device == "cuda"
    n_max = max(n_rows)
    src = torch.randn(n_max, 2, H).half()
    src = src.pin_memory() if cuda else src
    dst = torch.empty(n_max, 2, H, dtype=torch.float16, device=device)

    def timed(fn) -> float:
        fn()  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    out = {"compact": {}, "per_row": {}}
    for n in n_rows:
        nbytes = n * 2 * H * 2
        t = timed(lambda n=n: dst[:n].copy_(src[:n], non_blocking=cuda))
        out["compact"][n] = nbytes / t / 1e9

        def rows(n=n):
            for j in range(n):
                for half in range(2):
                    dst[j, half].copy_(src[j, half], non_blocking=cuda)

        out["per_row"][n] = nbytes / timed(rows) / 1e9
    return out


def report(results: dict[str, dict], device: str) -> str:
    clock = "measured (CUDA events)" if device == "cuda" else "modelled (device-tier simulator, Mixtral-equivalent)"
    lines = [f"FloE offload benchmark on the toy Mixtral; tokens/s {clock}",
             f"{'policy':>16} {'kB/token':>9} {'FP16/this':>9} {'tok/s':>8} {'vs FP16':>8} {'miss':>5} {'loss':>7} "
             f"{'layer err':>9}"]
    for name, r in results.items():
        lines.append(f"{name:>16} {r['bytes'] / 1e3:9.1f} {r['bytes_vs_fp16']:8.1f}x {r['tps']:8.1f} "
                     f"{r['speed_vs_fp16']:7.1f}x {r['miss']:5.2f} {r['loss']:7.4f} {r['layer_error']:9.2e}")
    return "\n".join(lines)
