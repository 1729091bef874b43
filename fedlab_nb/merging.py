"""Model merging on flat parameter vectors: the shared part of the "aggregation beyond FL" notebooks.

One-shot FedAvg is the simplest merge: K models fine-tuned from one shared θ₀ are averaged once. This
module gives the pieces every merge notebook reuses, all on the library's flat vectors (`models.param_spec`):

- `fit`: plain centralised training of a model from θ (SGD or Adam, seeded), used to build a "pretrained"
  θ₀ on a disjoint split and to fine-tune copies of it — nothing comes from a hub;
- `task_vectors` τ_k = θ_k − θ₀ (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023,
  https://arxiv.org/abs/2212.04089), `interpolate` (WiSE-FT's weight mix), `task_arithmetic` θ₀ + λΣτ_k,
  `plain_average`, `ties_merge` (Yadav et al., "TIES-Merging", NeurIPS 2023, https://arxiv.org/abs/2306.01708)
  and `dare` (Yu et al., "Language Models are Super Mario", ICML 2024, https://arxiv.org/abs/2311.03099);
- predictions and calibration: `predict_proba`, `accuracy`, `nll`, `ece` (equal-width bins), `brier`,
  `ood_auroc` (maximum softmax probability, Hendrycks & Gimpel, ICLR 2017);
- `merge_baselines`: the same baseline table for every merge notebook — θ₀, each fine-tuned model, the plain
  average, task arithmetic with λ tuned on validation data, the diagonal Fisher merge and the output ensemble
  (mean predicted probabilities);
- `diagonal_fisher` and `fisher_merge` (Matena & Raffel, NeurIPS 2022): the Fisher merge, here because the merge
  notebooks and the one-shot federated method (`methods/communication/fisher_merging.py`) both use it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from torch.func import functional_call, grad, jacrev, vmap

from .models import flatten_params, param_spec, unflatten

LAMBDA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 21))  # task-arithmetic λ ∈ {0.1, …, 2.0}


# --- training ------------------------------------------------------------------------------------
def logits(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model's outputs on x at flat parameters θ (differentiable in θ)."""
    return functional_call(model, unflatten(theta, param_spec(model)), (x,))


def fit(model: torch.nn.Module, theta: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1,
        lr: float = 0.05, batch_size: int = 32, optimizer: str = "sgd", weight_decay: float = 0.0, seed: int = 0,
        loss_fn: Callable | None = None) -> torch.Tensor:
    """Train from flat parameters θ (None: the model's own weights) for `epochs` over (x, y) in shuffled
    mini-batches; returns the trained flat vector (the model itself is left unchanged).

    `optimizer`: "sgd" or "adam". `loss_fn(logits, y)`: cross-entropy by default (a MixUp or label-smoothing
    notebook passes its own). The shuffles come from a generator seeded with `seed`, so a run is repeatable."""
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"x and y must hold the same positive number of rows, got {len(x)} and {len(y)}")
    if epochs < 0 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1 and lr > 0, got {epochs}, {batch_size}, {lr}")
    w = (flatten_params(model) if theta is None else theta).detach().clone().requires_grad_(True)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)([w], lr=lr, weight_decay=weight_decay)
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    g = torch.Generator().manual_seed(int(seed))
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            opt.zero_grad()
            loss_fn(logits(model, w, x[idx]), y[idx]).backward()
            opt.step()
    return w.detach()


# --- merges --------------------------------------------------------------------------------------
def stack_thetas(thetas) -> torch.Tensor:
    """K flat parameter vectors (a list or a [K, d] tensor) as one checked [K, d] tensor."""
    t = torch.stack(list(thetas)) if not torch.is_tensor(thetas) else thetas
    if t.ndim != 2 or len(t) == 0:
        raise ValueError(f"thetas must be K >= 1 flat parameter vectors ([K, d]), got shape {tuple(t.shape)}")
    return t


def task_vectors(thetas, theta0: torch.Tensor) -> torch.Tensor:
    """τ_k = θ_k − θ₀, [K, d]."""
    t = stack_thetas(thetas)
    if theta0.shape != t.shape[1:]:
        raise ValueError(f"theta0 has {tuple(theta0.shape)} entries but the models have {t.shape[1]}")
    return t - theta0


def interpolate(theta_a: torch.Tensor, theta_b: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 − α)·θ_a + α·θ_b (WiSE-FT with θ_a pretrained and θ_b fine-tuned)."""
    if theta_a.shape != theta_b.shape:
        raise ValueError(f"theta_a and theta_b differ in shape: {tuple(theta_a.shape)} vs {tuple(theta_b.shape)}")
    return (1 - alpha) * theta_a + alpha * theta_b


def plain_average(thetas, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Σ_k w_k θ_k / Σ_k w_k (equal weights by default): one-shot FedAvg."""
    t = stack_thetas(thetas)
    w = torch.ones(len(t), dtype=t.dtype) if weights is None else torch.as_tensor(weights, dtype=t.dtype)
    if w.shape != (len(t),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {len(t)} non-negative numbers with a positive sum")
    return (w[:, None] * t).sum(0) / w.sum()


def task_arithmetic(theta0: torch.Tensor, taus: torch.Tensor, lam: float) -> torch.Tensor:
    """θ₀ + λ Σ_k τ_k (λ = 1/K is the plain average)."""
    return theta0 + lam * stack_thetas(taus).sum(0)


def dare(tau: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Drop each entry of τ with probability p and rescale the survivors by 1/(1 − p) (unbiased)."""
    if not 0 <= p < 1:
        raise ValueError(f"the DARE drop rate p must be in [0, 1), got {p}")
    keep = torch.rand(tau.shape, generator=generator, dtype=torch.float64).to(tau.device) >= p
    return tau * keep / (1 - p)


def ties_merge(taus: torch.Tensor, density: float = 0.2) -> torch.Tensor:
    """TIES: trim each τ_k to its top-`density` magnitudes, elect each coordinate's sign by the larger total
    mass, and average only the entries that agree with it (the disjoint mean); returns the merged τ."""
    t = stack_thetas(taus)
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    k = max(1, int(round(density * t.shape[1])))
    thresh = t.abs().kthvalue(t.shape[1] - k + 1, dim=1, keepdim=True).values
    trimmed = torch.where(t.abs() >= thresh, t, torch.zeros_like(t))
    sign = torch.sign(trimmed.sum(0))
    agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
    return (trimmed * agree).sum(0) / agree.sum(0).clamp_min(1)


# --- predictions and calibration -----------------------------------------------------------------
@torch.no_grad()
def predict_proba(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Softmax probabilities [n, C] of the model at θ."""
    return torch.cat([torch.softmax(logits(model, theta, xb), -1) for xb in x.split(chunk)])


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    return float((probs.argmax(1) == y).double().mean())


def nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log-likelihood of the true labels."""
    return float(-probs.gather(1, y[:, None]).clamp_min(1e-12).log().mean())


def brier(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over rows of Σ_c (p_c − 1[c = y])²."""
    return float(((probs - torch.nn.functional.one_hot(y, probs.shape[1]).to(probs.dtype)) ** 2).sum(1).mean())


def ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error over `bins` equal-width confidence bins (Guo et al., ICML 2017)."""
    conf, pred = probs.max(1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=conf.dtype)
    which = torch.bucketize(conf, edges[1:-1], right=True)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += float(mask.double().mean()) * abs(float(correct[mask].mean()) - float(conf[mask].double().mean()))
    return total


def ood_auroc(probs_in: torch.Tensor, probs_out: torch.Tensor) -> float:
    """AUROC of the maximum softmax probability separating in-distribution (positive) from OOD rows."""
    from sklearn.metrics import roc_auc_score
    scores = torch.cat([probs_in.max(1).values, probs_out.max(1).values]).double().numpy()
    labels = np.r_[np.ones(len(probs_in)), np.zeros(len(probs_out))]
    return float(roc_auc_score(labels, scores))


def ensemble_proba(model: torch.nn.Module, thetas, x: torch.Tensor) -> torch.Tensor:
    """The output ensemble: the mean of the members' predicted probabilities."""
    return torch.stack([predict_proba(model, th, x) for th in stack_thetas(thetas)]).mean(0)


# --- the shared baseline table -------------------------------------------------------------------
def tune_lambda(score: Callable[[torch.Tensor], float], theta0: torch.Tensor, taus: torch.Tensor,
                grid: Sequence[float] = LAMBDA_GRID) -> tuple[float, float]:
    """The λ of task arithmetic maximising `score(θ)` (validation accuracy) over `grid`; (λ, score)."""
    if len(grid) == 0:
        raise ValueError("grid must hold at least one λ")
    scored = [(score(task_arithmetic(theta0, taus, lam)), lam) for lam in grid]
    best, lam = max(scored, key=lambda s: (s[0], -abs(s[1] - 1.0)))  # ties: the λ closest to 1
    return float(lam), float(best)


def merge_baselines(model: torch.nn.Module, theta0: torch.Tensor, thetas, val: tuple, tests: dict[str, tuple], *,
                    fisher_data: Sequence[tuple] | None = None, names: Sequence[str] | None = None,
                    grid: Sequence[float] = LAMBDA_GRID) -> pd.DataFrame:
    """Accuracy of the shared merge baselines on each test set: one row per model, one column per test set.

    Rows: "θ₀", each fine-tuned model (`names`, default "model k"), "average" (one-shot FedAvg, equal
    weights), "task arithmetic" (λ chosen on `val` = (x, y); the column "lambda" holds it), "Fisher merge"
    (when `fisher_data` gives each model's (x, y) rows for its diagonal Fisher) and "output ensemble".
    Extra merges of a notebook are scored with the same `predict_proba`/`accuracy` pair."""
    t = stack_thetas(thetas)
    names = list(names) if names is not None else [f"model {k}" for k in range(len(t))]
    if len(names) != len(t):
        raise ValueError(f"names must name each of the {len(t)} models, got {len(names)}")
    if not tests:
        raise ValueError("tests must name at least one (x, y) test set, e.g. {'test': (x, y)}")
    taus = task_vectors(t, theta0)
    lam, _ = tune_lambda(lambda th: accuracy(predict_proba(model, th, val[0]), val[1]), theta0, taus, grid)
    merged = {"θ₀": theta0, **dict(zip(names, t)), "average": plain_average(t),
              "task arithmetic": task_arithmetic(theta0, taus, lam)}
    if fisher_data is not None:
        if len(fisher_data) != len(t):
            raise ValueError(f"fisher_data must give (x, y) for each of the {len(t)} models")
        fishers = torch.stack([diagonal_fisher(model, th, fx) for th, (fx, _) in zip(t, fisher_data)])
        merged["Fisher merge"] = fisher_merge(t, fishers)
    rows = {name: {k: accuracy(predict_proba(model, th, x), y) for k, (x, y) in tests.items()}
            for name, th in merged.items()}
    rows["output ensemble"] = {k: accuracy(ensemble_proba(model, t, x), y) for k, (x, y) in tests.items()}
    table = pd.DataFrame(rows).T
    table["lambda"] = np.where(table.index == "task arithmetic", lam, np.nan)
    return table


# --- Fisher merging (Matena & Raffel, NeurIPS 2022); the federated method: methods/communication/fisher_merging.py
FISHER_FLOOR = 1e-6  # the official code's default `fisher_floor`


# --- the diagonal Fisher -------------------------------------------------------------------------
def _log_probs(model, spec):
    def f(flat, x_row):
        return torch.log_softmax(functional_call(model, unflatten(flat, spec), (x_row.unsqueeze(0),))[0], -1)
    return f


def diagonal_fisher(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None,
                    kind: str = "exact", chunk: int = 128) -> torch.Tensor:
    """The diagonal Fisher [d] of the classifier `model` at flat parameters `theta` on the rows x.

    kind="exact" (the paper's code): mean over rows of Σ_c p(c|x) (∇ log p(c|x))², from per-sample
    Jacobians of the log-probabilities (torch.func.jacrev under vmap). kind="empirical": mean over rows
    of (∇ log p(y|x))² with the true labels y."""
    if kind not in ("exact", "empirical"):
        raise ValueError(f"kind must be 'exact' (expectation over the model's labels) or 'empirical' (true labels), "
                         f"got {kind!r}")
    if len(x) == 0:
        raise ValueError("diagonal_fisher needs at least one row of x")
    if kind == "empirical" and (y is None or len(y) != len(x)):
        raise ValueError("kind='empirical' needs the labels y, one per row of x")
    if next(model.buffers(), None) is not None:
        raise ValueError("diagonal_fisher supports models without buffers (no BatchNorm); use 'logreg', 'mlp' or 'cnn'")
    log_p = _log_probs(model, param_spec(model))
    theta = theta.detach()
    total = torch.zeros_like(theta)
    for i in range(0, len(x), chunk):
        xb = x[i:i + chunk].to(theta.dtype)
        if kind == "exact":
            jac = vmap(jacrev(log_p), in_dims=(None, 0))(theta, xb)             # [b, C, d]
            p = vmap(log_p, in_dims=(None, 0))(theta, xb).exp()                 # [b, C]
            total += torch.einsum("bc,bcd->d", p, jac.square())
        else:
            yb = y[i:i + chunk]
            g = vmap(grad(lambda f, xr, yr: log_p(f, xr).gather(0, yr[None])[0]), in_dims=(None, 0, 0))(theta, xb, yb)
            total += g.square().sum(0)
    return total / len(x)


# --- the merge -----------------------------------------------------------------------------------
def fisher_merge(thetas: torch.Tensor, fishers: torch.Tensor, weights: torch.Tensor | None = None,
                 floor: float = FISHER_FLOOR, normalize: bool = False) -> torch.Tensor:
    """θ = Σ_k c_k θ_k with per-parameter coefficients c_k = λ_k F̃_k / Σ_j λ_j F̃_j, F̃_k = max(F_k, floor).

    Written with normalised coefficients so that one model merges to itself exactly (c = 1).
    `weights`: λ_k (None: all 1). `normalize`: divide λ_k by ‖F_k‖₂ (the official code's default)."""
    if thetas.ndim != 2 or thetas.shape != fishers.shape:
        raise ValueError(f"thetas and fishers must both be [K, d] and of one shape, got {tuple(thetas.shape)} "
                         f"and {tuple(fishers.shape)}")
    if len(thetas) == 0:
        raise ValueError("fisher_merge needs at least one model")
    if (fishers < 0).any():
        raise ValueError("a Fisher diagonal is a mean of squares and cannot be negative")
    if not floor >= 0:
        raise ValueError(f"floor (ε) must be >= 0, got {floor}")
    lam = torch.ones(len(thetas), dtype=thetas.dtype, device=thetas.device) if weights is None \
        else torch.as_tensor(weights, dtype=thetas.dtype, device=thetas.device)
    if lam.shape != (len(thetas),) or (lam < 0).any() or lam.sum() <= 0:
        raise ValueError(f"weights must be {len(thetas)} non-negative merging coefficients with a positive sum")
    f = fishers.to(thetas.dtype).clamp_min(floor)
    if normalize:
        lam = lam / fishers.to(thetas.dtype).norm(dim=1)
    precision = lam[:, None] * f
    total = precision.sum(0)
    if (total <= 0).any():
        raise ValueError("some parameter has zero total Fisher weight: use floor > 0")
    return ((precision / total) * thetas).sum(0)
