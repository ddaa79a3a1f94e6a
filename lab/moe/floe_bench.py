"""FloE on the toy Mixtral: the measurements notebook 05 shows, and `python -m lab bench floe`.

`toy` trains (or loads from the cache) `floe.Config`'s Mixtral on permutation chains; `toy_data` and
`decode_seqs` draw its calibration, held-out and decoded sequences. The measurements: activations per
(layer, expert), the sparsity sensitivity of Theorem 3.1 (Table 5), HQQ sensitivity per matrix (Table 7),
the FloE expert against its baselines at equal sparsity, the trained inter-expert predictor (Sec. 3.3),
the Triton kernels against the FloE expert, and Mixtral-8x7B's bytes per expert call. The offload engine's runs on
the toy (`Decoder`, the notebook's policies, the baseline sized to FloE's device memory) are `lab.moe.floe_decode`.

`floe_bench` runs the engine comparison in one go, with FP16 expert offload as the reference, and
`report` prints it as ratios; on CUDA the bench also times the Triton kernels against the dense torch
expert at Mixtral's shape (`lab.kernels.floe_bench.bench`) and pinned host-to-device copies (`links.h2d_bandwidth`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
from torch import Tensor, nn

from lab.core import bench
from lab.core.params import Params
from lab.core.stages import stage
from lab.data.chains import PermutationChains
from lab.models import TrainConfig, TrainResult, fit
from lab.models.zoo import tiny_mixtral
from lab.moe import blocks, links
from lab.moe import floe as fl
from lab.moe import floe_predictors as fpred
from lab.moe.floe_decode import Decoder
from lab.moe.links import MIXTRAL

POLICIES = {"FP16 on demand": ("fp16", {}), "INT2 on demand": ("int2", {}),
            "LRU FP16 k=2": ("lru-fp16", {"cache_k": 2}), "LRU INT2 k=2": ("lru-int2", {"cache_k": 2}),
            "Mixtral-offloading k=2": ("mixtral", {"cache_k": 2}), "DeepSpeed streaming": ("stream", {}),
            "FloE k=0.8": ("floe", {"keep": 0.2}),
            "FloE k=0.9": ("floe", {"keep": 0.1})}


# ------------------------------------------------------------------------------------------ the toy

def toy(cfg: fl.Config, seed: int = 0, device: str = "cpu",
        quiet: bool | None = None) -> tuple[PermutationChains, TrainResult, nn.Module]:
    """The task, the training run (or cache hit) and the model in eval mode — under the `untrained` control
    (`cfg.trained` False) a fresh initialisation of the same architecture, drawn after training."""
    task = PermutationChains()
    arch = cfg.arch(task.vocab_size)
    run = fit(functools.partial(tiny_mixtral, **arch), task,
              TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, seed=seed), device=device, quiet=quiet)
    return task, run, (run.model if cfg.trained else tiny_mixtral(**arch).to(device)).eval()


def toy_data(task: PermutationChains, n: int, seed: int = 0, device: str = "cpu") -> tuple[Tensor, dict[str, Tensor]]:
    """Calibration input_ids (n, T) and a held-out batch (input_ids, labels), from one generator (1000 + seed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    cal = task.batch(n, g)["input_ids"].to(device)
    return cal, {key: v.to(device) for key, v in task.batch(n, g).items()}


def decode_seqs(task: PermutationChains, n: int, seed: int = 0, device: str = "cpu") -> Tensor:
    """n held-out sequences (n, T) for the offload engine (generator 5000 + seed)."""
    return task.batch(n, torch.Generator().manual_seed(5000 + seed))["input_ids"].to(device)


# ------------------------------------------------------------------------------------ measurements

@torch.no_grad()
def expert_activations(model: nn.Module, xs: list[Tensor], layers: tuple[int, ...],
                       experts: tuple[int, ...]) -> dict[tuple[int, int], dict[str, Tensor]]:
    """`floe.activations` (Eqs. 3–4) of each (layer, expert) on the tokens of xs[layer] routed to that expert."""
    mlps, out = blocks.moe_blocks(model), {}
    for l in layers:
        _, _, idx = blocks.route(mlps[l], xs[l])
        for e in experts:
            rows = (idx == e).any(-1)  # tokens routed to expert e
            out[l, e] = fl.activations(xs[l][rows], *blocks.weights(mlps[l], e))
    return out


def sparsity_errors(model: nn.Module, xs_cal: list[Tensor], xs_ev: list[Tensor], ks: tuple[float, ...],
                    control: str = "", seed: int = 0) -> dict[str, list[float]]:
    """Theorem 3.1 / Table 5 measured: {on: [error at each k]} — S_t on a_on with per-expert thresholds from the
    calibration inputs (Eq. 6), relative MoE-output error on the held-out inputs averaged over layers 1.. (layer 0
    stays dense). Under `gate_for_up` the gate and up masks are exchanged; under `random_mask` they are random.
    A cached stage: the other controls leave it as the default run computed it."""
    return _sparsity_errors(model, xs_cal, xs_ev, tuple(ks), control if control in MASK_CONTROLS else "", seed)


MASK_CONTROLS = ("gate_for_up", "random_mask")  # the controls that change which entries a mask keeps


@stage
def _sparsity_errors(model: nn.Module, xs_cal: list[Tensor], xs_ev: list[Tensor], ks: tuple[float, ...],
                     control: str, seed: int) -> dict[str, list[float]]:
    out = {}
    for on in fl.MATRICES:
        src = fl.mask_source(on, control)
        tt = fl.thresholds(model, xs_cal, ks, src)
        out[on] = [blocks.layer_errors(model, xs_ev, fl.sparse_fn(model, tt[i], src, control, seed))[1:].mean().item()
                   for i in range(len(ks))]
    return out


@stage
def quant_sensitivity(model: nn.Module, batch: dict[str, Tensor], xs: list[Tensor], bits: tuple[int, ...],
                      base: float, group_size: int = 64) -> dict[tuple[str, int], dict[str, float]]:
    """Table 7: {(matrix, bits): {loss, err}} — one matrix of every expert HQQ-quantized, the eval-loss increase
    over `base` and the relative MoE-output error averaged over all layers."""
    out = {}
    for b in bits:
        for mat in fl.MATRICES:
            fn = fl.quant_fn(model, mat, b, group_size)
            out[mat, b] = {"loss": blocks.eval_loss(model, batch, fn) - base,
                           "err": blocks.layer_errors(model, xs, fn).mean().item()}
    return out


def expert_variants(model: nn.Module, xs_cal: list[Tensor], t_up: Tensor, k: float, experts: dict, control: str = "",
                    seed: int = 0, group_size: int = 64) -> dict[str, blocks.ExpertFn]:
    """The FloE expert (Eq. 11, `experts`: thresholds on its INT2 a_up) and its baselines at sparsity k, each
    calibrated on the activation it masks: up sparsified alone (full-precision W_up, so `t_up` is calibrated on the
    full-precision a_up), CATS (gate mask), a random mask of the up mask's size, and the whole expert in HQQ INT2
    (what Mixtral-offloading moves) and INT3 (the paper's other quantization baseline, Table 3)."""
    return {"FloE (INT2 up + sparse)": fl.floe_fn(experts),
            "up sparse only": fl.sparse_fn(model, t_up, fl.mask_source("up", control), control, seed),
            "CATS (gate sparse)": fl.sparse_fn(model, fl.thresholds(model, xs_cal, k, "gate"), "gate"),
            "random mask": fl.sparse_fn(model, t_up, "up", "random_mask", seed),
            "HQQ INT2 expert": fl.quant_fn(model, fl.MATRICES, 2, group_size),
            "HQQ INT3 expert": fl.quant_fn(model, fl.MATRICES, 3, group_size)}


def variant_quality(model: nn.Module, batch: dict[str, Tensor], xs: list[Tensor], variants: dict[str, blocks.ExpertFn],
                    base: float, layers: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """{variant: {loss_pct, err}}: eval-loss increase (%) over `base` with the experts of `layers` replaced, and
    the relative MoE-output error averaged over layers 1.. (in this order per variant: a random mask's generator
    is drawn from by both)."""
    out = {}
    for name, fn in variants.items():
        out[name] = {"loss_pct": 100 * (blocks.eval_loss(model, batch, fn, layers=layers) / base - 1),
                     "err": blocks.layer_errors(model, xs, fn)[1:].mean().item()}
        getattr(fn, "release", lambda: None)()  # a quantized baseline's layer of dequantized experts: one at a time
    return out


def trained_overlap(model: nn.Module, xs_cal: list[Tensor], xs_ev: list[Tensor], keep: float, int2: dict | None = None,
                    *, epochs: int = 20, lr: float = 5e-4, batch: int = 2048, seed: int = 0) -> list[float]:
    """The trained inter-expert predictor's top-k overlap for each layer i+1 on held-out inputs: trained on layer
    i's calibration inputs against layer i+1's router logits (router-initialised Linear, `train_inter_predictor`)."""
    mlps, out = blocks.moe_blocks(model), []
    for i in range(len(xs_cal) - 1):
        nxt = mlps[i + 1]
        logits = blocks.route(nxt, xs_cal[i + 1])[0].detach()
        net = fpred.train_inter_predictor(xs_cal[i], logits, nxt.gate.weight.detach(), epochs=epochs, lr=lr,
                                          batch=batch, seed=seed)
        with torch.no_grad():
            stats = fpred.predictor_stats(model, xs_ev, keep, int2, router=lambda l, x0, net=net: net(x0))
        out.append(stats[i]["inter"])
    return out


def kernel_errors(ex: fl.FloEExpert, x: Tensor) -> tuple[float, float]:
    """Max |Δ| of the Triton kernels (`lab.kernels.floe`) against the FloE expert on one token x (H,): the masked
    gate·up and down GEMVs against its masked-dense output, the INT2 W_up GEMV against its a_up."""
    from lab.kernels import floe as kf  # on CPU, lab.core.setup has set TRITON_INTERPRET=1

    a_up, mask = ex.mask(x[None])
    h = kf.masked_gate_up(x.contiguous(), ex.Wg.contiguous(), a_up[0].contiguous(), mask[0].contiguous())
    y = kf.masked_down(h, ex.Wd_t.contiguous(), mask[0].contiguous())
    kernel_err = (y - ex(x[None])[0]).abs().max().item()
    q = ex.Wq_up
    a_up_kernel = kf.int2_gemv(x.contiguous(), q.packed, q.scale, q.zero, q.group_size, q.shape[1])
    return kernel_err, (a_up_kernel - a_up[0]).abs().max().item()


def mixtral_bytes_per_call() -> dict[str, float]:
    """Host-to-device bytes per expert call at Mixtral-8x7B's shapes: ZeRO-3's whole MoE block (8 FP16 experts,
    shown per call as 4), an FP16 expert, an HQQ INT2 expert (2.5 bits per weight with group-64 FP16 scale/zero),
    Mixtral-offloading's expert block (group 16, 8-bit scale/zero, `offload_store.mo_layout`), and FloE's FP16
    gate/down rows at k = 0.8 and 0.9."""
    from lab.moe.offload_store import mo_layout

    H, FF = MIXTRAL["H"], MIXTRAL["F"]
    return {"ZeRO-3 MoE block (/2)": 8 * 3 * H * FF * 2 / 2, "FP16 expert": 3 * H * FF * 2,
            "HQQ INT2 expert (g64)": 3 * H * FF * 2.5 / 8, "Mixtral-offloading expert (g16)": mo_layout(FF, H)[-1][1],
            "FloE rows, k = 0.8": 2 * 0.2 * H * FF * 2, "FloE rows, k = 0.9": 2 * 0.1 * H * FF * 2}


# ------------------------------------------------------------------------ `python -m lab bench floe`

def floe_bench(seed: int = 0, device: str = "cpu", pcie_gbps: float = 25.0, n_seq: int = 2,
               steps: int | None = None) -> dict[str, dict]:
    """{policy: {bytes, tps, loss, layer_error, miss}} on the toy (smoke sizes, `steps` training steps), plus each
    ratio to FP16 on demand."""
    cfg = fl.Config.for_scale("smoke")
    cfg = cfg if steps is None else dataclasses.replace(cfg, steps=steps)
    task, _, model = toy(cfg, seed, device, quiet=True)
    cal, ev = toy_data(task, cfg.n_seq, seed, device)
    xs_cal, xs_ev = blocks.moe_inputs(model, cal), blocks.moe_inputs(model, ev["input_ids"])
    t_up = {keep: fl.floe_thresholds(model, xs_cal, 1 - keep) for keep in (0.2, 0.1)}  # on the INT2 W_up, as masked
    dec = Decoder(model, decode_seqs(task, n_seq, seed, device), device, pcie_gbps)
    out = {}
    for name, (policy, kw) in POLICIES.items():
        fn = fl.floe_fn(fl.floe_experts(model, t_up[kw["keep"]])) if policy == "floe" else form_fn(model, policy)
        err = blocks.layer_errors(model, xs_ev, fn)[1:].mean().item()
        del fn  # its decoded experts must not count in the decode's max_memory_allocated (CUDA)
        r = dec.decode(policy, kw)
        out[name] = {"bytes": r["bytes"], "tps": r["tps"], "loss": r["loss"], "layer_error": err, "miss": r["miss"],
                     "held": r["held"]}
        out[name] |= {key: r[key] for key in ("max_memory", "start_memory", "planned") if key in r}
    ref = out["FP16 on demand"]
    for r in out.values():
        r["bytes_vs_fp16"], r["speed_vs_fp16"] = ref["bytes"] / r["bytes"], r["tps"] / ref["tps"]
    return out


def form_fn(model: nn.Module, policy: str) -> blocks.ExpertFn:
    """Every expert computed from the form `policy` holds it in (`offload.form_of`), decoded to the model's dtype:
    what the engine computes, as an `ExpertFn` (for the layer errors)."""
    from lab.moe import offload_store as st
    from lab.moe.offload import form_of

    mlps, cache = blocks.moe_blocks(model), {}
    wd = st.weight_dtype(mlps[0].experts.down_proj.dtype)

    def fn(l: int, e: int, x: Tensor) -> Tensor:
        if (l, e) not in cache:
            W = tuple(w.detach() for w in blocks.weights(mlps[l], e))
            cache[l, e] = st.decode(form_of(policy, W, wd, 64), W[0].shape[0], W[0].shape[1], x.dtype)
        Wg, Wu, Wd_t = cache[l, e]
        return blocks.expert(x, Wg, Wu, Wd_t.T)

    return fn


def cuda_timings(autotune: bool = True) -> tuple[dict, dict]:
    """On a GPU: the Triton kernels against the dense torch expert at Mixtral's shape (ms, speedups; `autotune`
    False: at the fixed tiles the engine launches, without the autotuner's compiles and trials), and pinned
    host-to-device GB/s of compact row chunks against per-row copies, with the host's row-gather GB/s on one thread
    and on `CudaLink`'s gather threads (`links.gather_bandwidth`, what the simulator's `TimeModel.host` models)."""
    from lab.kernels.floe_bench import bench as kernel_bench

    n = links.default_gather_threads()
    return kernel_bench(autotune=autotune), links.h2d_bandwidth() | {"host_gather_one_thread": links.gather_bandwidth(),
                                                    f"host_gather_{n}_threads": links.gather_bandwidth(threads=n)}


def report(results: dict[str, dict], device: str) -> str:
    clock = "measured (CUDA events)" if device == "cuda" else "modelled (device-tier simulator, Mixtral-equivalent)"
    mem = device == "cuda"
    lines = [f"FloE offload benchmark on the toy Mixtral; tokens/s {clock}"
             + ("; device memory: torch.cuda.max_memory_allocated during the decode and memory_allocated as it "
                "starts (everything the process holds: the model, the engine, the caller's tensors) vs planned "
                "(model + engine)"
                if mem else ""),
             f"{'policy':>22} {'kB/token':>9} {'FP16/this':>9} {'tok/s':>8} {'vs FP16':>8} {'miss':>5} {'loss':>7} "
             f"{'layer err':>9}" + (f" {'max MB':>8} {'start MB':>8} {'planned':>8}" if mem else "")]
    for name, r in results.items():
        lines.append(f"{name:>22} {r['bytes'] / 1e3:9.1f} {r['bytes_vs_fp16']:8.1f}x {r['tps']:8.1f} "
                     f"{r['speed_vs_fp16']:7.1f}x {r['miss']:5.2f} {r['loss']:7.4f} {r['layer_error']:9.2e}"
                     + (f" {r.get('max_memory', 0) / 1e6:8.2f} {r.get('start_memory', 0) / 1e6:8.2f}"
                        f" {r.get('planned', 0) / 1e6:8.2f}" if mem else ""))
    return "\n".join(lines)


@bench.register("floe")
def main(P: Params, argv: list[str]) -> int:
    """`python -m lab bench floe [--device D] [--seed S] [--pcie GB/s]`: the offload policies on the FloE toy, as
    ratios (and the CUDA kernels and pinned copies on a GPU); --device and --seed are the runner's."""
    ap = argparse.ArgumentParser(prog="python -m lab bench floe", description=main.__doc__)
    ap.add_argument("--pcie", type=float, default=25.0, help="simulated host-to-device GB/s (CPU only)")
    args = ap.parse_args(argv)
    if args.pcie <= 0:
        raise bench.BenchError(f"--pcie must be a positive bandwidth in GB/s, got {args.pcie}.")
    print(report(floe_bench(P.seed, P.device, args.pcie), P.device))
    if P.device == "cuda":
        kernels, h2d = cuda_timings()
        print("kernels (ms, speedup vs the dense torch expert):", json.dumps(kernels, indent=1, default=str))
        print("pinned H2D GB/s by neurons per copy (compact (n, 2, H) chunk vs per-row copies):",
              json.dumps(h2d, indent=1))
    return 0
