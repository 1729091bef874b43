"""Ferret — shared-randomness projection of full-parameter updates (Shu, Hu, Ng, Low, Yu, "Ferret: Federated
Full-Parameter Tuning at Scale for Large Language Models", arXiv:2409.06277, 2024; ICML 2025;
code: https://github.com/allen4747/Ferret).

Every client trains all parameters with ordinary first-order local SGD, then projects its update Δ onto K
random directions that client and server generate from the same seeds, and uploads only the K coefficients.
The server regenerates exactly the same directions from the seeds, reconstructs and averages:

    per block b (d_b parameters, K_b of the K directions, V_b = [v_1 … v_{K_b}] ~ N(0, I_{d_b}) from the seed):
    "unbiased" (the official code's estimator):  γ = V_b Δ_b / K_b,   Δ̂_b = V_bᵀ γ = (1/K_b) Σ_k v_k v_kᵀ Δ_b
                                                 (E[v vᵀ] = I, so E[Δ̂_b] = Δ_b)
    "lstsq" (the exact projection):              γ = (V_b V_bᵀ)⁺ V_b Δ_b, Δ̂_b = V_bᵀ γ = P_{span V_b} Δ_b
                                                 (Δ̂_b = Δ_b when the K_b directions span ℝ^{d_b})
    server: Δ̄ = Σ_i p_i Δ̂_i = V_bᵀ (Σ_i p_i γ_i)   (linear: the server averages K numbers, then reconstructs once)

Details taken from the official code (optimizers/ferret_optimizer.py, commit 06cce91): parameters are grouped into
blocks by concatenating tensors in order until a block would exceed 0.9 × the median tensor size
(`ferret_blocks`); each block's directions are regenerated from the seed with a block-sized draw; the coefficient
is the inner product scaled by d_b / K_b on directions with entries of variance ≈ 1 / (3 d_b) (a truncated normal
in ±1/√d_b), so its reconstruction has mean ≈ Δ_b / 3 (the code's server step, annealed from 10, rescales it): the
same linear, seed-reproducible estimator as above up to that constant and the shape of the entries' distribution. Here, as documented deviations: directions
are N(0, I) (so the estimator is unbiased without a server-lr correction); the K coefficients are split over the
blocks in proportion to the block sizes (the code draws K_b ∝ ‖Δ_b‖ seeds per block and uploads a dense K × L
pool, zeros included); seeds are keyed by (shared key, stream 31, round) — fresh directions every round — while
the code reuses one set of K candidate seeds for the whole run (`fixed_seeds=True` does that); the server's
per-seed norm clip (10) and its momentum on the seed pool are left out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...core.messages import Transform
from ...core.registry import register
from ...core.streams import register_stream
from ...utils import check_positive_int, rng
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean

FERRET = register_stream("ferret", 31)   # the shared seeds of Ferret's random directions
ESTIMATORS = ("unbiased", "lstsq")


# ----------------------------------------------------------------------------------------------------
# Blocks, shared directions, projection and reconstruction (pure functions)


def ferret_blocks(model: torch.nn.Module) -> tuple[int, ...]:
    """Block sizes as the official code groups parameters: tensors in order, a new block whenever adding the
    next tensor would exceed 0.9 × the median tensor size (a tensor larger than that is a block of its own)."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if not sizes:
        raise ValueError("model has no trainable parameters to group into Ferret blocks")
    target, blocks, current = int(0.9 * np.median(sizes)), [], 0
    for n in sizes:
        if current and current + n > target:
            blocks.append(current)
            current = 0
        current += n
    return tuple(blocks + [current])


def allocate(K: int, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """K directions split over the blocks ∝ their sizes (largest remainder), at least one per block."""
    blocks = tuple(int(b) for b in blocks)
    if K < len(blocks):
        raise ValueError(f"K = {K} is smaller than the number of blocks ({len(blocks)}); use K >= {len(blocks)} "
                         f"or fewer blocks")
    d = sum(blocks)
    extra = K - len(blocks)                                  # one each first, the rest ∝ size
    share = np.array(blocks, dtype=float) / d * extra
    counts = np.floor(share).astype(int)
    counts[np.argsort(-(share - counts), kind="stable")[: extra - counts.sum()]] += 1
    return tuple(int(c) + 1 for c in counts)


def round_seed(key: int, round: int) -> int:
    """The seed both sides derive for a round's directions: rng(key, FERRET stream, round)."""
    return int(rng(int(key), FERRET, int(round)).integers(2**62))


def directions(seed: int, blocks: tuple[int, ...], ks: tuple[int, ...], dtype=torch.float64, device="cpu") -> list[Tensor]:
    """Each block's V_b [K_b, d_b] with N(0, 1) entries, drawn on the CPU from a generator seeded by `seed` (block
    b from seed + b), so every process and device regenerates the same numbers; then cast and moved."""
    out = []
    for b, (d_b, k_b) in enumerate(zip(blocks, ks)):
        g = torch.Generator(device="cpu").manual_seed(int(seed) + b)
        out.append(torch.randn(k_b, d_b, generator=g, dtype=torch.float32).to(device=device, dtype=dtype))
    return out


def _split(x: Tensor, sizes) -> list[Tensor]:
    return list(torch.split(x, list(sizes), dim=-1))


def project(deltas: Tensor, V: list[Tensor], estimator: str = "unbiased") -> Tensor:
    """Coefficients [m, K] of the updates `deltas` [m, d] on the blocks' directions (`estimator` as above)."""
    blocks = [v.shape[1] for v in V]
    if deltas.dim() != 2 or deltas.shape[1] != sum(blocks):
        raise ValueError(f"deltas must be [m, d] with d = {sum(blocks)} (the blocks' total), got {tuple(deltas.shape)}")
    coefs = []
    for D, v in zip(_split(deltas, blocks), V):
        if estimator == "unbiased":
            coefs.append(D @ v.T / v.shape[0])
        else:  # minimum-norm least squares: Vᵀγ = P_V Δ (pinv handles K_b ≥ d_b)
            coefs.append(D @ torch.linalg.pinv(v))
    return torch.cat(coefs, dim=1)


def reconstruct(coefs: Tensor, V: list[Tensor]) -> Tensor:
    """Δ̂ [..., d] from coefficients [..., K]: per block V_bᵀ γ_b (both estimators reconstruct the same way)."""
    return torch.cat([c @ v for c, v in zip(_split(coefs, [v.shape[0] for v in V]), V)], dim=-1)


# ----------------------------------------------------------------------------------------------------
# The pipeline parts: the client's projection (uplink) and the server's reconstruction (rule)


@dataclass
class FerretSpec:
    """What client and server agree on before training: K, the blocks, the estimator and the seed key."""
    K: int
    blocks: tuple | None = None     # block sizes (sum = d); None: one block of all parameters
    estimator: str = "unbiased"
    key: int = 0                    # shared key of the seeds (the run's seed in the notebook)
    fixed_seeds: bool = False       # True: the same directions every round (the official code's candidate seeds)

    def __post_init__(self):
        self.K = check_positive_int("K", self.K)
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.blocks is not None:
            self.blocks = tuple(check_positive_int("blocks entry", b) for b in self.blocks)
            allocate(self.K, self.blocks)  # K ≥ number of blocks, checked now

    def layout(self, d: int) -> tuple[tuple, tuple]:
        blocks = self.blocks or (int(d),)
        if sum(blocks) != d:
            raise ValueError(f"Ferret blocks sum to {sum(blocks)} but the model has d = {d} parameters; pass "
                             f"blocks=ferret_blocks(model) for the model you train")
        return blocks, allocate(self.K, blocks)

    def directions(self, round: int, d: int, dtype, device) -> list[Tensor]:
        blocks, ks = self.layout(d)
        return directions(round_seed(self.key, 0 if self.fixed_seeds else round), blocks, ks, dtype, device)


class FerretProject(Transform):
    """Client side: replace the update `delta` [m, d] by its K coefficients `coef` [m, K] — the whole message, so
    the engine measures K × element size bytes per client (`Messages.wire_bytes`, dense encoding)."""

    def __init__(self, spec: FerretSpec):
        self.spec = spec

    def __call__(self, msgs, cstate, ctx):
        if "delta" not in msgs:
            raise ValueError("FerretProject needs the clients' full-parameter updates in the message entry 'delta'")
        deltas = msgs.tensors.pop("delta")
        V = self.spec.directions(ctx.round, deltas.shape[1], deltas.dtype, deltas.device)
        msgs.tensors["coef"] = project(deltas, V, self.spec.estimator)
        return msgs, cstate


class FerretReconstruct:
    """Server side: regenerate the round's directions from the shared seed, average the coefficients with the
    weights and reconstruct the full-parameter aggregate Σ p_i Δ̂_i = Vᵀ Σ p_i γ_i."""
    uses_context = True

    def __init__(self, spec: FerretSpec):
        self.spec = spec

    def init_state(self, theta: Tensor, num_clients: int) -> dict:
        self.spec.layout(theta.numel())  # a block layout that does not fit the model fails before round 1
        return {}

    def aggregate(self, state: dict, coefs: Tensor, weights: Tensor, info=None):
        V = self.spec.directions(info.round, info.theta.numel(), info.theta.dtype, info.theta.device)
        return reconstruct(weighted_mean(coefs, weights.to(coefs.dtype)), V), state


@register("ferret", claims="ferret")
def ferret(K: int = 64, blocks=None, estimator: str = "unbiased", key: int = 0, fixed_seeds: bool = False,
           server_lr: float = 1.0) -> Method:
    """Ferret: local first-order SGD on all parameters, K shared-seed coefficients up, server reconstruction.
    `blocks`: block sizes (e.g. `ferret_blocks(model)`), None = one block; `key`: the seeds' shared key."""
    spec = FerretSpec(K, blocks, estimator, key, fixed_seeds)
    return Method("ferret", LocalObjective(), DataSizeWeighting(), FerretReconstruct(spec), ServerSGD(lr=server_lr),
                  uplink=(FerretProject(spec),), aggregate_key="coef")
