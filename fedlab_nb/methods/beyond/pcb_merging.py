"""PCB-Merging — Guodong Du, Junlin Lee, Jing Li, Runhua Jiang, Yifei Guo, Shuyang Yu, Hanting Liu, Sim Kuan
Goh, Ho-Kin Tang, Daojing He, Min Zhang, "Parameter Competition Balancing for Model Merging", NeurIPS 2024
(https://arxiv.org/abs/2410.02396). Official code: https://github.com/duguodong7/pcb-merging

A training-free merge of task vectors τ_i = θ_i − θ₀ (n tasks × d coordinates) with one coefficient per
task and coordinate. The steps follow the repository's `pcb-merging.py` (`PCB_merge`), which its README names
as the implementation of the key steps:

1. clip: each task's magnitudes |τ_i| are clipped to their 0.01 % and 99.99 % order statistics;
2. score: intra-balancing exp(n · minmax(|τ_i|)²) (importance inside the task, sharpened by the number of
   tasks) times inter-balancing tanh(τ_i ⊙ Σ_j τ_j) (agreement with the other tasks' total; negative when the
   sign disagrees with the dominant mass);
3. drop: per task, scores below the (1 − r) order statistic are raised to it; a per-task min–max then maps
   them to weight 0 and the kept top-r share to (0, 1] (r = the code's `pcb_ratio`, 0.05 there);
4. rescale and merge: τ* = Σ_i w_i ⊙ τ̃_i / Σ_i w_i elementwise (τ̃ the clipped vectors), θ = θ₀ + λ τ*.

The paper writes the two scores with a softmax over Norm(τ_i ⊙ τ_i) and Norm(τ_i ⊙ τ_j); its code computes them
with exp and tanh as above (the vision scripts use 1 % clipping and a pairwise-tanh inter score instead; the
README's file is the one followed here). The paper's optional per-task λ_i search (nevergrad, λ_i ∈ [0.8, 1.3])
is not included. This module also holds the merge setup shared with the evolutionary-merge notebook
(`pretrain_and_finetune`) and `TaskHeads`, which evaluates one merged trunk with fixed per-task heads.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ... import merging
from ...core.registry import register

CLIP_QUANTILE = 1e-4  # `pcb-merging.py`: clamp(|τ|, min_ratio=0.0001, max_ratio=0.0001)


# --- the three steps -----------------------------------------------------------------------------
def _minmax(x: torch.Tensor) -> torch.Tensor:
    """Each row mapped affinely onto [0, 1] (a constant row maps to 0: it has no ranking to keep)."""
    lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    return (x - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))


def _clamp_order_stats(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Each row clamped to its order statistics sorted[⌊d·low⌋] and sorted[⌊d·(1 − high)⌋ − 1] (the code's
    `clamp(x, min_ratio, max_ratio)`)."""
    d = x.shape[1]
    s = x.sort(1).values
    return x.clamp(s[:, int(d * low)].unsqueeze(1), s[:, max(int(d * (1 - high)) - 1, 0)].unsqueeze(1))


def _check_ratio(ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio (the share of each task's entries PCB keeps) must be in (0, 1], got {ratio}")


def _check_clip(clip_quantile: float) -> None:
    if not 0 <= clip_quantile < 0.5:
        raise ValueError(f"clip_quantile must be in [0, 0.5), got {clip_quantile}")


def pcb_scores(taus, clip_quantile: float = CLIP_QUANTILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped τ̃, balancing score) for the stacked task vectors [n, d]: score = intra ⊙ inter with
    intra = exp(n · minmax(|τ̃_i|)²) and inter = tanh(τ_i ⊙ Σ_j τ_j)."""
    _check_clip(clip_quantile)
    t = merging.stack_thetas(taus)
    mag = _clamp_order_stats(t.abs(), clip_quantile, clip_quantile)
    intra = torch.exp(len(t) * _minmax(mag) ** 2)
    inter = torch.tanh(t * t.sum(0))  # sign disagreement with the total mass gives a negative score
    return torch.sign(t) * mag, intra * inter


def pcb_weights(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Drop and rescale: per task, scores below the (1 − ratio) order statistic become weight 0, the rest are
    min–max rescaled (the kept entry with the largest score gets 1)."""
    _check_ratio(ratio)
    return _minmax(_clamp_order_stats(scores, 1 - ratio, 0.0))


@register("pcb_merging", claims="pcb_merging", kind="module")
def pcb_merge(taus, ratio: float = 0.1, clip_quantile: float = CLIP_QUANTILE) -> torch.Tensor:
    """The PCB-merged task vector τ* = Σ_i w_i ⊙ τ̃_i / Σ_i w_i [d] of the task vectors [n, d]; θ₀ + λτ* is the
    merged model (`pcb_model`). `ratio` r: the share of each task's coordinates kept (the code's `pcb_ratio`)."""
    _check_ratio(ratio)
    clipped, scores = pcb_scores(taus, clip_quantile)
    w = pcb_weights(scores, ratio)
    return (w * clipped).sum(0) / w.sum(0).clamp_min(1e-12)  # a coordinate every task dropped merges to 0


def pcb_model(theta0: torch.Tensor, taus, lam: float, ratio: float = 0.1,
              clip_quantile: float = CLIP_QUANTILE) -> torch.Tensor:
    """θ₀ + λ · pcb_merge(τ)."""
    return theta0 + lam * pcb_merge(taus, ratio, clip_quantile)


def sign_conflict_share(taus, top: float = 0.2) -> float:
    """A conflict diagnostic (TIES-style): trim each τ_i to its top-`top` magnitudes; among the coordinates that
    at least two tasks keep, the share where the kept entries do not all have one sign."""
    t = merging.stack_thetas(taus)
    if not 0 < top <= 1:
        raise ValueError(f"top must be in (0, 1], got {top}")
    k = max(1, int(round(top * t.shape[1])))
    kept = t.abs() >= t.abs().kthvalue(t.shape[1] - k + 1, dim=1, keepdim=True).values
    shared = kept.sum(0) >= 2
    pos, neg = ((t > 0) & kept).any(0), ((t < 0) & kept).any(0)
    return float((pos & neg & shared).sum() / shared.sum().clamp_min(1))


# --- the shared setup: a "pretrained" θ₀ trained here, fine-tuned copies ---------------------------
def pretrain_and_finetune(model: nn.Module, pretrain: tuple, tasks: Sequence[tuple], *, pretrain_epochs: int,
                          epochs: int, lr: float, batch_size: int = 32, seed: int = 0,
                          optimizer: str = "sgd") -> tuple[torch.Tensor, torch.Tensor]:
    """θ₀ = `model` trained on `pretrain` = (x, y) for `pretrain_epochs`; then one copy of θ₀ fine-tuned on each
    task's (x, y) for `epochs`. Returns (θ₀ [d], fine-tuned θ_k [K, d]); every batch order is keyed by `seed`."""
    if not tasks:
        raise ValueError("tasks must give at least one (x, y) fine-tuning set")
    kw = dict(lr=lr, batch_size=batch_size, optimizer=optimizer)
    theta0 = merging.fit(model, None, *pretrain, epochs=pretrain_epochs, seed=seed, **kw)
    thetas = [merging.fit(model, theta0, x, y, epochs=epochs, seed=seed * 101 + k + 1, **kw)
              for k, (x, y) in enumerate(tasks)]
    return theta0, torch.stack(thetas)


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """A ReLU MLP with the given layer widths (input first, output last); its last Linear is the head."""
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def head_size(model: nn.Sequential) -> int:
    """Entries of the flat vector that belong to the last Linear (they come last in `flatten_params`)."""
    return sum(p.numel() for p in model[-1].parameters())


class TaskHeads(nn.Module):
    """A merged trunk evaluated with fixed per-task heads: the trunk's weights are the only parameters (what a
    merge combines); input rows carry their task index in a last column, which picks the head.

    `trunk`: the model without its head; `heads`: [T, C, h] weights and [T, C] biases, stored as plain tensors
    (not parameters or buffers) so flat vectors, `merging.merge_baselines` and the Fisher merge see the trunk only."""

    def __init__(self, trunk: nn.Module, head_weights: torch.Tensor, head_biases: torch.Tensor):
        super().__init__()
        if head_weights.ndim != 3 or head_biases.shape != head_weights.shape[:2]:
            raise ValueError("head_weights must be [T, C, h] and head_biases [T, C]")
        self.trunk, self.head_weights, self.head_biases = trunk, head_weights.detach(), head_biases.detach()

    def forward(self, x):
        task = x[:, -1].long()
        h = self.trunk(x[:, :-1])
        return torch.einsum("nh,nch->nc", h, self.head_weights[task].to(h.dtype)) + self.head_biases[task].to(h.dtype)

    @staticmethod
    def with_task(x: torch.Tensor, task: int) -> torch.Tensor:
        """Rows x with the task index appended as the last column."""
        return torch.cat([x, torch.full((len(x), 1), float(task), dtype=x.dtype)], 1)
