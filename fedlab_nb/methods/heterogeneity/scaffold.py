"""SCAFFOLD — Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020.

Control variates correct client drift: the local step is y ← y − η(g_k(y) − c_k + c). After τ_k steps,
option II sets c_k⁺ = c_k − c + (θ − y)/(τ_k η) = c_k − c − Δ_k/(τ_k η); the client keeps c_k⁺ (its
store entry) and sends Δ_k and Δc_k = c_k⁺ − c_k; the server moves c ← c + (|S|/N)·mean_k Δc_k and θ with
the mean update (step size η_g).
"""
from dataclasses import dataclass

import torch

from ...core.registry import register
from ...core.method import LocalObjective, Method, RoundInfo, ServerSGD, UniformWeighting, weighted_mean


@dataclass
class ControlVariateObjective(LocalObjective):
    """Server state: the variate `c` [d] (broadcast); client state: its own `c_k` [d] (0 until it trains)."""

    def init_state(self, theta, num_clients):
        return {"c": torch.zeros_like(theta)}

    def client_state(self, theta):
        return {"c_k": torch.zeros_like(theta)}

    def broadcast(self, state):
        return {"c": state["c"]}

    def context(self, down, cstate):
        return down["c"] - cstate["c_k"]  # c − c_k, one row per client

    def correction(self, w, anchor, ctx):
        return ctx

    def finish(self, deltas, down, cstate, steps, lr):
        old = cstate["c_k"]
        new = old - down["c"] - deltas / (steps[:, None] * lr)
        return {"delta_c": new - old}, {"c_k": new}

    def server_update(self, state, msgs, info: RoundInfo):
        c = state["c"] + (len(info.client_ids) / info.num_clients) * msgs["delta_c"].mean(0)
        return {"c": c}


@register("scaffold", claims="baselines")
def scaffold(server_lr: float = 1.0) -> Method:
    return Method("scaffold", ControlVariateObjective(), UniformWeighting(), weighted_mean, ServerSGD(lr=server_lr))
