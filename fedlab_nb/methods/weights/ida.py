"""IDA — Yousef Yeganeh, Azade Farshad, Nassir Navab, Shadi Albarqouni, "Inverse Distance Aggregation for
Federated Learning with Non-IID Data", MICCAI 2020 workshop (DCL), https://arxiv.org/abs/2008.07665.
No official code was published (the project page https://ida-fl.github.io/ says "will be published soon").

Each round the server averages the received client models plainly, θ̄ = (1/m) Σ_k θ_k, and weights client k by
the inverse of its distance to that average (flattened parameters, Euclidean norm):

    α_k = ‖θ̄ − θ_k‖⁻¹ / Σ_j ‖θ̄ − θ_j‖⁻¹,        θ ← Σ_k α_k θ_k.

Clients whose model lands far from the others (noisy or out-of-distribution data) count less. Since every
θ_k = θ + Δ_k, ‖θ̄ − θ_k‖ = ‖Δ̄ − Δ_k‖ and Σ α_k θ_k = θ + Σ α_k Δ_k: the rule works on the [m, d] update matrix.
A client exactly at the mean would get 1/0; ε is added to every distance (1/(d_k + ε)), so such a client
gets almost all the weight — the formula's limit — and m identical updates get uniform weights.

`with_sizes=True` is the variant that combines IDA with FedAvg's data-size coefficient: α_k ∝ n_k / (d_k + ε)
(the two coefficients multiplied, then normalised). IDA rewards closeness to the mean, not honesty: it is not a
Byzantine defence (an update placed near the mean gets a high weight)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.history import per_client_columns
from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD


def ida_weights(updates: torch.Tensor, sizes: torch.Tensor | None = None, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """(α [m] summing to one, distances ‖Δ_k − Δ̄‖ [m]) for the rows of the [m, d] update matrix.
    `sizes` (n_k, optional) multiplies the inverse distances before normalising (IDA × data size)."""
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2 or updates.shape[0] == 0:
        raise ValueError(f"updates must be a tensor of shape [m, d] with m >= 1, got "
                         f"{tuple(updates.shape) if isinstance(updates, torch.Tensor) else type(updates).__name__}")
    if not torch.isfinite(updates).all():
        raise ValueError("updates has NaN/Inf rows; drop them before IDA "
                         "(fedlab_nb.methods.robustness.rules.drop_nonfinite)")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps 1/distance finite for a client at the mean), got {eps}")
    dist = (updates - updates.mean(0)).norm(dim=1)
    inv = 1.0 / (dist + eps)
    if sizes is not None:
        sizes = torch.as_tensor(sizes, dtype=updates.dtype, device=updates.device)
        if sizes.shape != (updates.shape[0],) or (sizes < 0).any() or sizes.sum() <= 0:
            raise ValueError(f"sizes must be non-negative n_k of shape [{updates.shape[0]}] with a positive sum, "
                             f"got shape {tuple(sizes.shape)}")
        inv = inv * sizes
    return inv / inv.sum(), dist


@dataclass
class InverseDistanceRule:
    """The IDA rule for the `Method.rule` slot; keeps the last round's weights and distances so that
    `metrics` logs them per client in History (columns `ida_w<k>`, `ida_dist<k>`; NaN for absent clients)."""
    with_sizes: bool = False
    eps: float = 1e-8
    uses_context = True

    def __post_init__(self):
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        nan = torch.full((num_clients,), float("nan"), dtype=torch.float64)
        return {"w": nan.clone(), "dist": nan.clone()}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo):
        alpha, dist = ida_weights(updates, weights if self.with_sizes else None, self.eps)
        ids = torch.as_tensor(np.asarray(info.client_ids), dtype=torch.int64)
        new = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        new["w"][ids] = alpha.detach().double().cpu()
        new["dist"][ids] = dist.detach().double().cpu()
        return alpha @ updates, new

    def metrics(self, state: dict) -> dict:
        return per_client_columns(ida_w=state["w"], ida_dist=state["dist"])


@register("ida", claims="ida")
def ida(with_sizes: bool = False, eps: float = 1e-8, server_lr: float = 1.0) -> Method:
    """FedAvg's local training with the IDA rule: `ida()` (inverse distance only) or `ida(with_sizes=True)`
    (inverse distance × n_k). The weighting passes n_k to the rule; plain IDA ignores it."""
    name = "ida_x_size" if with_sizes else "ida"
    return Method(name, LocalObjective(), DataSizeWeighting(), InverseDistanceRule(with_sizes, eps),
                  ServerSGD(lr=server_lr))
