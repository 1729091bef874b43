"""Local-only training — the baseline every personalisation table needs (no federation at all).

Each client trains its own model, starting from the common initialisation θ₀ and continuing from its own
stored copy every round it is sampled; nothing is sent (an empty message: bytes_up = 0) and the server
step is a no-op, so the "global" model stays θ₀. Personal evaluation scores each client's own model on
its own test split (a never-sampled client is scored with θ₀). No paper: the standard reference point
(e.g. the "Local" rows of Collins et al., ICML 2021, and of Li et al.'s Ditto, ICML 2021)."""
from __future__ import annotations

from ...core.groups import ParamGroups
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerKeep, weighted_mean
from ...core.registry import register


@register("local_only", claims="personalisation_baselines")
def local_only() -> Method:
    """Every tensor kept local (`ParamGroups(local=["*"])`): trained from the stored copy, stored back, never sent."""
    return Method("local_only", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerKeep(),
                  groups=ParamGroups(local=("*",)))
