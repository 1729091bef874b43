"""FedAvgM — Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification", arXiv 2019: server momentum v ← βv + Δ̄, θ ← θ + η_g v."""
from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean


@register("fedavgm")
def fedavgm(server_lr: float = 1.0, momentum: float = 0.9) -> Method:
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return Method("fedavgm", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(server_lr, momentum))
