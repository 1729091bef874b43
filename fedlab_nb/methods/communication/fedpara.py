"""FedPara and pFedPara — Hyeon-Woo, Ye-Bin, Oh, "FedPara: Low-Rank Hadamard Product for Communication-Efficient
Federated Learning", ICLR 2022, https://arxiv.org/abs/2108.06098; code: https://github.com/South-hw/FedPara_ICLR22
(a notebook with the convolutional layer only).

FedPara re-parameterises a layer's weight W ∈ ℝ^{m×n} (m = out, n = in) as a Hadamard product of two
low-rank matrices,

    W = (X₁ Y₁ᵀ) ⊙ (X₂ Y₂ᵀ),      X_i ∈ ℝ^{m×r},  Y_i ∈ ℝ^{n×r},      2r(m + n) parameters instead of m n,

and rank(A ⊙ B) ≤ rank(A)·rank(B) gives rank(W) ≤ r², against ≤ 2r for a plain low-rank X Yᵀ with the same
parameter count (X ∈ ℝ^{m×2r}). The paper's Corollary: with r₁ = r₂ = r, r² ≥ min(m, n) is necessary and
sufficient for W to reach the maximal rank min(m, n), so r_min = ⌈√min(m, n)⌉. Training is FedAvg on the
factors: clients send X_i, Y_i (and the biases), the server averages them — the engine measures the bytes.

pFedPara (personalised): W = W₁ ⊙ (W₂ + 1) with W₁ = X₁Y₁ᵀ global (sent and averaged) and W₂ = X₂Y₂ᵀ local (kept
in the client store, never sent); W₂ → 0 gives back the global W₁.

Details: the official code picks r = max(⌈√out⌉, ⌈√in⌉, r_budget) with r_budget the smallest rank reaching a
fraction `ratio` of the original parameter count, and initialises every factor N(0, gain²/fan_in) ("initialization
affects the convergence stability"); here, for the fully-connected layer, `rank_for_ratio` uses the paper's
r_min = ⌈√min(m, n)⌉ and the factors are scaled so that W has He variance 2/n (Var(X Yᵀ) = r σ⁴ for i.i.d.
N(0, σ²) entries). pFedPara: W₁ gets the He variance and the local W₂ entry variance `local_var` = 0.3 (not given
in the paper; chosen on one smoke run from {1 (diverged at lr 0.1), 0.3, 0.1, 0.03}: smaller values leave W₂ inert).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...core.groups import ParamGroups
from ...core.registry import register
from ..basics.fedavg import fedavg

KINDS = ("fedpara", "pfedpara", "lowrank", "dense")
LOCAL_FACTORS = ("*.x2", "*.y2")   # pFedPara's local W₂ = X₂Y₂ᵀ in every FedPara layer


# ----------------------------------------------------------------------------------------------------
# Ranks and parameter counts (m = out_features, n = in_features)


def check_rank(rank, m: int, n: int, name: str = "rank") -> int:
    """An inner rank is an int with 1 ≤ r ≤ min(m, n) (a factor wider than the layer adds parameters, no rank)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(m, n):
        raise ValueError(f"{name} must be an int in 1 … min(out, in) = {min(m, n)} for a {m}×{n} weight, got "
                         f"{rank!r}; pick a rank with rank_for_ratio(m, n, ratio)")
    return rank


def min_full_rank(m: int, n: int) -> int:
    """r_min = ⌈√min(m, n)⌉: the smallest r with r² ≥ min(m, n), i.e. the smallest inner rank at which FedPara
    can reach the maximal rank (the paper's Corollary 1)."""
    return math.isqrt(min(m, n) - 1) + 1


def fedpara_params(m: int, n: int, rank: int, bias: bool = True) -> int:
    """Parameters of a FedPara layer: 2r(m + n) (+ m biases)."""
    return 2 * rank * (m + n) + (m if bias else 0)


def lowrank_params(m: int, n: int, rank: int, bias: bool = True) -> int:
    """Parameters of a plain low-rank layer W = X Yᵀ of rank r: r(m + n) (+ m biases)."""
    return rank * (m + n) + (m if bias else 0)


def rank_for_ratio(m: int, n: int, ratio: float = 0.0) -> int:
    """The FedPara inner rank for a target fraction `ratio` of the dense m·n weights: the smallest r with
    2r(m + n) ≥ ratio·m·n, but never below r_min (so W can be full rank). ratio = 0 gives r_min."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio is a fraction of the dense layer's m·n weights, in [0, 1]; got {ratio!r}")
    return max(min_full_rank(m, n), math.ceil(ratio * m * n / (2 * (m + n))))


def _factor_std(variance: float, rank: int) -> float:
    """σ such that X Yᵀ with i.i.d. N(0, σ²) entries of inner size `rank` has entry variance `variance`."""
    return (variance / rank) ** 0.25


# ----------------------------------------------------------------------------------------------------
# Layers


class FedParaLinear(nn.Module):
    """A linear layer with W = (X₁Y₁ᵀ) ⊙ (X₂Y₂ᵀ) (`personal=False`, FedPara) or W = (X₁Y₁ᵀ) ⊙ (X₂Y₂ᵀ + 1)
    (`personal=True`, pFedPara: X₁, Y₁ global, X₂, Y₂ local). Parameters x1, y1, x2, y2 [m, r] / [n, r], bias."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, personal: bool = False,
                 generator: torch.Generator | None = None, local_var: float = 0.3):
        super().__init__()
        m, n = out_features, in_features
        self.rank, self.personal = check_rank(rank, m, n), bool(personal)
        he = 2.0 / n   # the dense layer's He variance
        # FedPara: Var(W₁) = Var(W₂) = √(2/n), so Var(W) = 2/n; pFedPara: Var(W₁) = 2/n, Var(W₂) = `local_var`
        v1, v2 = (he, local_var) if personal else (math.sqrt(he), math.sqrt(he))
        for name, rows, v in (("x1", m, v1), ("y1", n, v1), ("x2", m, v2), ("y2", n, v2)):
            std = _factor_std(v, rank)
            self.register_parameter(name, nn.Parameter(torch.randn(rows, rank, generator=generator) * std))
        self.bias = nn.Parameter(torch.zeros(m)) if bias else None

    def weight(self) -> Tensor:
        w1, w2 = self.x1 @ self.y1.T, self.x2 @ self.y2.T
        return w1 * (w2 + 1) if self.personal else w1 * w2

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight(), self.bias)

    def extra_repr(self) -> str:
        m, n = self.x1.shape[0], self.y1.shape[0]
        return f"in={n}, out={m}, rank={self.rank}, personal={self.personal}"


class LowRankLinear(nn.Module):
    """The conventional low-rank baseline W = X Yᵀ, X [m, r], Y [n, r] (rank(W) ≤ r), He variance at start."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__()
        m, n = out_features, in_features
        self.rank = check_rank(rank, m, n)
        std = _factor_std(2.0 / n, rank)
        self.x = nn.Parameter(torch.randn(m, rank, generator=generator) * std)
        self.y = nn.Parameter(torch.randn(n, rank, generator=generator) * std)
        self.bias = nn.Parameter(torch.zeros(m)) if bias else None

    def weight(self) -> Tensor:
        return self.x @ self.y.T

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight(), self.bias)


# ----------------------------------------------------------------------------------------------------
# The project's MLP with re-parameterised hidden layers


class FactorMLP(nn.Module):
    """`fedlab_nb.models.MLP`'s layout (`body.0`, `body.2`, …, the last = head) with every hidden layer a FedPara /
    pFedPara / low-rank layer; the classifier head is dense unless `factor_head` (default: only for pFedPara,
    whose local factors then personalise the classifier too)."""

    def __init__(self, in_features: int, num_classes: int, hidden=(256, 256), kind: str = "fedpara",
                 ratio: float = 0.0, ranks=None, factor_head: bool | None = None, seed: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        factor_head = kind == "pfedpara" if factor_head is None else bool(factor_head)   # pFedPara: every layer
        sizes = [in_features, *hidden, num_classes]
        shapes = list(zip(sizes[:-1], sizes[1:]))   # (in n, out m) of each layer
        n_factor = len(shapes) if factor_head else len(shapes) - 1
        if ranks is None:   # FedPara's rank per layer; the low-rank baseline takes 2r: the same parameter count
            ranks = [rank_for_ratio(m, n, ratio) * (2 if kind == "lowrank" else 1) for n, m in shapes[:n_factor]]
        if len(ranks) != n_factor:
            raise ValueError(f"ranks needs one rank per re-parameterised layer ({n_factor}), got {list(ranks)}")
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)   # the dense layers' default init
            layers = [self._layer(kind, n, m, r, g) for (n, m), r in zip(shapes, ranks)]
            layers += [nn.Linear(n, m) for n, m in shapes[n_factor:]]
        self.kind, self.ranks = kind, [int(r) for r in ranks]
        self.body = nn.Sequential(*[x for layer in layers[:-1] for x in (layer, nn.ReLU())], layers[-1])

    @staticmethod
    def _layer(kind, n, m, r, g):
        if kind == "dense":
            return nn.Linear(n, m)
        if kind == "lowrank":
            return LowRankLinear(n, m, r, generator=g)
        return FedParaLinear(n, m, r, personal=kind == "pfedpara", generator=g)

    def forward(self, x):
        return self.body(x)

    def representation(self, x):
        return self.body[:-1](x)

    def weights(self) -> list[Tensor]:
        """The dense weight each hidden layer computes with (for rank checks)."""
        return [l.weight() if callable(l.weight) else l.weight for l in self.body if hasattr(l, "weight")]


def fedpara_mlp(fed_or_in_features, num_classes: int | None = None, hidden=(256, 256), kind: str = "fedpara",
                ratio: float = 0.0, ranks=None, factor_head: bool | None = None, seed: int = 0) -> FactorMLP:
    """A `FactorMLP` for a `FederatedDataset` (or `in_features`, `num_classes`): `kind` "fedpara" | "pfedpara" |
    "lowrank" (same parameter budget as fedpara: rank 2r) | "dense"; `ratio` the target fraction of dense weights
    per layer (`rank_for_ratio`; 0 = r_min), or explicit `ranks`."""
    if num_classes is None:
        fed = fed_or_in_features
        return FactorMLP(math.prod(fed.input_shape), fed.num_classes, hidden, kind, ratio, ranks, factor_head, seed)
    return FactorMLP(int(fed_or_in_features), num_classes, hidden, kind, ratio, ranks, factor_head, seed)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Methods (run them with a FactorMLP: simulate(get_method("pfedpara"), fed, model=fedpara_mlp(fed, kind="pfedpara")))


@register("fedpara", claims="fedpara")
def fedpara(server_lr: float = 1.0):
    """FedPara's training is FedAvg on the factors: every parameter (X₁, Y₁, X₂, Y₂, biases) is sent and averaged.
    Pass a FedPara model (`fedpara_mlp(fed)`) to `simulate`; bytes_up are the factors' bytes."""
    return replace(fedavg(server_lr), name="fedpara")


@register("pfedpara", claims="fedpara")
def pfedpara(local=LOCAL_FACTORS, server_lr: float = 1.0):
    """pFedPara: FedAvg on the global factors X₁, Y₁ (and the biases and head); X₂, Y₂ (`local` patterns) are
    trained by each client and kept in its store. Needs a model with `personal=True` layers
    (`fedpara_mlp(fed, kind="pfedpara")`); its personal models are evaluated as `personal_acc_*`."""
    return replace(fedavg(server_lr), name="pfedpara", groups=ParamGroups(local=tuple(local)))


__all__ = ["FedParaLinear", "LowRankLinear", "FactorMLP", "fedpara_mlp", "fedpara", "pfedpara", "rank_for_ratio",
           "min_full_rank", "fedpara_params", "lowrank_params", "check_rank", "count_params"]
