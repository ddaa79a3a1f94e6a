"""How an offload engine moves experts and spends time: the copy/stream layer (`Link`) and its time model.

One engine code path runs everywhere; only the link differs. Both links follow the same causal rules, stated
by explicit dependencies (`after`, a time on `SimLink`, a CUDA event on `CudaLink`):

- three lanes: `compute` (the device's main stream), `host` (the CPU thread that gathers rows into a staging
  buffer), `transfer` (one FIFO host-to-device copy engine);
- an operation starts when its lane is free and its inputs exist: a gather after the prediction that chose its
  rows, a copy after its gather and after the last compute that read its destination buffer, a compute after
  the copies it reads (`wait`);
- every span records `needs`, the time its inputs existed, so a timeline can be checked for causality.

`SimLink` (CPU, CI) copies host tensors and models time: a copy takes latency + bytes / PCIe bandwidth, a gather
bytes / host-gather bandwidth, a compute (bytes of weights it reads) / device-memory bandwidth (decode is
memory-bound). `CudaLink` copies pinned host tensors on a side CUDA stream (non_blocking) and times compute and
copies with CUDA events and the host gather with the host clock; for timing it synchronises once per token
(`elapsed`; the decode itself still waits where data must reach the host: the routed experts' ids, and a prediction
before its host gather, whose indices come over on a stream of their own so that the wait is for the prediction
only, not for the experts queued behind it), and `spans` are read from the events only when asked for.
`TimeModel.mixtral_equivalent` scales every bandwidth by (toy expert size / Mixtral expert size), so a toy timeline
has Mixtral's proportions.
`h2d_bandwidth` measures pinned host-to-device copies of row chunks, `gather_bandwidth` the host's row gather.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
from torch import Tensor

MIXTRAL = {"H": 4096, "F": 14336, "L": 32, "E": 8, "top_k": 2}  # Mixtral-8x7B's expert shapes


@dataclass(frozen=True)
class TimeModel:
    pcie: float = 25e9  # host->device bytes/s (PCIe 4.0 x16 effective, FloE: 88% of peak)
    hbm: float = 936e9  # device memory bytes/s (RTX 3090)
    host: float = 25e9  # host row-gather bytes/s (FloE's multithreaded packing keeps pace with PCIe, Sec. 3.4.2)
    latency: float = 10e-6  # per copy
    scale: float = 1.0  # multiplies every bandwidth

    def transfer(self, nbytes: int) -> float:
        return self.latency + nbytes / (self.pcie * self.scale)

    def compute(self, nbytes: int) -> float:
        return nbytes / (self.hbm * self.scale)

    def gather(self, nbytes: int) -> float:
        return nbytes / (self.host * self.scale)

    @classmethod
    def mixtral_equivalent(cls, H: int, F: int, **kw) -> TimeModel:
        """Bandwidths scaled by H·F / (4096·14336): a toy expert moves and computes in Mixtral's proportions."""
        return cls(scale=H * F / (MIXTRAL["H"] * MIXTRAL["F"]), **kw)


@dataclass
class Span:
    lane: str  # "compute" | "transfer" | "host"
    layer: int
    start: float
    end: float
    what: str
    needs: float = 0.0  # when its inputs existed (start >= needs in a causal timeline)


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op CPU threads set to n inside the block and restored after it."""
    was = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(was)


def default_gather_threads() -> int:
    """`CudaLink`'s default threads per host row gather: the machine's cores, at most 8."""
    return min(8, os.cpu_count() or 1)


def row_gather(host: Tensor, idx: Tensor, out: Tensor, threads: int = 1) -> Tensor:
    """host[idx] into `out` with `threads` CPU threads (torch's `index_select`, which splits the rows among its
    intra-op threads; FloE packs rows with several threads, Sec. 3.4.2). `CudaLink.gather` runs it; `SimLink` models
    its time (`TimeModel.host`). The lab sets torch to one thread at smoke scale (two notebooks side by side on two
    cores), so the count is explicit here."""
    with intra_op_threads(threads):
        return torch.index_select(host, 0, idx, out=out)


class SimLink:
    """Device-tier simulator: 'device' tensors are host tensors; time is modelled by a TimeModel."""

    def __init__(self, tm: TimeModel):
        self.tm, self.t, self.link_free, self.host_free, self.spans = tm, 0.0, 0.0, 0.0, []

    def to_host(self, x: Tensor) -> Tensor:
        return x.detach().contiguous()

    def mark(self) -> float:
        """The time everything issued so far on the compute lane has finished."""
        return self.t

    def host_index(self, idx: Tensor, after) -> Tensor:
        """The row indices a prediction chose (`after`: its mark), on the host for a gather."""
        return idx.cpu()

    def reserve(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Staging room for gathers of up to `rows` rows of `shape` (the simulator stages nothing)."""

    def gather(self, host: Tensor, idx: Tensor, layer: int, what: str, after: float) -> tuple[Tensor, float]:
        """host[idx] (idx on the host) into a staging buffer on the host lane, once `after` (the prediction) has
        finished."""
        out = host[idx]
        start = max(after, self.host_free)
        self.host_free = start + self.tm.gather(_nbytes(out))
        self.spans.append(Span("host", layer, start, self.host_free, what, after))
        return out, self.host_free

    def copy(self, src: Tensor, dst: Tensor, layer: int, what: str, after: tuple = ()) -> float:
        """src -> dst (preallocated) on the FIFO link, after every mark in `after` (src gathered, dst no longer
        read; None: no constraint)."""
        dst.copy_(src)
        needs = max((a for a in after if a is not None), default=0.0)
        start = max(needs, self.link_free)
        self.link_free = start + self.tm.transfer(_nbytes(src))
        self.spans.append(Span("transfer", layer, start, self.link_free, what, needs))
        return self.link_free

    def wait(self, ready: float | None) -> None:
        if ready is not None:
            self.t = max(self.t, ready)

    def compute(self, layer: int, nbytes: int, fn, what: str = "layer"):
        start, out = self.t, fn()
        self.t += self.tm.compute(nbytes)
        self.spans.append(Span("compute", layer, start, self.t, what, start))
        return out

    def since(self, mark: float, layer: int, nbytes: int, what: str) -> None:
        """The work the model ran since `mark` (e.g. its attention, between two hooks) as one compute span."""
        self.compute(layer, nbytes, lambda: None, what)

    def elapsed(self, a: float, b: float) -> float:
        return b - a

    def spans_since(self, a: float) -> list[Span]:
        return [s for s in self.spans if s.end > a]


class CudaLink(SimLink):
    """Real H2D copies from pinned host memory on a side stream; CUDA events time copies and compute, the host
    clock the gathers (aligned to the events at construction). One synchronisation per token (`elapsed`).
    `gather_threads`: CPU threads of each host row gather (default: the machine's cores, at most 8)."""

    def __init__(self, device: str = "cuda", gather_threads: int | None = None):
        super().__init__(TimeModel())
        self.gather_threads = gather_threads or default_gather_threads()
        self.device, self.stream = device, torch.cuda.Stream(device)
        self.index_stream = torch.cuda.Stream(device)  # device->host index copies, behind nothing but a prediction
        torch.cuda.synchronize()
        self.t0 = torch.cuda.Event(enable_timing=True)
        self.t0.record()
        torch.cuda.synchronize()
        self.h0 = time.perf_counter()
        self._events: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, str]] = []
        self._host: list[Span] = []
        self._ring: list[list] = [[None, None] for _ in range(32)]  # [pinned staging buffer, copy-done event]
        self._next, self._pending = 0, None

    def to_host(self, x: Tensor) -> Tensor:
        """x copied straight into pinned host memory (not through a pageable copy and a second one to pin it)."""
        return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x.detach())

    def _event(self, stream=None) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def mark(self) -> torch.cuda.Event:
        return self._event()

    def host_index(self, idx: Tensor, after) -> Tensor:
        """idx copied to pinned host memory on a stream of its own that waits for `after` (the prediction that chose
        idx) only: `idx.cpu()` would wait for everything queued on the compute stream, e.g. the layer's experts that
        the next layer's gather is meant to overlap."""
        if not idx.is_cuda:
            return idx
        out = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
        if isinstance(after, torch.cuda.Event):
            self.index_stream.wait_event(after)
        with torch.cuda.stream(self.index_stream):
            out.copy_(idx, non_blocking=True)
            done = self._event(self.index_stream)
        done.synchronize()
        return out

    def reserve(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Pins every staging slot of the ring for gathers of up to `rows` rows of `shape` now, before any token is
        timed: pinning a buffer takes milliseconds, and a ring filled on demand pinned some of its 32 slots inside
        the first timed token."""
        for slot in self._ring:
            if slot[0] is None or slot[0].shape[0] < rows or slot[0].shape[1:] != shape or slot[0].dtype != dtype:
                if slot[1] is not None:
                    slot[1].synchronize()
                slot[0] = torch.empty((max(rows, 1),) + tuple(shape), dtype=dtype, pin_memory=True)

    def gather(self, host: Tensor, idx: Tensor, layer: int, what: str, after) -> tuple[Tensor, float]:
        """Rows host[idx] (idx on the host) into a pinned staging buffer (a ring, reused once its previous copy has
        finished; `reserve` pins it ahead); waits for `after` (the prediction that chose idx) only, not for the whole
        stream."""
        if isinstance(after, torch.cuda.Event):
            after.synchronize()
        needs = time.perf_counter() - self.h0
        slot = self._ring[self._next % len(self._ring)]
        self._next += 1
        if slot[1] is not None:
            slot[1].synchronize()
        n = len(idx)
        fits = slot[0] is not None and slot[0].shape[0] >= n and slot[0].shape[1:] == host.shape[1:]
        if not fits or slot[0].dtype != host.dtype:
            slot[0] = torch.empty((max(n, 1),) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True)
        out = slot[0][:n]
        start = time.perf_counter() - self.h0
        row_gather(host, idx, out, self.gather_threads)
        end = time.perf_counter() - self.h0
        self._host.append(Span("host", layer, start, end, what, needs))
        self._pending = slot
        return out, None

    def copy(self, src: Tensor, dst: Tensor, layer: int, what: str, after: tuple = ()) -> torch.cuda.Event:
        for a in after:  # events: dst no longer read, the routing done (gathers already ran on this thread)
            if isinstance(a, torch.cuda.Event):
                self.stream.wait_event(a)
        with torch.cuda.stream(self.stream):
            a = self._event(self.stream)
            dst.copy_(src, non_blocking=True)
            b = self._event(self.stream)
        self._events.append(("transfer", layer, a, b, what))
        if self._pending is not None and src.data_ptr() == self._pending[0].data_ptr():
            self._pending[1], self._pending = b, None
        return b

    def wait(self, ready) -> None:
        if isinstance(ready, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ready)

    def compute(self, layer: int, nbytes: int, fn, what: str = "layer"):
        a = self._event()
        out = fn()
        self._events.append(("compute", layer, a, self._event(), what))
        return out

    def since(self, mark, layer: int, nbytes: int, what: str) -> None:
        self._events.append(("compute", layer, mark, self._event(), what))

    def elapsed(self, a, b) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    @property
    def spans(self) -> list[Span]:
        torch.cuda.synchronize()
        at = lambda e: self.t0.elapsed_time(e) / 1e3
        return [Span(lane, i, at(a), at(b), w, at(a)) for lane, i, a, b, w in self._events] + self._host

    @spans.setter
    def spans(self, value) -> None:  # SimLink.__init__ assigns []
        pass

    def spans_since(self, a) -> list[Span]:
        t = self.t0.elapsed_time(a) / 1e3 if a is not None else 0.0
        return [s for s in self.spans if s.end > t]


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


def gather_bandwidth(H: int = 4096, F: int = 14336, keep: float = 0.2, reps: int = 5, seed: int = 0,
                     threads: int = 1) -> float:
    """Host GB/s of `threads` CPU threads gathering keep·F random (2, H) FP16 rows of an (F, 2, H) store into a
    staging buffer (`row_gather`, what `CudaLink` runs): the measured counterpart of `TimeModel.host`."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(F, 2, H, generator=g).half()
    idx = torch.randperm(F, generator=g)[: max(1, round(keep * F))].sort().values
    out = torch.empty(len(idx), 2, H, dtype=torch.float16)
    row_gather(src, idx, out, threads)
    t0 = time.perf_counter()
    for _ in range(reps):
        row_gather(src, idx, out, threads)
    return _nbytes(out) * reps / (time.perf_counter() - t0) / 1e9
