"""How an offload engine moves experts and spends time: the copy/stream layer (`Link`) and its time model.

One engine code path runs everywhere; only the link differs. `SimLink` (CPU, CI) copies host tensors and
models time: a copy takes latency + bytes / PCIe bandwidth on one FIFO link, a layer's compute takes
(bytes of weights it reads) / device-memory bandwidth (decode is memory-bound), and a layer starts when its
data has arrived. `CudaLink` copies pinned host tensors on a side CUDA stream (non_blocking) and times copies
and compute with CUDA events. `TimeModel.mixtral_equivalent` scales both bandwidths by (toy expert size /
Mixtral expert size), so a toy timeline has Mixtral's proportions. Both record `Span`s (compute and
transfer lanes) for a timeline. `h2d_bandwidth` measures pinned host-to-device copies of row chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

MIXTRAL = {"H": 4096, "F": 14336, "L": 32, "E": 8, "top_k": 2}  # Mixtral-8x7B's expert shapes


@dataclass(frozen=True)
class TimeModel:
    pcie: float = 25e9  # host->device bytes/s (PCIe 4.0 x16 effective, FloE: 88% of peak)
    hbm: float = 936e9  # device memory bytes/s (RTX 3090)
    latency: float = 10e-6  # per copy
    scale: float = 1.0  # multiplies both bandwidths

    def transfer(self, nbytes: int) -> float:
        return self.latency + nbytes / (self.pcie * self.scale)

    def compute(self, nbytes: int) -> float:
        return nbytes / (self.hbm * self.scale)

    @classmethod
    def mixtral_equivalent(cls, H: int, F: int, **kw) -> TimeModel:
        """Bandwidths scaled by H·F / (4096·14336): a toy expert moves and computes in Mixtral's proportions."""
        return cls(scale=H * F / (MIXTRAL["H"] * MIXTRAL["F"]), **kw)


@dataclass
class Span:
    lane: str  # "compute" | "transfer"
    layer: int
    start: float
    end: float
    what: str


class SimLink:
    """Device-tier simulator: 'device' tensors are host copies; time is modelled by a TimeModel."""

    def __init__(self, tm: TimeModel):
        self.tm, self.t, self.link_free, self.spans = tm, 0.0, 0.0, []

    def to_host(self, x: Tensor) -> Tensor:
        return x.contiguous()

    def gather(self, host: Tensor, idx: Tensor) -> Tensor:
        return host[idx.cpu()]

    def copy(self, x: Tensor, layer: int, what: str) -> tuple[Tensor, float]:
        start = max(self.t, self.link_free)
        self.link_free = start + self.tm.transfer(x.numel() * x.element_size())
        self.spans.append(Span("transfer", layer, start, self.link_free, what))
        return x.clone(), self.link_free

    def wait(self, ready: float) -> None:
        self.t = max(self.t, ready)

    def compute(self, layer: int, nbytes: int, fn, what: str = "layer"):
        start, out = self.t, fn()
        self.t += self.tm.compute(nbytes)
        self.spans.append(Span("compute", layer, start, self.t, what))
        return out

    def now(self) -> float:
        return self.t


class CudaLink(SimLink):
    """Real H2D copies from pinned host memory on a side stream; CUDA events time copies and compute."""

    def __init__(self, device: str = "cuda"):
        super().__init__(TimeModel())
        self.device, self.stream = device, torch.cuda.Stream(device)
        self.t0 = torch.cuda.Event(enable_timing=True)
        self.t0.record()
        self._events: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, str]] = []
        self._ring: list[list] = [[None, None] for _ in range(8)]  # [pinned buffer, copy-done event]
        self._next, self._pending = 0, None

    def to_host(self, x: Tensor) -> Tensor:
        return x.detach().cpu().contiguous().pin_memory()

    def gather(self, host: Tensor, idx: Tensor) -> Tensor:
        """Gather rows into a pinned staging buffer (a ring, reused once its previous copy has finished)."""
        n = len(idx)
        slot = self._ring[self._next % len(self._ring)]
        self._next += 1
        if slot[1] is not None:
            slot[1].synchronize()
        if slot[0] is None or slot[0].shape[0] < n or slot[0].shape[1:] != host.shape[1:]:
            slot[0] = torch.empty((max(n, 1),) + tuple(host.shape[1:]), dtype=host.dtype).pin_memory()
        out = slot[0][:n]
        torch.index_select(host, 0, idx.cpu(), out=out)
        self._pending = slot
        return out

    def _span(self, lane, layer, what):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._events.append((lane, layer, a, b, what))
        return a, b

    def copy(self, x: Tensor, layer: int, what: str) -> tuple[Tensor, torch.cuda.Event]:
        a, b = self._span("transfer", layer, what)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            a.record()
            y = x.to(self.device, non_blocking=True)
            b.record()
        if self._pending is not None and x.data_ptr() == self._pending[0].data_ptr():
            self._pending[1], self._pending = b, None
        y.record_stream(torch.cuda.current_stream())
        return y, b

    def wait(self, ready) -> None:
        torch.cuda.current_stream().wait_event(ready)

    def compute(self, layer: int, nbytes: int, fn, what: str = "layer"):
        a, b = self._span("compute", layer, what)
        a.record()
        out = fn()
        b.record()
        return out

    def now(self) -> float:
        torch.cuda.synchronize()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        torch.cuda.synchronize()
        self.spans = [Span(l, i, self.t0.elapsed_time(a) / 1e3, self.t0.elapsed_time(b) / 1e3, w)
                      for l, i, a, b, w in self._events]
        return self.t0.elapsed_time(e) / 1e3


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
