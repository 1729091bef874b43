"""Evolutionary model merge, a toy analogue of the parameter-space search of Takuya Akiba, Makoto Shing, Yujin
Tang, Qi Sun, David Ha, "Evolutionary Optimization of Model Merging Recipes", arXiv 2403.13187 (2024)
(https://arxiv.org/abs/2403.13187; released models and evaluation code: https://github.com/SakanaAI/evolutionary-model-merge,
no search code).

The paper searches merge recipes with CMA-ES against a held-out task metric: in parameter space, per-layer
merge weights (and DARE/TIES densities) for each source model. Here the recipe is the per-layer, per-model
weight matrix w [K, L] of task vectors τ_m = θ_m − θ₀ from one shared θ₀,

    θ_l = θ₀,l + Σ_m w_{m,l} τ_{m,l}        (l = a layer: one Linear's weight and bias),

optionally with a DARE drop rate p_m per model (τ_m → DARE(τ_m, p_m), `merging.dare`). Every w = 1/K is the plain
average (one-shot FedAvg) and a shared w = λ is task arithmetic, so a search that starts from the better of the
two and keeps its best-so-far point (elitism) can never end below either on the validation data it is scored
on — on test data it has no such guarantee. CMA-ES comes from the `cmaes` package (`cmaes.CMA`, ask/tell).
The paper's data-flow-space search (layer routing) is not included.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from cmaes import CMA

from ... import merging
from ...core.registry import register
from ...models import param_spec


def layer_slices(model: torch.nn.Module) -> list[slice]:
    """The flat-vector slice of each layer (consecutive parameters of one module, e.g. a Linear's weight and bias)."""
    slices, start, owners = [], 0, []
    for name, shape in param_spec(model):
        size, owner = int(np.prod(shape)), name.rsplit(".", 1)[0]
        if owners and owners[-1] == owner:
            slices[-1] = slice(slices[-1].start, start + size)
        else:
            slices.append(slice(start, start + size))
            owners.append(owner)
        start += size
    return slices


def layerwise_merge(theta0: torch.Tensor, taus: torch.Tensor, weights, layers: Sequence[slice],
                    dare_rates: Sequence[float] | None = None, dare_seed: int = 0) -> torch.Tensor:
    """θ₀ + Σ_m w_{m,l} τ_{m,l} per layer l (`weights` [K, L]); with `dare_rates` p_m each τ_m is first DARE-d
    (drop with probability p_m, rescale by 1/(1 − p_m)) with masks keyed by `dare_seed`, so one recipe is one model."""
    t = merging.stack_thetas(taus)
    if t.shape[1:] != theta0.shape:
        raise ValueError(f"taus must be [K, {theta0.numel()}] task vectors of theta0, got {tuple(t.shape)}")
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64), dtype=t.dtype)
    if w.shape != (len(t), len(layers)):
        raise ValueError(f"weights must be [K, L] = [{len(t)}, {len(layers)}] (one per model and layer), got {tuple(w.shape)}")
    if sum(s.stop - s.start for s in layers) != t.shape[1]:
        raise ValueError("layers must cover the flat vector exactly (use layer_slices(model))")
    if dare_rates is not None:
        g = torch.Generator().manual_seed(int(dare_seed))
        t = torch.stack([merging.dare(tau, float(p), g) for tau, p in zip(t, dare_rates)])
    per_coord = torch.cat([w[:, i:i + 1].expand(-1, s.stop - s.start) for i, s in enumerate(layers)], 1)
    return theta0 + (per_coord * t).sum(0)


@dataclass
class SearchResult:
    """The best recipe found, its validation score and every evaluation in order (for budget curves)."""
    weights: np.ndarray                 # [K, L]
    dare_rates: np.ndarray | None       # [K] or None
    score: float                        # validation score of the best recipe
    start_scores: list                  # validation scores of the elitist start points, in the order given
    scores: list = field(default_factory=list)     # every evaluation's validation score, in order
    recipes: list = field(default_factory=list)    # every evaluated recipe (flat: K·L weights, then K rates)

    def best_within(self, budget: int) -> np.ndarray:
        """The best-so-far recipe (flat) after the first `budget` evaluations (the first best on ties)."""
        return self.recipes[int(np.argmax(self.scores[:budget]))]


@register("evolutionary_merge", claims="evolutionary_merge", kind="module")
def evolve_merge(score: Callable[[torch.Tensor], float], theta0: torch.Tensor, taus: torch.Tensor,
                 layers: Sequence[slice], starts: Sequence, *, budget: int = 1000, sigma: float = 0.2,
                 bounds: tuple = (0.0, 2.0), dare: bool = False, max_dare: float = 0.9, dare_seed: int = 0,
                 seed: int = 0) -> SearchResult:
    """Maximise `score(θ)` (validation accuracy) over per-layer merge weights with CMA-ES, elitist.

    `starts`: [K, L] weight matrices evaluated first (e.g. all 1/K and the best task-arithmetic λ); CMA-ES starts
    at the best of them, and the returned recipe is the best of all `budget` evaluations, starts included.
    `dare`: also search a DARE rate per model in [0, max_dare] (starts use rate 0). `seed` keys CMA-ES."""
    k, n_layers = len(taus), len(layers)
    if budget < len(starts) or not starts:
        raise ValueError(f"need at least one start and budget >= the number of starts ({len(starts)}), got {budget}")
    dim = k * n_layers + (k if dare else 0)
    lo = np.r_[np.full(k * n_layers, bounds[0]), np.zeros(k if dare else 0)]
    hi = np.r_[np.full(k * n_layers, bounds[1]), np.full(k if dare else 0, max_dare)]

    def evaluate(x: np.ndarray) -> float:
        w, rates = x[:k * n_layers].reshape(k, n_layers), (x[k * n_layers:] if dare else None)
        return float(score(layerwise_merge(theta0, taus, w, layers, rates, dare_seed)))

    result = SearchResult(None, None, -np.inf, [])
    for s in starts:
        x = np.r_[np.asarray(s, dtype=np.float64).reshape(-1), np.zeros(k if dare else 0)]
        result.start_scores.append(evaluate(x))
        result.scores.append(result.start_scores[-1]), result.recipes.append(x)
    mean = result.recipes[int(np.argmax(result.scores))]
    opt = CMA(mean=np.clip(mean, lo, hi), sigma=sigma, bounds=np.c_[lo, hi], seed=seed)
    while len(result.scores) < budget:
        told = []
        for _ in range(opt.population_size):
            if len(result.scores) >= budget:
                break
            x = opt.ask()
            result.scores.append(evaluate(x)), result.recipes.append(x)
            told.append((x, -result.scores[-1]))  # CMA-ES minimises
        if len(told) == opt.population_size:
            opt.tell(told)
    best = result.best_within(budget)
    result.weights = best[:k * n_layers].reshape(k, n_layers)
    result.dare_rates = best[k * n_layers:] if dare else None
    result.score = max(result.scores)
    return result
