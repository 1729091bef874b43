"""FAIR-BFL's contribution and reward rule — Rongxin Xu, Shiva Raj Pokhrel, Qiujun Lan, Gang Li, "FAIR-BFL: Flexible
and Incentive Redesign for Blockchain-based Federated Learning", arXiv:2206.12899 (2022),
https://arxiv.org/abs/2206.12899. No official code was found.

Taught as a contribution-and-reward rule; the blockchain appears only as its immutability concept.

* **Contribution** (what the paper's abstract asks for: a score computed from the updates, not from self-reported
  data sizes): client k's score in round t is the cosine similarity of its update Δ_k to the aggregate of the OTHER
  clients' updates, Δ̄_{−k} = Σ_{j≠k} w_j Δ_j / Σ_{j≠k} w_j (`contribution_scores`; `leave_one_out=False` gives the
  self-inclusive Δ̄ = Σ_j w_j Δ_j, which two aligned attackers can pull their way). The full text could not be read
  offline; the cosine-to-leave-one-out-aggregate form is the reading of the paper's rule used here (a construct,
  named so in the claims file).
* **Reward** with a fixed budget B per round: r_k = B · max(s_k, 0) / Σ_j max(s_j, 0) (`reward_shares`); a client
  with s_k ≤ 0 gets nothing, and Σ_k r_k = B exactly (up to float rounding).
* **Ground truth**: exact Shapley values (Shapley 1953) of a cheap utility, v(S) = validation accuracy of
  θ + mean_{k∈S} Δ_k (v(∅) = accuracy of θ), by brute force over all 2^K coalitions (`shapley_values`, K ≤ 12).
  Efficiency: Σ_k φ_k = v(N) − v(∅).
* **Ledger** (the blockchain as a concept): a SHA-256 hash chain of round records (previous hash, round, digest of
  the update matrix, scores, rewards); editing any byte of a past record breaks its hash and every later link
  (`Ledger.verify`). No consensus, mining or networking.
* **Detection**: low contribution flags free-riders and attackers; `detection_auroc` scores it with sklearn."""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from ...core.history import per_client_columns
from ...core.registry import register
from ...engine.evaluate import evaluate
from ...core.method import DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD

MAX_SHAPLEY_CLIENTS = 12   # 4,096 coalitions; beyond that use a Monte Carlo estimate


def contribution_scores(updates: torch.Tensor, weights: torch.Tensor | None = None, eps: float = 1e-12,
                        leave_one_out: bool = True) -> torch.Tensor:
    """s_k = cos(Δ_k, Δ̄_{−k}) with the leave-one-out reference Δ̄_{−k} = Σ_{j≠k} w_j Δ_j (w: `weights`, uniform if
    None; its scale does not change a cosine), for the [m, d] updates; with one update the reference is the update
    itself. `leave_one_out=False`: s_k = cos(Δ_k, Δ̄) with the self-inclusive Δ̄ = Σ_j w_j Δ_j."""
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2 or updates.shape[0] == 0:
        raise ValueError("updates must be a tensor of shape [m, d] with m >= 1")
    w = torch.full((updates.shape[0],), 1.0 / updates.shape[0], dtype=updates.dtype) if weights is None \
        else torch.as_tensor(weights, dtype=updates.dtype)
    if w.shape != (updates.shape[0],) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative of shape [{updates.shape[0]}] with a positive sum")
    w = w / w.sum()
    aggregate = w @ updates
    if not leave_one_out or updates.shape[0] == 1:
        return (updates @ aggregate) / (updates.norm(dim=1) * aggregate.norm()).clamp_min(eps)
    reference = aggregate[None, :] - w[:, None] * updates              # row k: Σ_{j≠k} w_j Δ_j
    return (updates * reference).sum(1) / (updates.norm(dim=1) * reference.norm(dim=1)).clamp_min(eps)


def reward_shares(scores, budget: float) -> np.ndarray:
    """r_k = B · max(s_k, 0) / Σ_j max(s_j, 0); if no score is positive the budget is split equally."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.isfinite(s).all():
        raise ValueError("scores must be a non-empty 1-D array of finite contribution scores")
    if not budget > 0:
        raise ValueError(f"budget must be > 0 (the fixed reward paid out each round), got {budget}")
    positive = np.maximum(s, 0.0)
    total = positive.sum()
    return budget * (positive / total if total > 0 else np.full(s.size, 1.0 / s.size))


def shapley_values(utility: Callable[[tuple], float], n_players: int) -> tuple[np.ndarray, dict]:
    """Exact Shapley values φ_k = Σ_{S ⊆ N∖k} |S|!(K−|S|−1)!/K! · (v(S ∪ k) − v(S)) by brute force over all
    coalitions; `utility(coalition)` takes a sorted tuple of player ids. Returns (φ [K], {coalition: v})."""
    if not 1 <= n_players <= MAX_SHAPLEY_CLIENTS:
        raise ValueError(f"n_players must be in 1..{MAX_SHAPLEY_CLIENTS} for exact Shapley (2^K coalitions)")
    values = {c: float(utility(c)) for r in range(n_players + 1)
              for c in itertools.combinations(range(n_players), r)}
    phi = np.zeros(n_players)
    for coalition, v in values.items():
        for k in range(n_players):
            if k in coalition:
                continue
            size = len(coalition)
            weight = math.factorial(size) * math.factorial(n_players - size - 1) / math.factorial(n_players)
            phi[k] += weight * (values[tuple(sorted(coalition + (k,)))] - v)
    return phi, values


def averaged_update_utility(model: torch.nn.Module, theta: torch.Tensor, updates: torch.Tensor, x, y) -> Callable:
    """v(S) = accuracy on (x, y) of θ + mean_{k∈S} Δ_k; v(∅) = accuracy of θ (the cheap utility of the Shapley check)."""
    def v(coalition: tuple) -> float:
        step = updates[list(coalition)].mean(0) if coalition else torch.zeros_like(theta)
        return float(evaluate(model, theta + step, x, y)[1])
    return v


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (what a block stores instead of the update itself)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@dataclass
class Ledger:
    """A hash chain of round records: record i holds `prev` = hash of record i−1 ("0"*64 for the first) and its own
    `hash` = SHA-256 of its canonical JSON without the hash. `verify()` recomputes every hash and link."""
    records: list = field(default_factory=list)

    @staticmethod
    def _hash(record: dict) -> str:
        body = {k: v for k, v in record.items() if k != "hash"}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def append(self, round: int, update_digest: str, scores, rewards) -> dict:
        record = {"round": int(round), "prev": self.records[-1]["hash"] if self.records else "0" * 64,
                  "update": update_digest, "scores": [float(s) for s in scores], "rewards": [float(r) for r in rewards]}
        record["hash"] = self._hash(record)
        self.records.append(record)
        return record

    def verify(self) -> bool:
        prev = "0" * 64
        for record in self.records:
            if record.get("prev") != prev or record.get("hash") != self._hash(record):
                return False
            prev = record["hash"]
        return True


def detection_auroc(scores, malicious) -> float:
    """AUROC of flagging malicious clients by LOW contribution (1 = every attacker scores below every honest client)."""
    malicious = np.asarray(malicious, dtype=bool)
    if malicious.all() or not malicious.any():
        raise ValueError("malicious must mark at least one attacker and one honest client")
    return float(roc_auc_score(malicious, -np.asarray(scores, dtype=np.float64)))


@dataclass
class FairBFLRule:
    """The FAIR-BFL rule for the `Method.rule` slot: FedAvg aggregation (weights from the weighting), plus each
    round's contribution scores, rewards from the fixed `budget`, a ledger record and — when `val` = (x, y) and
    `model` are given — exact Shapley values of the averaged-update utility every `shapley_every` rounds.
    `discard_below`: drop updates whose score is below this value from the aggregate (None: keep all).
    `leave_one_out`: score each update against the other clients' aggregate (default) or the self-inclusive one.
    History columns `bfl_score<k>`, `bfl_reward<k>`, `bfl_shapley<k>` (NaN where absent)."""
    budget: float = 1.0
    model: torch.nn.Module | None = None
    val: tuple | None = None
    shapley_every: int = 1
    discard_below: float | None = None
    leave_one_out: bool = True
    uses_context = True

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if self.val is not None and (self.model is None or num_clients > MAX_SHAPLEY_CLIENTS):
            raise ValueError(f"val for Shapley needs model= and at most {MAX_SHAPLEY_CLIENTS} clients")
        nan = np.full(num_clients, np.nan)
        return {"score": nan.copy(), "reward": nan.copy(), "shapley": nan.copy(), "ledger": Ledger(), "log": []}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo):
        scores = contribution_scores(updates.double(), None if weights is None else weights.double(),
                                     leave_one_out=self.leave_one_out)
        rewards = reward_shares(scores.numpy(), self.budget)
        ids = np.asarray(info.client_ids)
        new = {**state, **{k: np.full(info.num_clients, np.nan) for k in ("score", "reward", "shapley")}}
        new["score"][ids], new["reward"][ids] = scores.numpy(), rewards
        entry = {"round": info.round, "ids": ids.copy(), "score": scores.numpy(), "reward": rewards}
        if self.val is not None and info.round % self.shapley_every == 0:
            v = averaged_update_utility(self.model, info.theta, updates, *self.val)
            phi, values = shapley_values(v, len(ids))
            new["shapley"][ids] = phi
            entry.update(shapley=phi, v_all=values[tuple(range(len(ids)))], v_empty=values[()])
        state["ledger"].append(info.round, digest(updates), scores.tolist(), rewards.tolist())
        state["log"].append(entry)
        keep = torch.ones(len(ids), dtype=torch.bool) if self.discard_below is None else scores >= self.discard_below
        w = (torch.ones(len(ids)) if weights is None else weights.detach().cpu().double()) * keep
        w = w / w.sum() if w.sum() > 0 else torch.full((len(ids),), 1.0 / len(ids), dtype=torch.float64)
        return w.to(updates) @ updates, new

    def metrics(self, state: dict) -> dict:
        return per_client_columns(bfl_score=state["score"], bfl_reward=state["reward"], bfl_shapley=state["shapley"])


@register("fair_bfl", claims="fair_bfl", kind="module")
def fair_bfl(budget: float = 1.0, model: torch.nn.Module | None = None, val: tuple | None = None,
             shapley_every: int = 1, discard_below: float | None = None, leave_one_out: bool = True) -> Method:
    """FedAvg's local training and size weights, aggregated by `FairBFLRule` (scores, rewards, ledger, Shapley)."""
    return Method("fair_bfl", LocalObjective(), DataSizeWeighting(),
                  FairBFLRule(budget, model, val, shapley_every, discard_below, leave_one_out), ServerSGD(lr=1.0))
