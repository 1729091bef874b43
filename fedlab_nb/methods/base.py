"""The parts a federated method is composed of (DESIGN.md "The round, as data flows through it").

    local objective ─► updates Δ_k ─► weighting ─► (normalisation) ─► rule ─► server optimiser ─► θ

Each part is a small object with an optional `init_state` and pure tensor functions; all the state of a
run lives in one dict the engine checkpoints. A method is a `Method(...)` of parts, not a subclass tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class RoundInfo:
    """What the server knows about one round when it aggregates."""
    round: int
    client_ids: np.ndarray          # sampled clients that returned an update, [m]
    sizes: torch.Tensor             # their local data sizes n_k, [m] float
    steps: torch.Tensor             # local SGD steps each took τ_k, [m] float
    num_clients: int                # K, all clients in the federation
    lr: float                       # client step size η


# --- local objectives ------------------------------------------------------------------------------
@dataclass
class LocalObjective:
    """Plain local ERM (FedAvg): the client step is w ← w − η ∇f_k(w; batch).

    Subclasses add a gradient term through `correction(w, anchor, ctx)` — a pure function of the local
    weights w, the broadcast global weights (anchor) and a per-client context tensor, so the same code
    runs per client (`loop`) or vmapped over clients (`vmap`)."""
    vmappable = True

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def client_context(self, state: dict, client_ids: np.ndarray, theta: torch.Tensor) -> torch.Tensor | None:
        """Per-client tensor [m, d] fed to `correction` (None: no correction)."""
        return None

    def correction(self, w: torch.Tensor, anchor: torch.Tensor, ctx: torch.Tensor | None) -> torch.Tensor | None:
        return None

    def after_local(self, state: dict, deltas: torch.Tensor, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        """Bookkeeping once the round's updates are in (control variates, worker momentum ...)."""
        return deltas, state


# --- weighting -------------------------------------------------------------------------------------
@dataclass
class DataSizeWeighting:
    """p_k ∝ n_k over the clients of the round (FedAvg)."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        return info.sizes, state


@dataclass
class UniformWeighting(DataSizeWeighting):
    """p_k = 1/m: every participating client counts the same."""

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        return torch.ones_like(info.sizes), state


# --- rules -----------------------------------------------------------------------------------------
def weighted_mean(updates: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k Δ_k / Σ_k w_k over the rows of the [m, d] update matrix."""
    if weights is None:
        return updates.mean(0)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError("aggregation weights must be non-negative with a positive sum")
    return (weights / weights.sum()) @ updates


# --- server optimisers -----------------------------------------------------------------------------
@dataclass
class ServerSGD:
    """θ ← θ + η_g v with v ← βv + Δ̄ (β = 0: FedAvg; β > 0: FedAvgM, Hsu et al. 2019)."""
    lr: float = 1.0
    momentum: float = 0.0

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"v": torch.zeros_like(theta)} if self.momentum else {}

    def step(self, theta: torch.Tensor, update: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        if self.momentum:
            state = {"v": self.momentum * state["v"] + update}
            update = state["v"]
        return theta + self.lr * update, state


# --- the composition -------------------------------------------------------------------------------
@dataclass
class Method:
    """A federated method = local objective + weighting + (normalisation) + rule + server optimiser.

    `normalisation(updates, weights, steps) -> (updates, scale)` rescales updates before the rule and the
    aggregate after it (FedNova). `rule(updates, weights)` is any function on the [m, d] matrix, e.g. the
    robust rules in `fedlab_nb.robust.rules`; a rule object with `init_state`/`aggregate` may keep state."""
    name: str = "fedavg"
    objective: LocalObjective = field(default_factory=LocalObjective)
    weighting: DataSizeWeighting = field(default_factory=DataSizeWeighting)
    rule: Callable = weighted_mean
    server_opt: ServerSGD = field(default_factory=ServerSGD)
    normalisation: Callable | None = None

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        parts = {"objective": self.objective, "weighting": self.weighting, "server_opt": self.server_opt}
        if hasattr(self.rule, "init_state"):
            parts["rule"] = self.rule
        return {k: p.init_state(theta, num_clients) for k, p in parts.items()}

    def aggregate(self, state: dict, deltas: torch.Tensor, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        """The server side of a round after local training: Δ's in, the aggregate update out."""
        weights, state["weighting"] = self.weighting(state["weighting"], info)
        scale = 1.0
        if self.normalisation is not None:
            deltas, scale = self.normalisation(deltas, weights, info.steps)
        if hasattr(self.rule, "aggregate"):
            agg, state["rule"] = self.rule.aggregate(state["rule"], deltas, weights)
        else:
            agg = self.rule(deltas, weights)
        return scale * agg, state

    def server_step(self, state: dict, theta: torch.Tensor, agg: torch.Tensor) -> tuple[torch.Tensor, dict]:
        theta, state["server_opt"] = self.server_opt.step(theta, agg, state["server_opt"])
        return theta, state
