"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021 (Algorithm 1). Official code: https://github.com/litian96/ditto

Each client k keeps a personal model v_k next to the global one. In a round the sampled clients
  1. run the global method's local update from w^t (here FedAvg's local SGD) and send Δ_k;
  2. take s steps on their personal objective  h_k(v) = F_k(v) + (λ/2)‖v − w^t‖²:
         v_k ← v_k − η (∇F_k(v_k) + λ (v_k − w^t))
λ = 0 is local training alone; λ → ∞ pulls every v_k onto the global model. The v_k live in the client
store (all K clients, checkpointed), and evaluation scores each client's v_k on its own test split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.method import ClientUpdate, DataSizeWeighting, LocalObjective, Method, ServerSGD, Track, weighted_mean
from ...core.registry import register
from ..heterogeneity.fedprox import ProximalObjective


@dataclass
class DittoClient(ClientUpdate):
    """Two tracks: "w" (the global update, from θ) and "v" (the personal model, from the stored v_k, pulled
    towards the broadcast θ with strength λ); `personal_steps` = s (None: the run's local schedule)."""
    lam: float = 0.1
    personal_steps: int | None = None

    def tracks(self, method):
        return [Track("w", LocalObjective(), method.optimizer, method.groups),
                Track("v", ProximalObjective(self.lam), method.optimizer, method.groups, self.personal_steps)]

    def client_state(self, method, theta, groups):
        return {"v": theta.clone()}  # v_k⁰ = w⁰

    def start(self, track, theta, down, cstate, done, groups, m):
        return None if track.name == "w" else cstate["v"].clone()

    def finish(self, done, theta, down, cstate, steps, lr, method, groups):
        return {"delta": done["w"].sub_(theta)}, {"v": done["v"]}

    def personal(self, method, theta, cstate, groups):
        return cstate["v"]


@register("ditto", claims="personalisation_baselines")
def ditto(lam: float = 0.1, personal_steps: int | None = None, server_lr: float = 1.0) -> Method:
    if lam < 0:
        raise ValueError(f"Ditto's lam (λ) must be >= 0 (0 = local training only), got {lam}")
    return Method("ditto", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  client=DittoClient(float(lam), personal_steps))
