"""FedGP — Enyi Jiang, Yibo Jacky Zhang, Sanmi Koyejo, "Principled Federated Domain Adaptation: Gradient
Projection and Auto-Weighting", ICLR 2024, https://arxiv.org/abs/2302.05049. Official code:
https://github.com/jackyzyb/AutoFedGP (`main_noniid_auto_beta.py`: `update_global`, `update_global_convex`;
`empirical_metric.py`: the auto-β estimates).

Federated domain adaptation: one *target* client with little data, source clients whose domains are shifted.
The server centres the round on the target's update g_T and lets a source update g_k in only through its part
along g_T, and only when it points the same way (the paper's positive projection):

    Proj₊(g_k | g_T) = max(⟨g_k, g_T⟩, 0) · g_T / ‖g_T‖²,
    FedGP:  Δ = Σ_k w_k [(1 − β_k) g_T + β_k Proj₊(g_k | g_T)]      (w_k: the sources' size fractions)
    FedDA:  Δ = Σ_k w_k [(1 − β_k) g_T + β_k g_k]                    (the paper's simpler convex heuristic)

With one fixed β this is (1 − β) g_T + β Σ_k w_k Proj₊(g_k | g_T). `projection="cosine"` is the official code's
variant (`update_global`): an aligned source adds cos(g_k, g_T) · g_k instead of the projection. As in the
code, a source update is first rescaled to the target's number of local steps (τ_T / τ_k), and `per_layer=True`
applies the rule to each parameter tensor separately (the code works per state-dict key).

Auto-weighting (the paper's theory; estimates as in the official `empirical_metrics_batch`): from the target's
N mini-batch gradients {g_T,b} at the broadcast θ (mean ĝ_T, dimension d) and a source's average gradient g_k,

    σ²      = Σ_b ‖g_T,b − ĝ_T‖² / ((N − 1) d) / N                 (variance of the target's mean gradient)
    FedDA:  β_k = σ² / (σ² + max(Σ_b ‖g_T,b − g_k‖² / (N d) − N σ², 0))
    FedGP:  β_k = σ² / (σ² + δ_k · p_k + (1 − δ_k) · ‖ĝ_T‖² / d)

where p_k = max(mean_b ‖g_T,b^⊥‖² / d − s_⊥, 0) is the squared size of the target gradient's part orthogonal to
g_k (s_⊥ its sample variance over batches), and δ_k = 1 − (1 − q_k)/N with q_k the fraction of batches with
⟨g_T,b, g_k⟩ > 0. The engine's messages carry updates only, so the target's batch gradients come from a
`probe(θ) -> [N, d]` that the target evaluates on its own data (`batch_gradient_probe`); a source's average
gradient is −Δ_k / (η τ_k), the mean of its SGD steps' gradients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...core.history import per_client_columns
from ...core.registry import register
from ...models import param_spec, unflatten
from ...core.method import DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD


def positive_projection(g: torch.Tensor, g_target: torch.Tensor) -> torch.Tensor:
    """Proj₊(g | g_T) = max(⟨g, g_T⟩, 0) g_T / ‖g_T‖² for each row of g [m, d] (or one vector [d]);
    zero when the target update is zero (no direction to project on)."""
    norm2 = g_target.pow(2).sum()
    if norm2 == 0:
        return torch.zeros_like(g)
    coef = (g @ g_target).clamp_min(0) / norm2
    return coef.unsqueeze(-1) * g_target if g.dim() == 2 else coef * g_target


def cosine_scaled(g: torch.Tensor, g_target: torch.Tensor) -> torch.Tensor:
    """The official code's variant: cos(g_k, g_T) · g_k where the cosine is positive, else zero (rows of g)."""
    cos = F.cosine_similarity(g, g_target.expand_as(g), dim=-1, eps=1e-12)
    return cos.clamp_min(0).unsqueeze(-1) * g


def auto_betas(target_batch_grads: torch.Tensor, source_grads: torch.Tensor, rule: str = "fedgp") -> torch.Tensor:
    """The auto-weights β_k [m] (formulas in the module docstring) from the target's N mini-batch gradients
    [N, d] and the sources' average gradients [m, d]; `rule` is "fedgp" or "fedda"."""
    G, S = target_batch_grads, source_grads
    if G.dim() != 2 or G.shape[0] < 2:
        raise ValueError(f"target_batch_grads must be [N, d] with N >= 2 mini-batches, got {tuple(G.shape)}")
    if S.dim() != 2 or S.shape[1] != G.shape[1]:
        raise ValueError(f"source_grads must be [m, {G.shape[1]}], got {tuple(S.shape)}")
    if rule not in ("fedgp", "fedda"):
        raise ValueError(f"rule must be 'fedgp' or 'fedda', got {rule!r}")
    n, d = G.shape
    g_bar = G.mean(0)
    sample_var = (G - g_bar).pow(2).sum() / (n - 1) / d
    var = sample_var / n  # variance of the mean target gradient
    betas = []
    for s in S:
        if rule == "fedda":
            dist2 = ((G - s).pow(2).sum() / n / d - sample_var).clamp_min(0)
            betas.append(var / (var + dist2))
            continue
        s2 = s.pow(2).sum().clamp_min(1e-30)
        perp = G - torch.outer(G @ s, s) / s2  # each batch gradient minus its part along g_k
        perp_bar = g_bar - (g_bar @ s) * s / s2
        perp_var = (perp - perp_bar).pow(2).sum() / (n - 1) / d
        p = (perp.pow(2).sum(1).mean() / d - perp_var).clamp_min(0)
        q = ((G @ s) > 0).double().mean()
        delta = 1 - (1 - q) / n
        betas.append(var / (var + delta * p + (1 - delta) * g_bar.pow(2).sum() / d))
    out = torch.stack([torch.as_tensor(b, dtype=torch.float64) for b in betas])
    return torch.nan_to_num(out, nan=0.0)  # 0/0: a target without noise and no shift measure trusts itself


def batch_gradient_probe(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 10) -> Callable:
    """probe(θ) -> [N, d]: the cross-entropy gradient of each of the target's N mini-batches (fixed order) at
    the flat parameters θ, what the target computes on its own data for the auto-weights."""
    if batch_size < 1 or len(x) < 2 * batch_size:
        raise ValueError(f"batch_size must be >= 1 with at least two batches in the {len(x)} target rows, got {batch_size}")
    spec = param_spec(model)
    batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x) - batch_size + 1, batch_size)]

    def probe(theta: torch.Tensor) -> torch.Tensor:
        rows = []
        for xb, yb in batches:
            params = {k: v.detach().requires_grad_(True) for k, v in unflatten(theta.detach(), spec).items()}
            loss = F.cross_entropy(torch.func.functional_call(model, params, (xb,)), yb)
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(params.values()))]))
        return torch.stack(rows)
    return probe


@dataclass
class GradientProjectionRule:
    """The FedGP / FedDA rule for the `Method.rule` slot (target-centred; `uses_context` rule). State: the last
    round's β_k and alignment cos(g_k, g_T) per client (NaN for the target and absent clients), logged in History
    as `gp_beta<k>` / `gp_cos<k>`."""
    target: int
    beta: float = 0.5
    auto: bool = False
    probe: Callable | None = None
    projection: str = "paper"     # "paper" (Proj₊), "cosine" (official code), "none" (FedDA)
    per_layer: bool = False
    spec: tuple = ()
    uses_context = True

    def __post_init__(self):
        if isinstance(self.target, bool) or not isinstance(self.target, (int, np.integer)) or self.target < 0:
            raise ValueError(f"target must be the target client's id (an int >= 0), got {self.target!r}")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1] (0 = target only), got {self.beta}")
        if self.projection not in ("paper", "cosine", "none"):
            raise ValueError(f"projection must be 'paper', 'cosine' or 'none', got {self.projection!r}")
        if self.auto and self.probe is None:
            raise ValueError("auto=True needs probe=batch_gradient_probe(model, x_target, y_target)")
        if self.per_layer and not self.spec:
            raise ValueError("per_layer=True needs spec=param_spec(model)")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if self.target >= num_clients:
            raise ValueError(f"target={self.target} but the federation has {num_clients} clients")
        nan = torch.full((num_clients,), float("nan"), dtype=torch.float64)
        return {"beta": nan.clone(), "cos": nan.clone()}

    def _combine(self, g_t: torch.Tensor, g_s: torch.Tensor) -> torch.Tensor:
        if self.projection == "paper":
            return positive_projection(g_s, g_t)
        return cosine_scaled(g_s, g_t) if self.projection == "cosine" else g_s

    def _blocks(self, d: int) -> list[slice]:
        if not self.per_layer:
            return [slice(0, d)]
        sizes = np.cumsum([0] + [int(np.prod(s)) for _, s in self.spec])
        return [slice(a, b) for a, b in zip(sizes[:-1], sizes[1:])]

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo):
        ids = np.asarray(info.client_ids)
        where = np.flatnonzero(ids == self.target)
        if len(where) != 1:
            raise ValueError(f"the target client {self.target} must take part in every round (sample it always)")
        t = int(where[0])
        src = np.flatnonzero(ids != self.target)
        g_t = updates[t]
        new = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        if len(src) == 0:
            return g_t.clone(), new
        steps = info.steps.to(updates)
        g_s = updates[src] * (steps[t] / steps[src]).unsqueeze(1)  # sources rescaled to the target's step count
        w = weights[src].to(updates) if weights is not None else torch.ones(len(src), dtype=updates.dtype)
        w = w / w.sum()
        beta = torch.full((len(src),), float(self.beta), dtype=torch.float64)
        if self.auto:
            avg_grad = -updates[src] / (info.lr * steps[src]).unsqueeze(1)  # mean SGD gradient of each source
            rule = "fedda" if self.projection == "none" else "fedgp"
            beta = auto_betas(self.probe(info.theta).to(updates), avg_grad, rule)
        b = beta.to(updates)
        out = torch.empty_like(g_t)
        for blk in self._blocks(len(g_t)):
            mixed = self._combine(g_t[blk], g_s[:, blk])
            out[blk] = (w * (1 - b)).sum() * g_t[blk] + (w * b) @ mixed
        new["beta"][torch.as_tensor(ids[src])] = beta.double()
        new["cos"][torch.as_tensor(ids[src])] = F.cosine_similarity(g_s, g_t.expand_as(g_s), dim=1).double().cpu()
        return out, new

    def metrics(self, state: dict) -> dict:
        return per_client_columns(gp_beta=state["beta"], gp_cos=state["cos"])


@register("fedgp", claims="fedgp")
def fedgp(target: int = 0, beta: float = 0.5, auto: bool = False, probe: Callable | None = None,
          projection: str = "paper", per_layer: bool = False, spec=(), server_lr: float = 1.0) -> Method:
    """FedAvg's local training with the target-centred rule: `fedgp(target=0, beta=0.5)` (fixed β),
    `fedgp(target=0, auto=True, probe=batch_gradient_probe(...))` (auto-weighted), `projection="none"` for
    FedDA, `"cosine"` for the official code's cos-scaled variant; `beta=0` trains on the target alone."""
    name = {"paper": "fedgp", "cosine": "fedgp_cos", "none": "fedda"}.get(projection, projection)
    name += "_auto" if auto else f"_b{beta:g}"
    rule = GradientProjectionRule(target, beta, auto, probe, projection, per_layer, tuple(spec))
    return Method(name, LocalObjective(), DataSizeWeighting(), rule, ServerSGD(lr=server_lr))
