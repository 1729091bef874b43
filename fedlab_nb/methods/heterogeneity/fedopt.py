"""FedAdam, FedYogi, FedAdagrad — Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan,
"Adaptive Federated Optimization", ICLR 2021 (Algorithm 2).

Clients run plain SGD; the server treats Δ̄ = Σ p_k Δ_k as a pseudo-gradient step and applies an adaptive
optimiser to it (no bias correction, as in the paper):
    m ← β₁m + (1 − β₁)Δ̄
    v ← v + Δ̄²                          (Adagrad)
    v ← β₂v + (1 − β₂)Δ̄²                (Adam)
    v ← v − (1 − β₂)Δ̄² sign(v − Δ̄²)     (Yogi)
    θ ← θ + η_g m / (√v + τ)
τ is the adaptivity ("ε"); v starts at τ² (the paper's v₋₁ ≥ τ²).
"""
from dataclasses import dataclass

import torch

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, weighted_mean


@dataclass
class ServerAdaptive:
    kind: str = "adam"   # "adam" | "yogi" | "adagrad"
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self):
        if self.kind not in ("adam", "yogi", "adagrad"):
            raise ValueError(f"kind must be 'adam', 'yogi' or 'adagrad', got {self.kind!r}")
        if self.tau <= 0:
            raise ValueError(f"tau (adaptivity) must be > 0, got {self.tau}")

    def init_state(self, theta, num_clients):
        return {"m": torch.zeros_like(theta), "v": torch.full_like(theta, self.tau ** 2)}

    def step(self, theta, update, state):
        m = self.beta1 * state["m"] + (1 - self.beta1) * update
        sq = update * update
        v = state["v"]
        if self.kind == "adagrad":
            v = v + sq
        elif self.kind == "adam":
            v = self.beta2 * v + (1 - self.beta2) * sq
        else:
            v = v - (1 - self.beta2) * sq * torch.sign(v - sq)
        return theta + self.lr * m / (v.sqrt() + self.tau), {"m": m, "v": v}


def _fedopt(kind: str, server_lr: float, beta1: float, beta2: float, tau: float) -> Method:
    return Method(f"fed{kind}", LocalObjective(), DataSizeWeighting(), weighted_mean,
                  ServerAdaptive(kind, server_lr, beta1, beta2, tau))


@register("fedadam", claims="baselines")
def fedadam(server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> Method:
    return _fedopt("adam", server_lr, beta1, beta2, tau)


@register("fedyogi")
def fedyogi(server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> Method:
    return _fedopt("yogi", server_lr, beta1, beta2, tau)


@register("fedadagrad")
def fedadagrad(server_lr: float = 0.01, beta1: float = 0.0, beta2: float = 0.99, tau: float = 1e-3) -> Method:
    return _fedopt("adagrad", server_lr, beta1, beta2, tau)
