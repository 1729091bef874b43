"""Fake quantisation of weights: a uniform symmetric b-bit quantiser with nearest or stochastic rounding, a
straight-through estimator (STE) for quantisation-aware training, per-layer scales for a flat parameter vector, and
the wire format of a quantised tensor.

The quantiser (standard; e.g. Jacob et al., "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", CVPR 2018, in its symmetric "narrow range" form, as int8 in [−127, 127]): on
[−R, R] with b bits there are 2^b − 1 levels kΔ, k = −m … m, m = 2^(b−1) − 1, step Δ = R / m — zero is a level, so
a zero weight stays exactly zero, and ±R are levels (one of the 2^b codes is unused). The code ℓ = k + m is stored
in b bits. b ≥ 2 (one bit has no symmetric grid with a zero). Nearest rounding has error in [−Δ/2, Δ/2] (MSE Δ²/12
for weights spread evenly over a bin); stochastic rounding picks the upper level with probability equal to the
distance from the lower one over Δ, so E[Q(w)] = w (variance ≤ Δ²/4). R defaults to max|w| (per tensor, or per
layer with `quantize_flat`), so Q(Q(w)) = Q(w). b = 32 means full precision: the identity. `quantize_flat`
quantises weights only: bias tensors stay at full precision (weight-only quantisation, as the quantised devices
of bit-width heterogeneous FL store their weight matrices).

The STE (Bengio, Léonard, Courville, arXiv:1308.3432, 2013): the forward pass uses Q(w), the backward pass treats
Q as the identity, w + (Q(w) − w).detach(). Wire format of one tensor: float32 R ‖ the levels ℓ at a fixed width of
b bits (`fedlab_nb.methods.communication.compression.pack_uint`, shared with QSGD's levels).

Used by fedlab_nb/methods/labels/prowd.py (bit-width heterogeneous FL, Yoon, Park, Jeong, Hwang, ICML 2022).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..communication.compression import pack_uint, unpack_uint

FULL_PRECISION = 32
MIN_GRID_BITS, MAX_GRID_BITS = 2, 16


def check_bits(bits) -> int:
    """b as an int: 2 … 16 bits on the grid, or 32 = full precision (no quantisation)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not (
            MIN_GRID_BITS <= bits <= MAX_GRID_BITS or bits == FULL_PRECISION):
        raise ValueError(f"bits must be an int in {MIN_GRID_BITS} … {MAX_GRID_BITS} or {FULL_PRECISION} (full "
                         f"precision), got {bits!r}; e.g. bits=4")
    return int(bits)


def half(bits: int) -> int:
    """m = 2^(b−1) − 1: the grid's levels are kΔ for k = −m … m."""
    return 2 ** (check_bits(bits) - 1) - 1


def levels(bits: int) -> int:
    """How many values a b-bit grid has: 2^b − 1 (zero among them)."""
    return 2 * half(bits) + 1


def step(bits: int, R) -> torch.Tensor | float:
    """Δ = R / (2^(b−1) − 1), the distance between neighbouring levels on [−R, R]."""
    if check_bits(bits) == FULL_PRECISION:
        raise ValueError("bits=32 is full precision and has no grid step; pass bits in 2 … 16")
    return R / half(bits)


def _scale(w: torch.Tensor, R) -> torch.Tensor:
    if R is None:
        return w.detach().abs().max()
    R = torch.as_tensor(R, dtype=w.dtype, device=w.device)
    if (R < 0).any() or not torch.isfinite(R).all():
        raise ValueError(f"R (the quantiser's range [−R, R]) must be finite and >= 0, got {R}")
    return R


def quantize_levels(w: torch.Tensor, bits: int, R=None, stochastic: bool = False,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer codes ℓ = k + m ∈ {0 … 2^b − 2} of w's entries, the R used). Entries outside [−R, R] are clipped;
    R = max|w| by default (a scalar, or one R per entry); where R = 0 (an all-zero tensor) the code is m (the zero
    level) and `dequantize` returns 0."""
    bits = check_bits(bits)
    if bits == FULL_PRECISION:
        raise ValueError("bits=32 has no integer levels (full precision); use quantize(w, 32), the identity")
    if stochastic and generator is None:
        raise ValueError("stochastic rounding needs a torch.Generator (generator=...), so the draw is keyed")
    R = _scale(w, R)
    m = half(bits)
    t = w.detach().clamp(-R, R) / torch.where(R > 0, R / m, torch.ones_like(R)) + m
    if stochastic:
        low = t.floor()
        up = torch.rand(t.shape, generator=generator, dtype=t.dtype, device="cpu").to(t.device) < (t - low)
        ell = low + up
    else:
        ell = t.round()
    ell = torch.where(R > 0, ell, torch.full_like(ell, m))  # no range (R = 0): the zero level
    return ell.clamp(0, 2 * m), R


def dequantize(ell: torch.Tensor, bits: int, R) -> torch.Tensor:
    """The grid value kΔ = R·(ℓ − m)/m of each code (float): the end codes are exactly ±R (then max|Q(w)| = R and
    Q(Q(w)) = Q(w) bit for bit) and the middle one exactly 0."""
    if not (isinstance(R, torch.Tensor) and R.is_floating_point()):
        R = torch.as_tensor(R, dtype=ell.dtype if ell.is_floating_point() else torch.get_default_dtype())
    m = half(bits)
    return torch.where(R > 0, R * ((ell.to(R.dtype) - m) / m), torch.zeros_like(ell, dtype=R.dtype))


def quantize(w: torch.Tensor, bits: int, R=None, stochastic: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Q_b(w): w's entries rounded onto the b-bit grid on [−R, R] (R = max|w| by default), as floats; b = 32
    returns w unchanged. No gradient flows through it (see `fake_quantize` for the STE)."""
    if check_bits(bits) == FULL_PRECISION:
        return w
    ell, R = quantize_levels(w, bits, R, stochastic, generator)
    return dequantize(ell, bits, R).to(w.dtype)


def fake_quantize(w: torch.Tensor, bits: int, R=None) -> torch.Tensor:
    """Q_b(w) in the forward pass, the identity in the backward pass (straight-through estimator):
    w + (Q_b(w) − w).detach(). Nearest rounding; R = max|w| (not differentiated) by default."""
    if check_bits(bits) == FULL_PRECISION:
        return w
    return w + (quantize(w.detach(), bits, R) - w.detach())


# --- flat parameter vectors: one scale per layer -------------------------------------------------------
def layer_slices(spec) -> list[slice]:
    """The flat slice of each parameter tensor of `param_spec(model)` (one quantiser scale each)."""
    out, i = [], 0
    for _, shape in spec:
        n = math.prod(shape)
        out.append(slice(i, i + n))
        i += n
    return out


def _check_flat(theta: torch.Tensor, spec) -> list[slice]:
    sl = layer_slices(spec)
    if theta.dim() != 1 or sl[-1].stop != theta.numel():
        raise ValueError(f"theta must be a flat vector of the model's {sl[-1].stop} parameters (param_spec order), "
                         f"got shape {tuple(theta.shape)}")
    return sl


@functools.lru_cache(maxsize=64)
def _layer_index(spec: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = torch.tensor([math.prod(shape) for _, shape in spec])
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes), sizes


def _entry_ranges(theta: torch.Tensor, spec) -> torch.Tensor:
    """Each entry's layer R = max|w| over its layer, [d] (one segment max, so it is cheap inside training)."""
    _check_flat(theta, spec)
    index, sizes = _layer_index(tuple((n, tuple(s)) for n, s in spec))
    index = index.to(theta.device)
    R = torch.zeros(len(sizes), dtype=theta.dtype, device=theta.device)
    R = R.scatter_reduce(0, index, theta.detach().abs(), "amax", include_self=True)
    return R[index]


def is_bias(name: str) -> bool:
    """A bias tensor (kept at full precision by `quantize_flat`, sent as float32 by `model_bytes`)."""
    return name.endswith("bias")


@functools.lru_cache(maxsize=64)
def _bias_entries(spec: tuple) -> torch.Tensor:
    return torch.cat([torch.full((math.prod(shape),), is_bias(name)) for name, shape in spec])


def quantize_flat(theta: torch.Tensor, spec, bits: int, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Each weight tensor of the flat θ quantised with its own R = max|w| (per-layer symmetric); bias tensors
    are returned unchanged (weight-only quantisation)."""
    if check_bits(bits) == FULL_PRECISION:
        return theta
    R = _entry_ranges(theta, spec)
    q = dequantize(quantize_levels(theta, bits, R, stochastic, generator)[0], bits, R).to(theta.dtype)
    bias = _bias_entries(tuple((n, tuple(s)) for n, s in spec)).to(theta.device)
    return torch.where(bias, theta, q)


def fake_quantize_flat(theta: torch.Tensor, spec, bits: int) -> torch.Tensor:
    """`fake_quantize` per layer on a flat vector: the weights a b-bit device computes with, STE gradients."""
    if check_bits(bits) == FULL_PRECISION:
        return theta
    return theta + (quantize_flat(theta.detach(), spec, bits) - theta.detach())


def layer_ranges(theta: torch.Tensor, spec) -> torch.Tensor:
    """R = max|w| of every layer of the flat θ, [L]."""
    return torch.stack([theta[s].abs().max() for s in _check_flat(theta, spec)])


# --- wire format -----------------------------------------------------------------------------------------
def encode(w: torch.Tensor, bits: int, R=None) -> bytes:
    """float32 R ‖ the nearest-rounding levels of w at b bits each (big-endian bit order, zero-padded byte)."""
    ell, R = quantize_levels(w.reshape(-1), bits, R)
    return np.float32(R).tobytes() + pack_uint(ell.to(torch.int64).cpu().numpy(), check_bits(bits))


def decode(blob: bytes, n: int, bits: int) -> torch.Tensor:
    """The n grid values `encode` wrote."""
    R = float(np.frombuffer(blob[:4], dtype=np.float32)[0])
    ell = torch.from_numpy(unpack_uint(blob[4:], n, check_bits(bits)).astype(np.int64))
    return dequantize(ell, bits, torch.tensor(R, dtype=torch.float32))


def payload_bytes(n: int, bits: int) -> int:
    """Bytes `encode` writes for n entries (4 for R + ⌈n·b/8⌉); 4n at full precision."""
    bits = check_bits(bits)
    return 4 * n if bits == FULL_PRECISION else 4 + math.ceil(n * bits / 8)


def model_bytes(spec, bits: int) -> int:
    """Bytes of a whole model at b bits with one R per weight tensor, biases as float32 (a b-bit device's upload)."""
    return sum(payload_bytes(math.prod(shape), FULL_PRECISION if is_bias(name) else bits) for name, shape in spec)
