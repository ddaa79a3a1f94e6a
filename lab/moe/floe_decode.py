"""FloE's offload engine (`lab.moe.offload`, FloE Sec. 3.4) decoding the toy Mixtral: the notebook's policies, the
baseline sized to FloE's device memory, and `Decoder`, which decodes held-out sequences under each policy and reports
bytes/token, tokens/s (modelled on CPU by the device-tier simulator, measured with CUDA events on a GPU), misses,
loss, one token's timeline, the engine's device bytes and, on CUDA, `torch.cuda.max_memory_allocated` beside the
planned bytes. Simulated decodes are cached stages (deterministic); CUDA decodes always run (their times are
measurements). The sweeps over PCIe bandwidth, host row-gather bandwidth and device budget are modelled on any
device (`Decoder.modelled`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lab.core.stages import stage
from lab.moe import blocks
from lab.moe.links import CudaLink, SimLink, TimeModel
from lab.moe.offload import OffloadEngine
from lab.moe.offload_policies import plan


def engine_policies(keep: float, whole_experts: bool = False) -> dict[str, tuple[str, dict]]:
    """The notebook's engine comparison: FP16 and INT2 experts on demand, LRU caches of 2 whole experts per
    layer (FP16, INT2), Mixtral-offloading (2 experts per layer and its 4 buffers: on the toy about FloE's device
    memory), DeepSpeed-style whole-layer streaming, FloE at `keep` and at keep 0.1 — both moving every row (keep
    1) under FloE's `whole_experts` control, with their names unchanged."""
    floe = lambda kp: ("floe", {"keep": 1.0 if whole_experts else kp})
    return {"FP16 on demand": ("fp16", {}), "INT2 on demand": ("int2", {}),
            "LRU FP16, k=2": ("lru-fp16", {"cache_k": 2}), "LRU INT2, k=2": ("lru-int2", {"cache_k": 2}),
            "Mixtral-offloading, k=2": ("mixtral", {"cache_k": 2}), "DeepSpeed streaming": ("stream", {}),
            f"FloE keep {keep:.2g}": floe(keep), "FloE keep 0.1": floe(0.1)}


def equal_memory_k(resident: float, int2_bytes: float, n_layers: int, top_k: int = 2) -> int:
    """LRU experts per layer holding about `resident` device bytes: `int2_bytes` is one token's on-demand INT2
    bytes over `n_layers` offloaded layers (top_k whole experts each)."""
    return max(1, round(resident / (n_layers * int2_bytes / (top_k * n_layers))))


def mixtral_at_equal_memory(model: nn.Module, keep: float, n_buffers: int = 4) -> tuple[int, dict | None]:
    """FloE's device bytes at `keep` (its INT2 W_up and two row buffers, as its engine holds them) and the
    Mixtral-offloading arguments (`offload_policies.plan`: experts per layer plus its buffers) that fit in as many bytes
    (None if not even one expert per layer fits)."""
    floe_bytes = OffloadEngine(model, "floe", SimLink(TimeModel()), keep=keep).stats.resident_bytes
    return floe_bytes, plan(model, floe_bytes, keep, n_buffers=n_buffers)["mixtral"]


@dataclass(frozen=True, eq=False)
class Decoder:
    """Decodes held-out sequences with `OffloadEngine` (one engine and link per sequence): over CUDA on a GPU,
    else over the simulator with Mixtral-equivalent bandwidths at `pcie_gbps`."""

    model: nn.Module
    seqs: Tensor  # (n, T)
    device: str = "cpu"
    pcie_gbps: float = 25.0
    predictor: str = "router"  # "random" under FloE's `random_predictor` control
    seed: int = 0

    def link(self, gbps: float, host: float | None = None) -> SimLink:
        """CudaLink on a GPU; else the simulator at `gbps` PCIe and `host` GB/s of host row gather (None: the
        TimeModel's default), Mixtral-equivalent."""
        if self.device == "cuda":
            return CudaLink()
        _, H, F_ = blocks.moe_blocks(self.model)[0].experts.down_proj.shape
        return SimLink(TimeModel.mixtral_equivalent(H, F_, pcie=gbps * 1e9, **({"host": host * 1e9} if host else {})))

    def decode(self, policy: str, kw: dict, gbps: float | None = None, n: int | None = None,
               host: float | None = None) -> dict:
        """Loss, bytes/token, tokens/s, miss rate, device-resident expert bytes and the last token's spans of one
        policy over the first n sequences (all by default). Over the simulator (deterministic) a cached stage; on
        CUDA always run, as its times are measurements."""
        gbps = self.pcie_gbps if gbps is None else gbps
        if self.device == "cuda":
            return self.run(policy, kw, gbps, n)
        return _simulated(self, policy, kw, gbps, n, host)

    def run(self, policy: str, kw: dict, gbps: float, n: int | None = None, host: float | None = None) -> dict:
        out = {"nll": [], "bytes": [], "back": [], "sec": [], "miss": 0, "calls": 0}
        cuda = self.device == "cuda"
        for s in self.seqs[:n]:
            eng = OffloadEngine(self.model, policy, self.link(gbps, host),
                                device=self.device, predictor=self.predictor, seed=self.seed, **kw)
            logits, st = eng.run(s[None])
            out["nll"].append(F.cross_entropy(logits[:-1].float(), s[1:]).item())
            out["bytes"] += st.bytes
            out["back"] += st.bytes_back
            out["sec"] += st.seconds[1:]  # the first token includes warm-up on CUDA
            out["miss"] += st.misses
            out["calls"] += st.calls
            out["spans"] = eng.link.spans_since(eng.last_token)
            out["resident"], out["held"] = st.resident_bytes, st.held_bytes
            out["max_memory"], out["planned"] = st.max_memory, st.model_bytes + st.resident_bytes + st.held_bytes
            out["start_memory"] = st.start_memory
        res = {"loss": sum(out["nll"]) / len(out["nll"]), "bytes": sum(out["bytes"]) / len(out["bytes"]),
               "bytes_back": sum(out["back"]) / len(out["back"]),
               "tps": len(out["sec"]) / sum(out["sec"]), "miss": out["miss"] / max(1, out["calls"]),
               "spans": out["spans"], "resident": out["resident"], "held": out["held"]}
        return res | ({"max_memory": out["max_memory"], "start_memory": out["start_memory"], "planned": out["planned"]}
                      if cuda else {})

    def decode_all(self, policies: dict[str, tuple[str, dict]], gbps: float | None = None,
                   n: int | None = None) -> dict[str, dict]:
        return {name: self.decode(p, kw, gbps, n) for name, (p, kw) in policies.items()}

    @torch.no_grad()
    def dense_loss(self) -> float:
        """Mean next-token loss of the model itself over the sequences (teacher-forced, no offload)."""
        return sum(F.cross_entropy(self.model(input_ids=s[None]).logits[0, :-1], s[1:]).item()
                   for s in self.seqs) / len(self.seqs)

    def simulate(self, gbps: float, keep: float, budget_kb: float) -> dict[str, dict]:
        """Each policy under one device budget for experts (beyond layer 0, `offload_policies.plan`), one sequence,
        over the simulator (also on CUDA); a policy that does not fit is left out (the offload explorer's callback)."""
        fit_ = plan(self.model, int(budget_kb * 1e3), keep)
        runs = {"FP16 on demand": ("fp16", {})}
        runs.update({name: (pol, fit_[pol]) for name, pol in BUDGETED if fit_[pol] is not None})
        return self.modelled.decode_all(runs, gbps, n=1)

    @functools.cached_property
    def modelled(self) -> Decoder:
        """This decoder over the simulator: itself on CPU; on CUDA a CPU copy of the model and sequences, since a
        GPU's PCIe bandwidth and memory cannot be set: the sweeps over bandwidth and device budget are modelled."""
        if self.device != "cuda":
            return self
        return dataclasses.replace(self, model=copy.deepcopy(self.model).cpu(), seqs=self.seqs.cpu(), device="cpu")

    def tps_by_bandwidth(self, policies: dict[str, tuple[str, dict]], bandwidths: tuple[float, ...]) -> dict:
        """{policy: [modelled tokens/s at each bandwidth]}, one sequence (over the simulator, also on CUDA)."""
        sim = self.modelled
        return {name: [sim.decode(p, kw, b, n=1)["tps"] for b in bandwidths] for name, (p, kw) in policies.items()}

    def tps_by_host(self, policies: dict[str, tuple[str, dict]], hosts: tuple[float, ...]) -> dict:
        """{policy: [modelled tokens/s at each host row-gather GB/s]}, one sequence, at the notebook's PCIe bandwidth
        (over the simulator, also on CUDA). Only FloE gathers rows on the host; the others are decoded once."""
        sim, out = self.modelled, {}
        for name, (p, kw) in policies.items():
            out[name] = ([sim.decode(p, kw, n=1, host=h)["tps"] for h in hosts] if p == "floe"
                         else [sim.decode(p, kw, n=1)["tps"]] * len(hosts))
        return out

    def tps_by_budget(self, budgets_kb: tuple[float, ...], keep: float) -> dict[str, list]:
        """{LRU FP16, LRU INT2, Mixtral-offloading, floe: [tokens/s under each device budget, None where it does
        not fit]}."""
        out = {name: [] for name, _ in BUDGETED}
        for b in budgets_kb:
            res = self.simulate(self.pcie_gbps, keep, b)
            for name in out:
                out[name].append(res[name]["tps"] if name in res else None)
        return out


BUDGETED = (("LRU FP16", "lru-fp16"), ("LRU INT2", "lru-int2"), ("Mixtral-offloading", "mixtral"), ("floe", "floe"))


@stage
def _simulated(dec: Decoder, policy: str, kw: dict, gbps: float, n: int | None, host: float | None = None) -> dict:
    """`Decoder.run` over the simulator, cached by the model, sequences, predictor, policy and bandwidths."""
    return dec.run(policy, kw, gbps, n, host)
