"""FedAvg — McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017.

Sampled clients run E epochs of local SGD from θ; the server sets θ ← Σ_k (n_k / Σ_j n_j) θ_k, i.e.
θ ← θ + Σ_k p_k Δ_k. Every part is the default one.
"""
from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean


@register("fedavg", claims="fedavg_noniid")
def fedavg(server_lr: float = 1.0) -> Method:
    return Method("fedavg", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr))
