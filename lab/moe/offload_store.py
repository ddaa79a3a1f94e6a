"""Where the offload engine (`lab.moe.offload`) keeps experts: the form each policy moves and holds an expert in,
its decoding into the model's dtype, and byte counts summed over the tensors actually held.

Forms (a dict of tensors per expert):

- `fp`: {"w": (3, F, H)} W_gate, W_up, W_downᵀ in the weight dtype `weight_dtype` (FP16 for an FP32 model — the toy
  stands in for an FP16 Mixtral —, the model's own dtype otherwise); DeepSpeed-style streaming holds a whole layer,
  {"w": (E, 3, F, H)};
- `int2`: {"int2": block}: per matrix m (0 gate, 1 up, 2 downᵀ) codes `q{m}` (F, ⌈H/4⌉) uint8 in the INT2 packing
  of `lab.compress.quant.pack` (4 codes per byte, code i in bits 2i..2i+1) with FP16 scale/zero `s{m}`, `z{m}`
  (F, ⌈H/g⌉), from our HQQ solver (`lab.compress.quant.quantize`, groups of g inputs, g = 64 as FloE configures HQQ),
  the nine pieces in ONE contiguous uint8 block per expert (`int2_layout`), so one copy moves it, as in `mo`;
- `mo`: Mixtral-offloading's expert (Eliseev & Mazur 2023; dvmazur/mixtral-offloading `src/build_model.py`:
  HQQ `nbits=2, group_size=16, quant_zero=True, quant_scale=True`): 2-bit codes in groups of 16, the scale quantized
  to 8 bits in groups of 128 and the zero to 8 bits with one range per matrix (the `hqq` version the repository pins:
  `scale_quant_params` group 128, `zero_quant_params` channel_wise False), their FP16 meta, all in ONE contiguous
  uint8 block per expert, {"mo": block} (their `UntypedStorage` per expert), so one copy moves it. Our groups run
  along the input dimension (HQQ `axis=1`); theirs along axis 0 — the same bits per weight;
- `rows`: FloE's host store {"rows": (F, 2, H)}: gate row j and down column j side by side (FloE Sec. 3.4.2);
- `up`: FloE's device-resident W_up {"q", "s", "z"}: INT2, group 64, FP16 scale/zero, the layout
  `lab.kernels.floe.int2_gemv` reads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lab.compress.quant import quantize, unpack

Form = dict[str, Tensor]


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype FP experts are held and moved in: FP16 for an FP32 (toy) model, else the model's dtype."""
    return torch.float16 if dtype == torch.float32 else dtype


def nbytes(form) -> int:
    """Bytes of every tensor in a form, a dict of forms or a list of them."""
    if isinstance(form, Tensor):
        return form.numel() * form.element_size()
    values = form.values() if isinstance(form, dict) else form
    return sum(nbytes(v) for v in values)


def empty_like(form: Form, device) -> Form:
    return {k: torch.empty_like(v, device=device) for k, v in form.items()}


def to(form: Form, fn) -> Form:
    return {k: fn(v) for k, v in form.items()}


# --------------------------------------------------------------------------------------------- building forms

def fp_form(Wg: Tensor, Wu: Tensor, Wd: Tensor, wd: torch.dtype) -> Form:
    return {"w": torch.stack([Wg, Wu, Wd.T]).detach().to(wd).contiguous()}


def int2_matrix(W: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """HQQ INT2 of W (N, K): packed codes (N, ⌈K/4⌉) uint8, FP16 scale and zero (N, ⌈K/g⌉)."""
    q = quantize(W.detach().float(), 2, group_size)
    return q.packed, q.scale.half(), q.zero.half()


def int2_form(Wg: Tensor, Wu: Tensor, Wd: Tensor, group_size: int) -> Form:
    F, H = Wg.shape
    parts = {}
    for m, W in enumerate((Wg, Wu, Wd.T)):
        parts[f"q{m}"], parts[f"s{m}"], parts[f"z{m}"] = int2_matrix(W, group_size)
    return {"int2": _pack(parts, int2_layout(F, H, group_size), Wg.device)}


def up_form(Wu: Tensor, group_size: int) -> Form:
    q, s, z = int2_matrix(Wu, group_size)
    return {"q": q, "s": s, "z": z}


def rows_form(Wg: Tensor, Wd: Tensor, wd: torch.dtype) -> Form:
    return {"rows": torch.stack([Wg, Wd.T], 1).detach().to(wd).contiguous()}


def _q8(v: Tensor, group: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """8-bit min-max codes of v (flattened) in groups of `group` (None: one group), FP16 scale and zero per group."""
    flat = v.float().flatten()
    n = len(flat) if group is None else group
    pad = (-len(flat)) % n
    g = torch.cat([flat, flat[-1:].expand(pad)]).reshape(-1, n)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    s = ((hi - lo) / 255).clamp_min(1e-8)
    z = -lo / s
    return torch.round(g / s + z).clamp(0, 255).to(torch.uint8).flatten()[: len(flat)], s.half(), z.half()


def _dq8(codes: Tensor, s: Tensor, z: Tensor, group: int | None, shape) -> Tensor:
    """(codes − z) · s per group in the meta's dtype, FP16, as HQQ decodes quantized meta (`Quantizer.dequantize` of
    `scale_q` / `zero_q` in the compute dtype) for Mixtral-offloading."""
    n = codes.numel() if group is None else group
    pad = (-codes.numel()) % n
    c = codes.to(s.dtype)
    c = (torch.cat([c, c[-1:].expand(pad)]) if pad else c).reshape(-1, n)
    return ((c - z) * s).flatten()[: codes.numel()].reshape(shape)


MO_GROUP, MO_META_GROUP = 16, 128
Layout = list[tuple[str, int, tuple[int, ...], torch.dtype]]


def _layout(pieces: list[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
    """(name, byte offset, shape, dtype) of each piece laid end to end in one uint8 block (offsets even, so FP16
    pieces are aligned), then ("end", block size)."""
    out, off = [], 0
    for name, shape, dt in pieces:
        out.append((name, off, shape, dt))
        off += math.prod(shape) * (2 if dt == torch.float16 else 1)
        off += off % 2
    return out + [("end", off, (), torch.uint8)]


def int2_layout(F: int, H: int, group_size: int) -> Layout:
    """The pieces of an `int2` expert block: codes, FP16 scale and zero of W_gate, W_up, W_downᵀ."""
    G = math.ceil(H / group_size)
    return _layout([piece for m in range(3) for piece in ((f"q{m}", (F, math.ceil(H / 4)), torch.uint8),
                                                          (f"s{m}", (F, G), torch.float16),
                                                          (f"z{m}", (F, G), torch.float16))])


def mo_layout(F: int, H: int) -> Layout:
    """The pieces of a Mixtral-offloading expert block: the three matrices' codes first (at Mixtral's shape each
    starts 16-byte aligned, so the kernels read them with vector loads), then their 8-bit meta codes, the meta's FP16
    scale/zero, and last the 2-byte ones."""
    G, GM = math.ceil(H / MO_GROUP), math.ceil(F * math.ceil(H / MO_GROUP) / MO_META_GROUP)
    pieces = [(f"q{m}", (F, math.ceil(H / 4)), torch.uint8) for m in range(3)]
    for m in range(3):
        pieces += [(f"sq{m}", (F, G), torch.uint8), (f"zq{m}", (F, G), torch.uint8),
                   (f"ss{m}", (GM, 1), torch.float16), (f"sz{m}", (GM, 1), torch.float16)]
    pieces += [(f"{k}{m}", (1, 1), torch.float16) for m in range(3) for k in ("zs", "zz")]
    return _layout(pieces)


def _pack(parts: dict[str, Tensor], layout: Layout, device) -> Tensor:
    block = torch.zeros(layout[-1][1], dtype=torch.uint8, device=device)
    for name, off, _, _ in layout[:-1]:
        b = parts[name].contiguous().reshape(-1).view(torch.uint8)
        block[off:off + b.numel()] = b
    return block


def mo_form(Wg: Tensor, Wu: Tensor, Wd: Tensor) -> Form:
    F, H = Wg.shape
    parts = {}
    for m, W in enumerate((Wg, Wu, Wd.T)):
        q = quantize(W.detach().float(), 2, MO_GROUP)
        parts[f"q{m}"] = q.packed
        parts[f"sq{m}"], parts[f"ss{m}"], parts[f"sz{m}"] = _q8(q.scale, MO_META_GROUP)
        parts[f"zq{m}"], parts[f"zs{m}"], parts[f"zz{m}"] = _q8(q.zero, None)
    return {"mo": _pack(parts, mo_layout(F, H), Wg.device)}


# --------------------------------------------------------------------------------------------- decoding

def dequant(q: Tensor, s: Tensor, z: Tensor, group_size: int, K: int, dtype: torch.dtype) -> Tensor:
    """(codes − zero) · scale in FP32 (as the kernels accumulate), returned in `dtype`: (N, K). Codes are read from
    the INT2 packing of `lab.compress.quant.pack` (code i of a byte in bits 2i, 2i + 1)."""
    N, G = s.shape
    if K != G * group_size:  # a ragged last group: index the groups
        g = torch.arange(K, device=q.device) // group_size
        return ((unpack(q, 2, K).float() - z.float()[:, g]) * s.float()[:, g]).to(dtype)
    codes = ((q.unsqueeze(-1) >> _SHIFTS.to(q.device)) & 3).reshape(N, -1)[:, :K]
    w = (codes.float().view(N, G, group_size) - z.float()[..., None]) * s.float()[..., None]
    return w.view(N, K).to(dtype)


_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _views(block: Tensor, layout: Layout) -> dict[str, Tensor]:
    """The pieces of a block as views into it (no copies)."""
    views = {}
    for name, off, shape, dt in layout[:-1]:
        n = math.prod(shape) * (2 if dt == torch.float16 else 1)
        views[name] = block[off:off + n].view(dt).reshape(shape)
    return views


class _MoParts:
    """Mixtral-offloading's three matrices as (codes, scale, zero), each decoded when indexed (scale and zero from
    their 8-bit codes to FP16, (F, H/16) each: 7 MB at Mixtral's shape), so that one matrix's meta exists at a time
    (all three at once, in FP32, were ~90 MB per expert call on the device)."""

    def __init__(self, v: dict[str, Tensor], F: int):
        self.v, self.F = v, F

    def __len__(self) -> int:
        return 3

    def __getitem__(self, m: int) -> tuple[Tensor, Tensor, Tensor]:
        if not 0 <= m < 3:
            raise IndexError(m)
        v, G = self.v, self.v[f"sq{m}"].shape[1]
        s = _dq8(v[f"sq{m}"].flatten(), v[f"ss{m}"], v[f"sz{m}"], MO_META_GROUP, (self.F, G))
        return v[f"q{m}"], s, _dq8(v[f"zq{m}"].flatten(), v[f"zs{m}"], v[f"zz{m}"], None, (self.F, G))


def int2_parts(form: Form, F: int, H: int, group_size: int = 64) -> tuple:
    """An `int2` or `mo` expert as ((codes, scale, zero) of W_gate, W_up, W_downᵀ), each (F, H) packed along H, and
    the group size: views into the block, except Mixtral-offloading's scale and zero, decoded from their 8-bit codes
    when each matrix is indexed (`_MoParts`)."""
    if "mo" in form:
        return _MoParts(_views(form["mo"], mo_layout(F, H)), F), MO_GROUP
    v = _views(form["int2"], int2_layout(F, H, group_size))
    return tuple((v[f"q{m}"], v[f"s{m}"], v[f"z{m}"]) for m in range(3)), group_size


def decode(form: Form, F: int, H: int, dtype: torch.dtype, group_size: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """W_gate, W_up, W_downᵀ (each (F, H)) of one expert's form, in `dtype`."""
    if "w" in form:
        return tuple(form["w"].to(dtype))
    parts, g = int2_parts(form, F, H, group_size)
    return tuple(dequant(*parts[m], g, H, dtype) for m in range(3))


def rows_buffer(top_k: int, n_keep: int, H: int, wd: torch.dtype, device) -> Form:
    """One of FloE's two device buffers: top_k experts' kept rows (n_keep, 2, H) and their neuron indices."""
    return {"rows": torch.empty(top_k, n_keep, 2, H, dtype=wd, device=device),
            "idx": torch.zeros(top_k, n_keep, dtype=torch.long, device=device)}
