"""SCAFFOLD — Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020.

Control variates correct client drift: the local step is y ← y − η(g_k(y) − c_k + c). After τ_k steps,
option II sets c_k⁺ = c_k − c + (θ − y)/(τ_k η) = c_k − c − Δ_k/(τ_k η); the server moves
c ← c + (|S|/N)·mean_k(c_k⁺ − c_k) and θ with the mean update (step size η_g).
"""
from dataclasses import dataclass

import torch

from .base import LocalObjective, Method, RoundInfo, ServerSGD, UniformWeighting, weighted_mean


@dataclass
class ControlVariateObjective(LocalObjective):
    """State: server variate `c` [d] and client variates `c_k` (a dict, filled on first participation with 0)."""

    def init_state(self, theta, num_clients):
        return {"c": torch.zeros_like(theta), "c_k": {}}

    def _c_k(self, state, k, theta):
        return state["c_k"].get(int(k), torch.zeros_like(theta))

    def client_context(self, state, client_ids, theta):
        return torch.stack([state["c"] - self._c_k(state, k, theta) for k in client_ids])  # c − c_k

    def correction(self, w, anchor, ctx):
        return ctx

    def after_local(self, state, deltas, info: RoundInfo):
        c, c_new, delta_c = state["c"], dict(state["c_k"]), []
        for k, delta, tau in zip(info.client_ids, deltas, info.steps):
            old = self._c_k(state, k, c)
            c_new[int(k)] = old - c - delta / (tau * info.lr)
            delta_c.append(c_new[int(k)] - old)
        c = c + (len(info.client_ids) / info.num_clients) * torch.stack(delta_c).mean(0)
        return deltas, {"c": c, "c_k": c_new}


def scaffold(server_lr: float = 1.0) -> Method:
    return Method("scaffold", ControlVariateObjective(), UniformWeighting(), weighted_mean, ServerSGD(lr=server_lr))
