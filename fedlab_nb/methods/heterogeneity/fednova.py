"""FedNova — Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020.

With plain local SGD, ‖a_k‖₁ = τ_k (the client's number of steps). Clients that do more steps would
otherwise pull θ towards their own optimum; FedNova averages the *normalised* updates d_k = Δ_k / τ_k
and rescales by τ_eff = Σ_k p_k τ_k:  θ ← θ + τ_eff Σ_k p_k d_k.
"""
import torch

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean


def step_normalisation(deltas: torch.Tensor, weights: torch.Tensor, steps: torch.Tensor):
    """(d_k = Δ_k/τ_k, τ_eff = Σ p_k τ_k) for `Method.normalisation`."""
    p = weights / weights.sum()
    return deltas / steps[:, None], float(p @ steps)


@register("fednova", claims="baselines")
def fednova(server_lr: float = 1.0) -> Method:
    return Method("fednova", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  normalisation=step_normalisation)
