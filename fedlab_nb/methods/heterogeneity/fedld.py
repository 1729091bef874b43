"""FedLD — Zeng, Guo, Wang, Wang, Zhou, Qu, "Tackling Data Heterogeneity in Federated Learning via Loss
Decomposition", MICCAI 2024 (arXiv:2408.12300). Official code: https://github.com/Zeng-Shuang/FedLD
(`methods/fedld.py`: MarginalLogLoss; `svd_tools.py`: pcgrad_svd; `running.py`: train_round_fedld and, in
commit 50d8399, the three-term logging of the FedAvg round).

The global loss splits exactly (telescoping) into three terms. With L(θ) = Σ_j p_j L_j(θ), q = p / Σp and
θ_i the local model of client i after local training from θ_old, and θ the new global model:

    L(θ) = Σ_i p_i L_i(θ_i)                          local loss
         + [Σ_i q_i L(θ_i) − Σ_i p_i L_i(θ_i)]       distribution-shift loss (client i's model on the others' data)
         + [L(θ) − Σ_i q_i L(θ_i)]                   aggregation loss (what averaging the models costs)

(p = 1 for every client is the official logging; p = n_j / n makes L the loss on the pooled data.)
FedLD attacks the second term on the client and the third on the server:

* **Margin control** (client): cross-entropy + λ·log(1 + ‖softmax(Z)‖²_F), the Frobenius norm of the whole
  batch's softmax matrix Z, as the official MarginalLogLoss; it penalises confident outputs.
* **Principal-gradient aggregation** (server, per parameter tensor, the official `pcgrad_svd`): stack the
  round's updates U [m, d], eigendecompose G = UUᵀ/m = E S Eᵀ, take directions v_j = Uᵀe_j for the k = ⌊0.8m⌋
  largest s_j, flip each v_j to the majority sign of ⟨u_i, v_j⟩, replace each u_i by Σ_j of its projections on
  v_j rescaled to norm (s_j / Σ_all s)·‖u_i‖, and average. Scalar tensors and the first round use the plain
  mean, as the code does. Our guards (the code has none): directions with s_j ≤ tol·s_1 are skipped (v_j = 0
  there, and the code's projection is 0/0), a projection that is exactly 0 contributes 0, and k ≥ 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ...core.registry import register
from ...models import param_spec, unflatten
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, UniformWeighting, weighted_mean
from ...core.optim import SGD


# --- client: margin control ---------------------------------------------------------------------------
def margin_penalty(logits: torch.Tensor, lam: float) -> torch.Tensor:
    """λ·log(1 + ‖softmax(logits)‖²_F) over the whole batch (a scalar, as the official MarginalLogLoss)."""
    return lam * torch.log1p(torch.softmax(logits, dim=-1).pow(2).sum())


def margin_control_loss(logits: torch.Tensor, y: torch.Tensor, lam: float = 0.1) -> torch.Tensor:
    """FedLD's local loss: mean cross-entropy + the batch's margin penalty."""
    return F.cross_entropy(logits, y) + margin_penalty(logits, lam)


@dataclass
class MarginControlObjective(LocalObjective):
    """Cross-entropy plus λ·log(1 + ‖softmax(Z)‖²_F). The penalty is a function of the whole batch, not a sum
    over rows, so it runs on the loop backend (where `extra_loss` sees exactly the real batch, no padding);
    every row carries the batch's penalty, so the engine's row mean adds it once."""
    lam: float = 0.1
    vmappable = False

    def __post_init__(self):
        if not self.lam >= 0:
            raise ValueError(f"margin control needs lam (λ) >= 0 (0 = plain cross-entropy), got {self.lam}")

    def extra_loss(self, model, params, x, y, anchor, ctx):
        return margin_penalty(functional_call(model, params, (x,)), self.lam).expand(len(x))


# --- server: principal-gradient aggregation ------------------------------------------------------------
def principal_gradient_revise(U: torch.Tensor, k_proportion: float = 0.8, tol: float = 1e-10) -> torch.Tensor:
    """Each row u_i of U [m, d] replaced by Σ_j (s_j/Σs)·‖u_i‖·sign⟨u_i, v_j⟩·v_j/‖v_j‖ over the kept principal
    directions v_j = Uᵀe_j of G = UUᵀ/m (computed in float64; returned in U's dtype)."""
    if not 0 < k_proportion <= 1:
        raise ValueError(f"k_proportion must be in (0, 1] (the share of principal directions kept), got {k_proportion}")
    if U.dim() != 2:
        raise ValueError(f"U must be a [clients, d] matrix, got shape {tuple(U.shape)}")
    X = U.double()
    m = X.shape[0]
    s, E = torch.linalg.eigh(X @ X.T / m)                # G is symmetric PSD: its SVD is its eigendecomposition
    s, E = s.flip(0).clamp_min(0), E.flip(1)             # descending, as torch.svd
    if s[0] <= 0:                                        # every update is zero
        return torch.zeros_like(U)
    k = max(1, int(m * k_proportion))
    keep = [j for j in range(k) if s[j] > tol * s[0]]    # v_j = 0 when s_j = 0: skip, do not divide 0/0
    V = (X.T @ E[:, keep]).T                             # [k', d] directions
    agree = torch.sign(X @ V.T)                          # [m, k'] sign of ⟨u_i, v_j⟩
    flip = torch.where((agree >= 0).sum(0) >= (agree < 0).sum(0), 1.0, -1.0).to(X)
    V = V * flip[:, None]                                # calibration: majority sign (no effect on the result,
    agree = agree * flip[None, :]                        # the projection is even in v_j, kept as the code has it)
    unit = V / V.norm(dim=1, keepdim=True)
    scale = s[keep] / s.sum()                            # Σ over all m values, as the code
    revised = (agree * scale[None, :] * X.norm(dim=1, keepdim=True)) @ unit
    return revised.to(U.dtype)


@dataclass
class PrincipalGradientRule:
    """FedLD's server rule on the flat [m, d] updates, applied per parameter tensor of `spec`
    ((name, shape) pairs, `models.param_spec(model)`): principal-gradient revision then the weighted mean;
    scalar tensors and the first round take the plain weighted mean (as the official pcgrad_svd)."""
    spec: list
    k_proportion: float = 0.8
    tol: float = 1e-10

    def __post_init__(self):
        self.sizes = [int(np.prod(shape)) for _, shape in self.spec]
        if not self.sizes:
            raise ValueError("PrincipalGradientRule needs the model's param_spec (a non-empty list of (name, shape))")
        if not 0 < self.k_proportion <= 1:
            raise ValueError(f"k_proportion must be in (0, 1], got {self.k_proportion}")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"started": torch.zeros(())}

    def aggregate(self, state: dict, deltas: torch.Tensor, weights: torch.Tensor | None):
        if deltas.shape[1] != sum(self.sizes):
            raise ValueError(f"updates have {deltas.shape[1]} columns but spec has {sum(self.sizes)} parameters")
        weights = None if weights is None else weights.to(deltas.dtype)
        if state["started"] == 0:                          # first round: the code's history is empty
            return weighted_mean(deltas, weights), {"started": torch.ones(())}
        parts = []
        for block in deltas.split(self.sizes, dim=1):
            revised = block if block.shape[1] == 1 else principal_gradient_revise(block, self.k_proportion, self.tol)
            parts.append(weighted_mean(revised, weights))
        return torch.cat(parts), state


@register("fedld", claims="fedld", kind="method")
def fedld(model: torch.nn.Module, lam: float = 0.1, k_proportion: float = 0.8, margin: bool = True,
          principal: bool = True, server_lr: float = 1.0, momentum: float = 0.5,
          weight_decay: float = 5e-4) -> Method:
    """FedLD: margin-control local loss + principal-gradient aggregation with uniform client weights (the
    official round averages the revised updates with equal weight). `margin=False` / `principal=False` give
    the two ablations (the latter with FedAvg's data-size weighted mean). Client SGD with the official
    momentum 0.5 and weight decay 5e-4 (the step size is the run's `lr`)."""
    objective = MarginControlObjective(lam) if margin else LocalObjective()
    if principal:
        weighting, rule = UniformWeighting(), PrincipalGradientRule(param_spec(model), k_proportion)
    else:
        weighting, rule = DataSizeWeighting(), weighted_mean
    name = "fedld" if margin and principal else ("fedld_margin" if margin else ("fedld_agg" if principal else "fedavg"))
    return Method(name, objective, weighting, rule, ServerSGD(lr=server_lr),
                  optimizer=SGD(momentum=momentum, weight_decay=weight_decay))


# --- the loss decomposition (a diagnostic, true for any models) -----------------------------------------
def decompose(cross: torch.Tensor, global_losses: torch.Tensor, p: torch.Tensor | None = None) -> dict:
    """The three terms from `cross` [m, m] with cross[i, j] = L_j(θ_i) (client i's model on client j's data) and
    `global_losses` [m] = L_j(θ) of the new global model; p [m] the client weights of L (default all 1, the
    official logging). Returns floats local, shift, aggregation and global (their sum equals global exactly up
    to rounding)."""
    cross, global_losses = cross.double(), global_losses.double()
    m = cross.shape[0]
    if cross.shape != (m, m) or global_losses.shape != (m,):
        raise ValueError(f"cross must be [m, m] and global_losses [m], got {tuple(cross.shape)}, {tuple(global_losses.shape)}")
    p = torch.ones(m, dtype=torch.float64) if p is None else torch.as_tensor(p, dtype=torch.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError("decompose: client weights p must be non-negative with a positive sum")
    q = p / p.sum()
    local = float(p @ cross.diagonal())                  # Σ_i p_i L_i(θ_i)
    on_all = cross @ p                                   # L(θ_i) = Σ_j p_j L_j(θ_i)
    shift = float(q @ on_all) - local
    glob = float(p @ global_losses)
    return {"local": local, "shift": shift, "aggregation": glob - float(q @ on_all), "global": glob}


def client_losses(model: torch.nn.Module, theta: torch.Tensor, data: list) -> torch.Tensor:
    """[len(data)] mean cross-entropy of the model at flat θ on each (x, y) in `data`."""
    params = unflatten(theta, param_spec(model))
    with torch.no_grad():
        return torch.stack([F.cross_entropy(functional_call(model, params, (x,)), y) for x, y in data])


class DecompositionProbe:
    """Wraps a rule to log the three terms every round: the wrapped rule aggregates as before; the probe keeps
    the round's θ_old and Δ_i, and `callback(round, θ_new, row)` (pass it to `simulate(callback=...)`) scores
    θ_i = θ_old + Δ_i and θ_new on each round client's training data `data[k] = (x, y)` (one forward per model
    over all clients' rows). `rows` collects {round, local, shift, aggregation, global}. p: "size" (p_j = n_j/n,
    L = the pooled training loss) or "ones" (the official logging)."""
    uses_context = True

    def __init__(self, rule, model: torch.nn.Module, data: list, p: str = "size"):
        if p not in ("size", "ones"):
            raise ValueError(f"p must be 'size' or 'ones', got {p!r}")
        self.rule, self.model, self.p = rule, model, p
        self.x = torch.cat([x for x, _ in data]) if data else None
        self.y = torch.cat([y for _, y in data]) if data else None
        self.counts = torch.tensor([len(y) for _, y in data], dtype=torch.float64)
        self.owner = torch.repeat_interleave(torch.arange(len(data)), self.counts.long())
        self.rows, self._pending = [], None

    def init_state(self, theta, num_clients):
        return self.rule.init_state(theta, num_clients) if hasattr(self.rule, "init_state") else {}

    def aggregate(self, state, deltas, weights, info):
        self._pending = (info.client_ids, info.theta.detach().clone(), deltas.detach().clone())
        if hasattr(self.rule, "aggregate"):
            return self.rule.aggregate(state, deltas, weights)
        return self.rule(deltas, weights), state

    def per_client_loss(self, theta: torch.Tensor) -> torch.Tensor:
        """[K] float64 mean cross-entropy of the model at θ on each client's training rows."""
        with torch.no_grad():
            logits = functional_call(self.model, unflatten(theta, param_spec(self.model)), (self.x,))
            rows = F.cross_entropy(logits, self.y, reduction="none").double()
        return torch.zeros(len(self.counts), dtype=torch.float64).index_add_(0, self.owner, rows) / self.counts

    def callback(self, round, theta, row):
        ids, old, deltas = self._pending
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        cross = torch.stack([self.per_client_loss(old + d)[ids] for d in deltas])
        p = self.counts[ids] / self.counts[ids].sum() if self.p == "size" else None
        self.rows.append({"round": round, **decompose(cross, self.per_client_loss(theta)[ids], p)})
