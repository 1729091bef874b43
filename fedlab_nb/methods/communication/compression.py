"""Uplink compression for any method: sparsification, quantisation, sign and low-rank codecs, with error
feedback kept in the client store, and bytes measured from the encoded payload.

Papers:
- top-k / random-k with memory — Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018:
  send comp_k(m + Δ), keep m ← m + Δ − comp_k(m + Δ).
- QSGD — Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding", NeurIPS 2017: Q_s(v)_i = ‖v‖₂ · sgn(v_i) · ξ_i(v, s), ξ_i = l/s or (l+1)/s
  with l = ⌊s|v_i|/‖v‖₂⌋ and P[(l+1)/s] = s|v_i|/‖v‖₂ − l, so E[Q_s(v)] = v (per bucket of `bucket_size`).
- signSGD with majority vote — Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed
  Optimisation for Non-Convex Problems", ICML 2018, and "signSGD with Majority Vote is Communication
  Efficient and Fault Tolerant", ICLR 2019: workers send sign(g), the server steps along sign(Σ_k sign(g_k)).
- EF-signSGD — Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
  Compression Schemes", ICML 2019 (Algorithm 2): p = Δ + e, send (‖p‖₁/d)·sign(p), e ← p − (‖p‖₁/d)·sign(p).
- PowerSGD — Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019 (Algorithm 1): per weight matrix M (+ error), P = M Q,
  P̂ = orthogonalise(P), Q ← Mᵀ P̂, send (P̂, Q), decode P̂ Qᵀ, warm-start the next round from this Q;
  vectors (biases) are sent uncompressed.

Federated reading: a client's "gradient" is its update Δ_k = w_k − θ after local training (any method's
`delta` entry); the server-side tensor is exactly what `decode(encode(Δ_k))` returns, and `msgs.bytes` is
len(payload) plus the dense size of any other message entry. Wire formats (little-endian, no framing; the
receiver knows d, k, s and the shapes from the protocol):

    top-k / rand-k  k indices (uint16 if d ≤ 65,536 else uint32, ascending) ‖ k float32 values
    QSGD            per bucket a float32 norm ‖ all levels at a FIXED width of ⌈log₂(s+1)⌉ bits ‖ one sign
                    bit per entry (numpy packbits). Not the paper's Elias coding: simpler, and for small s
                    within a small factor of it; the count is exact for this format.
    sign            one bit per entry (packbits, 1 = non-negative) [‖ float32 scale ‖x‖₁/d when scaled]
    PowerSGD        per matrix P̂ [n, r] ‖ Q [m, r] float32; per vector its float32 entries

Deliberate differences: PowerSGD's P̂, Q are all-reduced across workers in the paper; with partial
participation each client here runs its own power step warm-started from its own stored Q (the compressor
per client, as the error-feedback papers analyse it). Random-k sends its indices rather than a shared seed.
Downlink (server → client): `DownlinkCompress(codec)` on `Method(downlink=...)` (`with_downlink(method, codec)`):
the server keeps the clients' copy θ̂ and sends C(θ − θ̂); what a round does not send stays in θ − θ̂ and goes
out later (the copy is the error-feedback memory). Clients are assumed to hold θ₀ (its download is not counted).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...core.messages import DownlinkTransform, Transform, dense_bytes
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register


# --- helpers ------------------------------------------------------------------------------------------
def _index_dtype(d: int):
    return np.uint16 if d <= 2 ** 16 else np.uint32


def _f32(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().cpu().to(torch.float32).numpy())


def _count(k, d: int, name: str = "k") -> int:
    """k as a count: an int ≥ 1 (at most d), or a float in (0, 1] = that fraction of the d entries."""
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)) or not k > 0:
        raise ValueError(f"{name} must be an int ≥ 1 or a fraction in (0, 1], got {k!r}; e.g. {name}=0.01")
    if isinstance(k, (float, np.floating)) and k <= 1:
        return max(1, int(round(k * d)))
    if int(k) != k:
        raise ValueError(f"{name} must be an int ≥ 1 or a fraction in (0, 1], got {k!r}")
    return min(int(k), d)


def pack_uint(values: np.ndarray, bits: int) -> bytes:
    """Non-negative ints < 2^bits packed at a fixed width of `bits` bits each (big-endian bit order)."""
    v = values.astype(np.uint32)[:, None] >> np.arange(bits - 1, -1, -1, dtype=np.uint32)
    return np.packbits((v & 1).astype(np.uint8).reshape(-1)).tobytes()


def unpack_uint(blob: bytes, n: int, bits: int) -> np.ndarray:
    raw = np.unpackbits(np.frombuffer(blob, dtype=np.uint8))[: n * bits].reshape(n, bits).astype(np.uint32)
    return (raw << np.arange(bits - 1, -1, -1, dtype=np.uint32)).sum(1)


# --- codecs: encode(x [d]) -> bytes, decode(bytes, d) -> tensor [d] ------------------------------------
@dataclass
class TopK:
    """The k entries of largest |x| (k an int, or a fraction of d), as indices ‖ float32 values."""
    k: float = 0.01

    def __post_init__(self):
        _count(self.k, 10 ** 9)

    def select(self, x: torch.Tensor, generator=None) -> torch.Tensor:
        return torch.topk(x.abs(), _count(self.k, x.numel())).indices

    def encode(self, x: torch.Tensor, generator=None) -> bytes:
        idx = torch.sort(self.select(x, generator)).values
        return (idx.cpu().numpy().astype(_index_dtype(x.numel())).tobytes() + _f32(x[idx]).tobytes())

    def decode(self, blob: bytes, d: int) -> torch.Tensor:
        k, it = _count(self.k, d), _index_dtype(d)
        cut = k * np.dtype(it).itemsize
        idx = torch.from_numpy(np.frombuffer(blob[:cut], dtype=it).astype(np.int64))
        out = torch.zeros(d)
        out[idx] = torch.from_numpy(np.frombuffer(blob[cut:], dtype=np.float32).copy())
        return out

    def payload_bytes(self, d: int) -> int:
        """The expected layout's length: k indices + k float32 values."""
        k = _count(self.k, d)
        return k * np.dtype(_index_dtype(d)).itemsize + 4 * k


@dataclass
class RandK(TopK):
    """k entries chosen uniformly without replacement (the transform's keyed generator), same format."""

    def select(self, x: torch.Tensor, generator=None) -> torch.Tensor:
        if generator is None:
            raise ValueError("RandK.encode needs a torch.Generator (the transform passes ctx.generator)")
        return torch.randperm(x.numel(), generator=generator)[: _count(self.k, x.numel())]


@dataclass
class QSGD:
    """QSGD with s levels and stochastic rounding, per bucket of `bucket_size` entries (None: one bucket)."""
    s: int = 4
    bucket_size: int | None = None

    def __post_init__(self):
        if isinstance(self.s, bool) or not isinstance(self.s, (int, np.integer)) or self.s < 1:
            raise ValueError(f"s (quantisation levels) must be an int ≥ 1, got {self.s!r}; e.g. QSGD(s=4)")
        if self.bucket_size is not None and (not isinstance(self.bucket_size, (int, np.integer)) or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be an int ≥ 1 or None, got {self.bucket_size!r}")
        self.bits = max(1, math.ceil(math.log2(self.s + 1)))

    def _buckets(self, d: int) -> int:
        return 1 if self.bucket_size is None else math.ceil(d / self.bucket_size)

    def quantise(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-bucket norms [B], integer levels l_i ∈ {0..s} [d]) with P[l_i = ⌊r⌋ + 1] = r − ⌊r⌋, r = s|x_i|/‖x_b‖."""
        d, b = x.numel(), self.bucket_size or x.numel()
        xb = torch.nn.functional.pad(x.float(), (0, self._buckets(d) * b - d)).view(-1, b)
        norms = xb.norm(dim=1)
        r = (self.s * xb.abs() / norms.clamp_min(1e-30)[:, None]).clamp(max=self.s)
        low = r.floor()
        up = torch.rand(r.shape, generator=generator) < (r - low)
        return norms, (low + up).reshape(-1)[:d].to(torch.int64)

    def encode(self, x: torch.Tensor, generator=None) -> bytes:
        if generator is None:
            raise ValueError("QSGD.encode needs a torch.Generator for its stochastic rounding (ctx.generator)")
        norms, levels = self.quantise(x.detach().cpu(), generator)
        signs = np.packbits((x.detach().cpu().numpy() >= 0).astype(np.uint8)).tobytes()
        return _f32(norms).tobytes() + pack_uint(levels.numpy(), self.bits) + signs

    def decode(self, blob: bytes, d: int) -> torch.Tensor:
        B = self._buckets(d)
        norms = torch.from_numpy(np.frombuffer(blob[: 4 * B], dtype=np.float32).copy())
        n_lev = math.ceil(d * self.bits / 8)
        levels = torch.from_numpy(unpack_uint(blob[4 * B: 4 * B + n_lev], d, self.bits).astype(np.float32))
        signs = np.unpackbits(np.frombuffer(blob[4 * B + n_lev:], dtype=np.uint8))[:d]
        sgn = torch.from_numpy(signs.astype(np.float32) * 2 - 1)
        per_entry = norms.repeat_interleave(self.bucket_size or d)[:d]
        return per_entry * sgn * levels / self.s

    def payload_bytes(self, d: int) -> int:
        return 4 * self._buckets(d) + math.ceil(d * self.bits / 8) + math.ceil(d / 8)


@dataclass
class Sign:
    """sign(x) at one bit per entry (0 counts as +); `scaled=True` also sends ‖x‖₁/d (EF-signSGD's C(p))."""
    scaled: bool = False

    def encode(self, x: torch.Tensor, generator=None) -> bytes:
        bits = np.packbits((x.detach().cpu().numpy() >= 0).astype(np.uint8)).tobytes()
        return bits + (_f32(x.abs().mean().reshape(1)).tobytes() if self.scaled else b"")

    def decode(self, blob: bytes, d: int) -> torch.Tensor:
        nb = math.ceil(d / 8)
        sgn = torch.from_numpy(np.unpackbits(np.frombuffer(blob[:nb], dtype=np.uint8))[:d].astype(np.float32) * 2 - 1)
        if self.scaled:
            sgn = sgn * float(np.frombuffer(blob[nb: nb + 4], dtype=np.float32)[0])
        return sgn

    def payload_bytes(self, d: int) -> int:
        return math.ceil(d / 8) + (4 if self.scaled else 0)


# --- PowerSGD: rank-r power iteration per weight matrix ------------------------------------------------
def matrix_shapes(shapes, d: int) -> list[tuple]:
    """Each parameter tensor as a matrix (first dim × the rest) or a vector; None: the flat d as one
    near-square zero-padded matrix. The shapes must cover exactly d entries, in `model.parameters()` order."""
    if shapes is None:
        n = max(1, math.isqrt(d))
        return [(n, math.ceil(d / n))]
    out = [(int(s[0]), int(math.prod(s[1:]))) if len(s) >= 2 else (int(math.prod(s)),) for s in shapes]
    if sum(math.prod(s) for s in out) != d:
        raise ValueError(f"shapes cover {sum(math.prod(s) for s in out)} entries but the update has {d}; pass "
                         "shapes=param_shapes(model) for the model the run trains")
    return out


def param_shapes(model: torch.nn.Module) -> list[tuple]:
    """The shapes PowerSGD reshapes the flat update into (the engine flattens `model.parameters()` in order)."""
    return [tuple(p.shape) for p in model.parameters()]


def orthogonalise(P: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning P's (Gram–Schmidt, as in the paper; QR here for stability)."""
    return torch.linalg.qr(P, mode="reduced").Q


@dataclass
class PowerSGD:
    """Rank-r PowerSGD codec for one flat update of d entries split into `shapes` (see `matrix_shapes`)."""
    rank: int = 2
    shapes: tuple | None = None

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise ValueError(f"rank must be an int ≥ 1, got {self.rank!r}; e.g. PowerSGD(rank=2)")

    def layout(self, d: int) -> list[tuple]:
        mats = matrix_shapes(self.shapes, d)
        for s in mats:
            if len(s) == 2 and self.rank > min(s):
                raise ValueError(f"rank {self.rank} is larger than a {s[0]}×{s[1]} matrix allows (≤ {min(s)}); "
                                 "lower rank")
        return mats

    def q_size(self, d: int) -> int:
        return sum(s[1] * self.rank for s in self.layout(d) if len(s) == 2)

    def _split(self, x: torch.Tensor, d: int):
        mats, at = self.layout(d), 0
        flat = torch.nn.functional.pad(x.float(), (0, sum(math.prod(s) for s in mats) - d))  # None-shapes padding
        for s in mats:
            yield s, flat[at: at + math.prod(s)].view(*s)
            at += math.prod(s)

    def encode(self, x: torch.Tensor, q: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """(payload, the new Q rows to warm-start from) for update x [d] and previous Q (flat, `q_size`)."""
        d, parts, new_q, at = x.numel(), [], [], 0
        for s, M in self._split(x.detach().cpu(), d):
            if len(s) == 1:
                parts.append(_f32(M).tobytes())
                continue
            Q = q[at: at + s[1] * self.rank].view(s[1], self.rank).float()
            at += s[1] * self.rank
            P = orthogonalise(M @ Q)
            Q = M.T @ P
            parts += [_f32(P).tobytes(), _f32(Q).tobytes()]
            new_q.append(Q.reshape(-1))
        return b"".join(parts), (torch.cat(new_q) if new_q else q.new_zeros(0))

    def decode(self, blob: bytes, d: int) -> torch.Tensor:
        out, at, r = [], 0, self.rank
        for s in self.layout(d):
            if len(s) == 1:
                out.append(torch.from_numpy(np.frombuffer(blob[at: at + 4 * s[0]], dtype=np.float32).copy()))
                at += 4 * s[0]
                continue
            n, m = s
            P = torch.from_numpy(np.frombuffer(blob[at: at + 4 * n * r], dtype=np.float32).copy()).view(n, r)
            at += 4 * n * r
            Q = torch.from_numpy(np.frombuffer(blob[at: at + 4 * m * r], dtype=np.float32).copy()).view(m, r)
            at += 4 * m * r
            out.append((P @ Q.T).reshape(-1))
        return torch.cat(out)[:d]

    def payload_bytes(self, d: int) -> int:
        return sum(4 * s[0] if len(s) == 1 else 4 * self.rank * (s[0] + s[1]) for s in self.layout(d))


# --- the uplink transforms -----------------------------------------------------------------------------
def _other_bytes(msgs, key: str, i: int) -> int:
    return dense_bytes({n: t[i] for n, t in msgs.tensors.items() if n != key})


@dataclass
class Compress(Transform):
    """Uplink transform: each client's `key` row → decode(encode(row [+ residual])), bytes = len(payload)
    (+ the dense size of the other entries). `error_feedback=True` keeps the residual e_k in the store:
    p = Δ_k + e_k is compressed, e_k ← p − decode(encode(p))."""
    codec: object = None
    error_feedback: bool = True
    key: str = "delta"

    def __post_init__(self):
        if self.codec is None or not hasattr(self.codec, "encode"):
            raise ValueError("Compress needs a codec, e.g. Compress(TopK(0.01)), Compress(QSGD(4)), Compress(Sign())")

    def client_state(self, theta: torch.Tensor) -> dict:
        return {"residual": torch.zeros_like(theta)} if self.error_feedback else {}

    def __call__(self, msgs, cstate, ctx):
        x = msgs[self.key]
        p = x + cstate["residual"].to(x) if self.error_feedback else x
        rows, sizes = [], []
        for i in range(len(p)):
            blob = self.codec.encode(p[i], ctx.generator)
            rows.append(self.codec.decode(blob, p.shape[1]))
            sizes.append(len(blob) + _other_bytes(msgs, self.key, i))
        sent = torch.stack(rows).to(x) if rows else x.clone()
        msgs.tensors[self.key] = sent
        msgs.bytes = torch.tensor(sizes, dtype=torch.int64)
        return msgs, ({"residual": p - sent} if self.error_feedback else cstate)


@dataclass
class PowerSGDCompress(Transform):
    """Uplink PowerSGD: each client compresses Δ_k + e_k with one power step from its stored Q (drawn from
    N(0, 1) with the transform's generator on first use), keeps e_k and Q in the store."""
    rank: int = 2
    shapes: tuple | None = None
    error_feedback: bool = True
    key: str = "delta"

    def __post_init__(self):
        self.codec = PowerSGD(self.rank, None if self.shapes is None else tuple(map(tuple, self.shapes)))

    def client_state(self, theta: torch.Tensor) -> dict:
        state = {"q": torch.zeros(self.codec.q_size(theta.numel()))}
        return {**state, "residual": torch.zeros_like(theta)} if self.error_feedback else state

    def __call__(self, msgs, cstate, ctx):
        x = msgs[self.key]
        p = x + cstate["residual"].to(x) if self.error_feedback else x
        rows, sizes, qs = [], [], []
        for i in range(len(p)):
            q = cstate["q"][i].cpu()
            if not q.any():  # first participation: a fresh Gaussian Q, from the keyed stream
                q = torch.randn(q.shape, generator=ctx.generator)
            blob, q = self.codec.encode(p[i], q)
            rows.append(self.codec.decode(blob, p.shape[1]))
            sizes.append(len(blob) + _other_bytes(msgs, self.key, i))
            qs.append(q)
        sent = torch.stack(rows).to(x)
        msgs.tensors[self.key] = sent
        msgs.bytes = torch.tensor(sizes, dtype=torch.int64)
        new = {"q": torch.stack(qs).to(cstate["q"])}
        return msgs, ({**new, "residual": p - sent} if self.error_feedback else new)


# --- signSGD with majority vote: the server rule --------------------------------------------------------
# --- the downlink ---------------------------------------------------------------------------------------
@dataclass
class DownlinkCompress(DownlinkTransform):
    """Server → clients: send decode(encode(θ − θ̂)) and add it to the clients' copy θ̂ (server state). With
    `error_feedback=False` only this round's server step θ_t − θ_{t−1} is compressed and what it drops is lost."""
    codec: object = None
    error_feedback: bool = True

    def __post_init__(self):
        if self.codec is None or not hasattr(self.codec, "encode") or isinstance(self.codec, PowerSGD):
            raise ValueError("DownlinkCompress needs a codec with encode(x, generator) / decode(blob, d): "
                             "TopK, RandK, QSGD or Sign (PowerSGD's warm start is per client)")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"view": theta.clone(), "previous": theta.clone()}

    def __call__(self, theta: torch.Tensor, state: dict, generator: torch.Generator):
        p = theta - (state["view"] if self.error_feedback else state["previous"])
        blob = self.codec.encode(p, generator)
        view = state["view"] + self.codec.decode(blob, p.numel()).to(theta)
        return view, {"view": view, "previous": theta.clone()}, len(blob)


def with_downlink(method: Method, codec, error_feedback: bool = True) -> Method:
    """`method` whose broadcast model is compressed too (bidirectional compression)."""
    from dataclasses import replace
    return replace(method, name=f"{method.name}+down", downlink=(*method.downlink, DownlinkCompress(codec, error_feedback)))


def majority_vote(updates: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """sign(Σ_k sign(Δ_k)): one vote per client whatever its weight (Bernstein et al.); ties give 0."""
    return torch.sign(torch.sign(updates).sum(0))


# --- ready methods (FedAvg's client update + a compressor) ----------------------------------------------
def compressed(method: Method, transform: Transform, name: str | None = None) -> Method:
    """Any method with `transform` appended to its uplink."""
    from dataclasses import replace
    return replace(method, name=name or f"{method.name}+{type(transform).__name__.lower()}",
                   uplink=(*method.uplink, transform))


def _fedavg(name: str, transform: Transform, server_lr: float = 1.0) -> Method:
    return Method(name, LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  uplink=(transform,))


@register("topk_fedavg", claims="compression")
def topk_fedavg(k: float = 0.01, error_feedback: bool = True, server_lr: float = 1.0) -> Method:
    """FedAvg sending the top-k entries of Δ_k (+ memory) — Stich et al. 2018."""
    return _fedavg("topk_fedavg" + ("" if error_feedback else "_noef"), Compress(TopK(k), error_feedback), server_lr)


@register("randk_fedavg", claims="compression")
def randk_fedavg(k: float = 0.01, error_feedback: bool = True, server_lr: float = 1.0) -> Method:
    """FedAvg sending k random entries of Δ_k (+ memory) — Stich et al. 2018."""
    return _fedavg("randk_fedavg" + ("" if error_feedback else "_noef"), Compress(RandK(k), error_feedback), server_lr)


@register("qsgd_fedavg", claims="compression")
def qsgd_fedavg(s: int = 4, bucket_size: int | None = 512, server_lr: float = 1.0) -> Method:
    """FedAvg with QSGD-quantised updates (unbiased, so no error feedback) — Alistarh et al. 2017."""
    return _fedavg("qsgd_fedavg", Compress(QSGD(s, bucket_size), error_feedback=False), server_lr)


@register("signsgd_mv", claims="compression")
def signsgd_mv(server_lr: float = 0.01) -> Method:
    """signSGD with majority vote: clients send sign(Δ_k) (1 bit an entry), θ ← θ + η sign(Σ_k sign(Δ_k))."""
    return Method("signsgd_mv", LocalObjective(), UniformWeighting(), majority_vote, ServerSGD(lr=server_lr),
                  uplink=(Compress(Sign(scaled=False), error_feedback=False),))


@register("ef_signsgd", claims="compression")
def ef_signsgd(error_feedback: bool = True, server_lr: float = 1.0) -> Method:
    """EF-signSGD: clients send (‖p‖₁/d)·sign(p), p = Δ_k + e_k, keep e_k; the server averages (Karimireddy et al.)."""
    name = "ef_signsgd" if error_feedback else "scaled_signsgd"
    return _fedavg(name, Compress(Sign(scaled=True), error_feedback), server_lr)


@register("powersgd_fedavg", claims="compression")
def powersgd_fedavg(rank: int = 2, shapes=None, error_feedback: bool = True, server_lr: float = 1.0) -> Method:
    """FedAvg with rank-r PowerSGD updates (warm-started Q and error feedback per client) — Vogels et al. 2019.
    Pass `shapes=param_shapes(model)` to compress each weight matrix (default: the flat update as one matrix)."""
    return _fedavg("powersgd_fedavg", PowerSGDCompress(rank, shapes, error_feedback), server_lr)


# --- the communication chapter: accuracy against measured bytes -----------------------------------------
@register("communication", claims="communication", kind="module")
def accuracy_at_budget(hist, budget: float, column: str = "test_acc") -> float:
    """`column` after the last round whose cumulative measured `bytes_up` is ≤ `budget` bytes (NaN if even the
    first round's upload exceeds it) — one point of an accuracy-vs-bytes comparison at equal communication."""
    if not budget > 0:
        raise ValueError(f"budget must be a number of bytes > 0, got {budget!r}")
    within = np.asarray(hist["bytes_up"].cumsum() <= budget)
    return float(np.asarray(hist[column])[within.nonzero()[0][-1]]) if within.any() else float("nan")


def pareto_front(total_bytes, accuracy) -> np.ndarray:
    """Bool mask of the points no other point beats on both axes (fewer or equal bytes and higher or equal
    accuracy, one of them strictly)."""
    b, a = np.asarray(total_bytes, float), np.asarray(accuracy, float)
    dominated = ((b[None, :] <= b[:, None]) & (a[None, :] >= a[:, None]) & ((b[None, :] < b[:, None]) | (a[None, :] > a[:, None])))
    return ~dominated.any(1)
