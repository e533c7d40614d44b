"""Quantization formats: what a quantized matrix holds and how it maps back to floats.

INT8: symmetric, w = q * s, q in [-127, 127] int8 [N, K]; one fp16 scale per output row ("per channel",
group_size = K) or per group of 32/64/128 inputs (GGUF Q8_0 is INT8 with group 32).

INT4: asymmetric, w = q * s + m, q in [0, 15]; an fp16 scale s and min m per group of 32/64/128 inputs of
each row. The zero point is stored as the min it implies (m = -z * s): GGUF Q4_1 is exactly this with
group 32, and Q4_0 is (s, -8 s), so both load bit for bit. Packing (GGML's own, chosen because it lets the
kernels unpack with one mask and one shift and no interleave): the K inputs of a row, zero-padded to a
multiple of 32, form blocks of 32; block b becomes 16 bytes, byte b*16 + j holding input b*32 + j in its low
nibble and input b*32 + j + 16 in its high nibble. qweight is uint8 [N, ceil(K/32) * 16].

Scales and mins are fp16 [N, ceil(K / group_size)]; the last group of a row may be partial.

FP8 (vLLM's "fp8"): w = q * s, q float8_e4m3fn [N, K], one float32 scale per output row, s = max|w| / 448.
Unlike the integer formats it also quantizes the activations: each row (token) of x becomes e4m3 with its own
scale, so the product runs on FP8 tensor cores (twice bf16's rate on Hopper); a scale per token, not per batch,
keeps a token's result independent of the tokens batched with it. float32 scales: a row's max|w| / 448 of
small weights is below fp16's normal range.

Rounding to nearest (quantize()): INT8 takes s = max|w| / 127, FP8 s = max|w| / 448. INT4 fits each group's (s, m) by least
squares over a few candidate grids around min-max (llama.cpp's make_qkx2_quants), so it may clip an outlier
a little: |error| <= s / 2 inside the grid, and a group's squared error never exceeds min-max rounding's.
GPTQ (gptq.py) fills the same formats with better values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK_BLOCK = 32                     # INT4 inputs per packing block (16 bytes)
GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 128
_METHOD_RE = re.compile(r"(int8|int4)(?:-g(\d+))?")
FP8 = "fp8"
FP8_MAX = 448.0                     # the largest finite float8_e4m3fn


class UnknownMethodError(ValueError):
    """A method name that is no format: callers that take other names too (the engine's 'gguf') list them."""


@dataclass(frozen=True)
class QuantFormat:
    """bits 8 or 4; group_size None means one group per row (INT8 and FP8). fp8: e4m3 weights and activations
    instead of integer weights."""
    bits: int
    group_size: int | None = None
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.fp8 and (self.bits != 8 or self.group_size is not None):
            raise ValueError("FP8 is 8 bits with one scale per output row (no group size)")
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.group_size is None and self.bits == 4:
            raise ValueError("INT4 needs a group size (32, 64 or 128)")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size must be one of {GROUP_SIZES}, got {self.group_size}")

    @classmethod
    def parse(cls, method: str, group_size: int | None = None) -> QuantFormat:
        """'int8' (per channel), 'int4' (group 128), 'int8-g32' / 'int4-g64' style names, or 'fp8'."""
        if method == FP8:
            if group_size is not None:
                raise ValueError(f"fp8 has one scale per output row; group size {group_size} does not apply")
            return cls(8, None, fp8=True)
        m = _METHOD_RE.fullmatch(method)
        if m is None:
            raise UnknownMethodError(f"quantization method {method!r} is not supported; allowed: int8, int4, "
                                     f"int8-g<N>, int4-g<N> with N in {GROUP_SIZES}, fp8")
        if m.group(2) is not None:
            if group_size is not None and group_size != int(m.group(2)):
                raise ValueError(f"method {method!r} conflicts with group size {group_size}")
            group_size = int(m.group(2))
        bits = 8 if m.group(1) == "int8" else 4
        if bits == 4 and group_size is None:
            group_size = DEFAULT_INT4_GROUP
        return cls(bits, group_size)

    @property
    def name(self) -> str:
        if self.fp8:
            return FP8
        base = f"int{self.bits}"
        return base if self.group_size is None else f"{base}-g{self.group_size}"

    def group(self, in_features: int) -> int:
        """Inputs per scale for a row of in_features."""
        return in_features if self.group_size is None else self.group_size

    def num_groups(self, in_features: int) -> int:
        return -(-in_features // self.group(in_features))

    def qweight_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        if self.bits == 8:
            return out_features, in_features
        return out_features, -(-in_features // PACK_BLOCK) * (PACK_BLOCK // 2)

    @property
    def qweight_dtype(self) -> torch.dtype:
        if self.fp8:
            return torch.float8_e4m3fn
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp8 else torch.float16

    @property
    def has_min(self) -> bool:
        return self.bits == 4

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the packed weight with its scales (and mins)."""
        rows, cols = self.qweight_shape(out_features, in_features)
        meta = out_features * self.num_groups(in_features) * self.scale_dtype.itemsize * (2 if self.has_min else 1)
        return rows * cols + meta


@dataclass
class QuantizedWeight:
    """A quantized [out_features, in_features] matrix: packed values, fp16 scales, fp16 mins (INT4)."""
    fmt: QuantFormat
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.mins, self.in_features, self.fmt.group(self.in_features),
                          dtype)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [N, ceil(K/group), group]; a partial last group is padded with copies of its last element,
    which changes neither its min nor its max."""
    n, k = w.shape
    pad = -k % group
    if pad:
        w = F.pad(w.unsqueeze(1), (0, pad), mode="replicate").squeeze(1)
    return w.view(n, -1, group)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """The rounding every quantizer here uses (the Triton KV writer too): ties away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(w: torch.Tensor, fmt: QuantFormat, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """Quantize a float [out, in] matrix (on its own device, in float32). INT4 minimizes the squared error
    of each group, each input weighted by `importance` [in] when given (the mean square of its activation:
    an error on a large input costs more)."""
    n, k = w.shape
    group = fmt.group(k)
    if fmt.fp8:
        q, scales = quantize_fp8_rows(w)
        return QuantizedWeight(fmt, q, scales.unsqueeze(-1), None, k)
    g = _grouped(w.float(), group)
    if fmt.bits == 8:
        scales = (g.abs().amax(-1) / 127).to(torch.float16)
        s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)
        q = round_half_away(g / s.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(fmt, q.view(n, -1)[:, :k].contiguous(), scales, None, k)
    weight = (torch.arange(g.shape[1] * group, device=w.device) < k).float()
    if importance is not None:
        weight[:k] *= importance.to(weight.device).float()
    q, scales, mins = _fit_int4(g, weight.view(1, -1, group))
    return QuantizedWeight(fmt, pack_int4(q.view(n, -1)[:, :k]), scales, mins, k)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [M]): each row's scale is max|row| / 448 (a zero row keeps scale 0
    and zeros) and its values are multiplied by the scale's reciprocal, every division IEEE, as the Triton kernel
    does: FP8 weights a row at a time, activations a token at a time."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = amax / torch.full_like(amax, FP8_MAX)  # by a tensor: CUDA divides by a scalar through its reciprocal
    inv = torch.ones_like(scale) / scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _fit_int4(g: torch.Tensor, weight: torch.Tensor, steps: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, min) per group minimizing the squared error, as llama.cpp's make_qkx2_quants does: try
    `steps` + 1 scales around (max - min) / 15, fit scale and min to each rounding by least squares, keep the
    best, and round once more to the grid of the fp16 scale and min that are stored."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    span = (hi - lo).clamp_min(1e-30)
    n = weight.sum(-1, keepdim=True)
    sw = (weight * g).sum(-1, keepdim=True)
    best_err = best_s = best_m = None
    for i in range(steps + 1):
        q = ((g - lo) * ((15 - 1 + 2 * i / steps) / span)).round().clamp(0, 15)
        wq = weight * q
        sq, sqq, sqw = wq.sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True), (wq * g).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 0
        s = torch.where(ok, (n * sqw - sq * sw) / torch.where(ok, det, 1.0), 0.0)
        m = torch.where(ok, (sw - s * sq) / n.clamp_min(1e-30), lo)
        s, m = s.half().float(), m.half().float()
        err = (weight * (q * s + m - g) ** 2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_s, best_m = err, s, m
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    safe = torch.where(best_s > 0, best_s, 1.0)
    q = round_half_away((g - best_m) / safe).clamp(0, 15).to(torch.uint8)
    return q, best_s.squeeze(-1).half(), best_m.squeeze(-1).half()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15], [N, K] -> packed uint8 [N, ceil(K/32) * 16] (layout in the module doc)."""
    n, k = q.shape
    q = F.pad(q, (0, -k % PACK_BLOCK)).view(n, -1, 2, PACK_BLOCK // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Packed uint8 [N, bytes] -> uint8 values [N, in_features]."""
    n = packed.shape[0]
    b = packed.view(n, -1, PACK_BLOCK // 2)
    return torch.stack((b & 15, b >> 4), dim=2).reshape(n, -1)[:, :in_features]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, in_features: int,
               group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float [N, in_features]; computed in float32 as q * s (+ m), as GGML does."""
    if qweight.dtype == torch.float8_e4m3fn:
        return (qweight.float() * scales.float()).to(dtype)
    q = unpack_int4(qweight, in_features) if qweight.dtype == torch.uint8 else qweight
    n = q.shape[0]
    w = F.pad(q, (0, -in_features % group)).view(n, -1, group).float() * scales.float().unsqueeze(-1)
    if mins is not None:
        w += mins.float().unsqueeze(-1)
    return w.view(n, -1)[:, :in_features].to(dtype).contiguous()
