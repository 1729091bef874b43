"""FedAU — Shiqiang Wang, Mingyue Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in
Federated Averaging", ICLR 2024. Official code: https://github.com/IBM/fedau

Client n takes part in a round with an unknown probability p_n. Averaging the participants' updates weights
client n by ∝ p_n in expectation, so FedAvg minimises Σ p_n F_n instead of the target (1/N) Σ F_n. FedAU
weights each participant's update by ω̂_n, an online estimate of 1/p_n, and divides by N (not by |S_t|):

    θ ← θ + η_g · (1/N) Σ_{n ∈ S_t} ω̂_n Δ_n

ω̂_n is the mean of client n's *participation intervals* (rounds between two participations). A run of K
consecutive missed rounds (K = `cutoff`) is recorded as an interval of length K and the count restarts, so
ω̂_n estimates E[min(interval, K)] = (1 − (1 − p_n)^K) / p_n ≈ 1/p_n for p_n ≫ 1/K. A client with no interval
yet gets ω̂_n = 1; the interval that ends in round t is recorded after round t's weight has been used.

The engine calls a weighting only in rounds that have participants and shows it only their ids, so
`FedAUWeighting` keeps each client's last participation round and, when the client next appears, replays
the missed rounds in between (how many cutoff intervals they held, and the interval that ends now): the
same bookkeeping as a per-round counter, without seeing non-participating rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...data.federated import FederatedDataset
from ...engine import simulate
from ...engine.sampling import BernoulliSampler
from ...utils import check_positive_int, rng
from ...core.registry import register
from ...core.method import Method, RoundInfo, ServerSGD, UniformWeighting, weighted_mean


# --- weightings ----------------------------------------------------------------------------------
@dataclass
class FedAUWeighting:
    """ω̂_n / N for each participant n, with ω̂_n the mean of its participation intervals truncated at `cutoff`."""
    cutoff: int = 50

    def __post_init__(self):
        check_positive_int("cutoff", self.cutoff)

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        zeros = torch.zeros(num_clients, dtype=torch.float64)
        return {"last": torch.full((num_clients,), -1, dtype=torch.int64),  # round of the last participation
                "interval_sum": zeros.clone(), "interval_count": zeros.clone()}

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        ids = torch.as_tensor(np.asarray(info.client_ids), dtype=torch.int64)
        missed = info.round - state["last"][ids] - 1                # rounds skipped since the last participation
        if (missed < 0).any():
            raise ValueError(f"FedAUWeighting: round {info.round} is not after a round these clients already "
                             "took part in; call it once per round, in order")
        n_cut = torch.div(missed, self.cutoff, rounding_mode="floor")  # each run of `cutoff` misses → one interval
        total = state["interval_sum"][ids] + self.cutoff * n_cut
        count = state["interval_count"][ids] + n_cut
        omega = torch.where(count > 0, total / count.clamp_min(1), torch.ones_like(total))
        state = {k: v.clone() for k, v in state.items()}
        state["interval_sum"][ids] = total + (missed - self.cutoff * n_cut + 1)  # the interval ending now
        state["interval_count"][ids] = count + 1
        state["last"][ids] = info.round
        return (omega / info.num_clients).to(info.sizes), state

    @staticmethod
    def estimates(state: dict) -> np.ndarray:
        """Current ω̂_n of every client (1 where no interval is recorded yet)."""
        s, c = state["interval_sum"], state["interval_count"]
        return torch.where(c > 0, s / c.clamp_min(1), torch.ones_like(s)).numpy()


@dataclass
class KnownProbabilityWeighting:
    """The oracle: 1 / (N p_n), with the true participation probabilities p_n."""
    probabilities: np.ndarray

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        p = np.asarray(self.probabilities, dtype=float)
        if p.shape != (num_clients,) or (p <= 0).any() or (p > 1).any():
            raise ValueError(f"probabilities must be {num_clients} values in (0, 1], got shape {p.shape}")
        return {}

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        p = torch.as_tensor(np.asarray(self.probabilities, dtype=float)[np.asarray(info.client_ids)])
        return (1.0 / (info.num_clients * p)).to(info.sizes), state


def weighted_sum(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k Δ_k, not normalised: with w_k = ω_k / N this is FedAU's (1/N) Σ_{n∈S} ω_n Δ_n."""
    if (weights < 0).any():
        raise ValueError("aggregation weights must be non-negative")
    return weights.to(updates.dtype) @ updates


def truncated_inverse(p, cutoff: int) -> np.ndarray:
    """E[min(interval, K)] = (1 − (1 − p)^K) / p: the value ω̂_n converges to for a Bernoulli(p) client."""
    p = np.asarray(p, dtype=float)
    return (1 - (1 - p) ** cutoff) / p


# --- methods -------------------------------------------------------------------------------------
@register("fedau", claims="fedau")
def fedau(cutoff: int = 50, server_lr: float = 1.0) -> Method:
    """FedAU: FedAvg with online participation-interval weights (unknown p_n)."""
    return Method("fedau", weighting=FedAUWeighting(cutoff), rule=weighted_sum, server_opt=ServerSGD(lr=server_lr))


def known_probability(probabilities, server_lr: float = 1.0) -> Method:
    """The oracle with the true p_n: (1/N) Σ_{n∈S} Δ_n / p_n, unbiased for (1/N) Σ_n Δ_n."""
    return Method("known_p", weighting=KnownProbabilityWeighting(np.asarray(probabilities, dtype=float)),
                  rule=weighted_sum, server_opt=ServerSGD(lr=server_lr))


def fedavg_participants(server_lr: float = 1.0) -> Method:
    """FedAvg over whoever took part: the plain mean of the participants' updates (biased toward large p_n)."""
    return Method("fedavg_participants", weighting=UniformWeighting(), rule=weighted_mean,
                  server_opt=ServerSGD(lr=server_lr))


# --- a problem with a closed-form optimum --------------------------------------------------------
def half_squared_distance(outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """ℓ(x; c) = ½‖x − c‖² per row (a torch.nn.functional-style loss for `simulate(loss=...)`)."""
    per_row = 0.5 * (outputs - y).pow(2).sum(-1)
    return per_row if reduction == "none" else per_row.sum() if reduction == "sum" else per_row.mean()


class QuadraticPoint(nn.Module):
    """The quadratic problem's model: one parameter x [d], returned as the output for every input row."""

    def __init__(self, d: int, dtype=torch.float64):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(d, dtype=dtype))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.x.expand(len(inputs), -1)


def quadratic_clients(centers: np.ndarray) -> FederatedDataset:
    """Client n holds one row (input 1, target c_n), so its loss ½‖x − c_n‖² is F_n; the global test row
    has the target x* = mean(c_n)."""
    one = np.ones((1, 1))
    return FederatedDataset.from_clients([(one, c[None]) for c in centers], test=(one, centers.mean(0, keepdims=True)),
                                         name="quadratic")


def quadratic_run(method: Method, centers: np.ndarray, probabilities: np.ndarray, rounds: int = 3000,
                  local_steps: int = 5, lr: float = 0.1, seed: int = 0) -> dict:
    """Clients F_n(x) = ½‖x − c_n‖², Bernoulli(p_n) participation, `local_steps` exact GD steps per round,
    run by `simulate` in float64 (x₀ = 0; a client's update is Δ = (1 − (1 − η)^τ)(c_n − x)).

    The optimum of (1/N) Σ F_n is x* = mean(c_n). Returns {"dist": ‖x_t − x*‖ per round, "x": iterates [T, d],
    "state": the method's final state, "history": the run's History}. Uses the method's own weighting /
    rule / server step."""
    centers = np.asarray(centers, dtype=float)
    if centers.ndim != 2:
        raise ValueError(f"centers must be an [N, d] array, got shape {centers.shape}")
    n, d = centers.shape
    check_positive_int("rounds", rounds)
    check_positive_int("local_steps", local_steps)
    if not 0 < lr <= 1:
        raise ValueError(f"lr must be in (0, 1] for the quadratic clients, got {lr}")
    xs = np.empty((rounds, d))

    def keep(r, theta, row):
        xs[r - 1] = theta.cpu().numpy()

    hist = simulate(method, quadratic_clients(centers), QuadraticPoint(d), rounds=rounds,
                    clients_per_round=BernoulliSampler(np.asarray(probabilities, dtype=float)), local_steps=local_steps,
                    batch_size=1, lr=lr, seed=seed, eval_every=rounds, progress=False, loss=half_squared_distance,
                    callback=keep)
    return {"dist": np.linalg.norm(xs - centers.mean(0), axis=1), "x": xs, "state": hist.state, "history": hist}
