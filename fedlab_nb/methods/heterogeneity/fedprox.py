"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020.

Client k minimises h_k(w) = f_k(w) + (μ/2)‖w − θ‖²: the proximal term keeps local models near the
global one when data and local work differ across clients. Its gradient μ(w − θ) is the correction.
"""
from dataclasses import dataclass

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean


@dataclass
class ProximalObjective(LocalObjective):
    mu: float = 0.01

    def __post_init__(self):
        if self.mu < 0:
            raise ValueError(f"FedProx mu must be >= 0 (0 = FedAvg), got {self.mu}")

    def correction(self, w, anchor, ctx):
        return self.mu * (w - anchor)


@register("fedprox", claims="baselines")
def fedprox(mu: float = 0.01, server_lr: float = 1.0) -> Method:
    return Method("fedprox", ProximalObjective(mu), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr))
