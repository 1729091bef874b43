"""CFL — Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask
Optimization Under Privacy Constraints", IEEE TNNLS 2021 (arXiv 1910.01991, Algorithm 1).
Official code: https://github.com/felisat/clustered-federated-learning

Clients start with one cluster and one model. Each client trains from its cluster's model and reports its
update Δ_i. A cluster c is bi-partitioned when FedAvg on it has reached a stationary point of the joint
objective while its clients are not at their own ones:

    ‖(1/|c|) Σ_{i∈c} Δ_i‖ < ε₁   and   max_{i∈c} ‖Δ_i‖ > ε₂            (and |c| > 2)

The split c → (c₁, c₂) separates the clients by the cosine similarity of their updates, complete-linkage
on the similarity matrix as in the official code (`AgglomerativeClustering(linkage="complete")` on −S; here
scipy's `linkage` on 1 − S, the same merge order); each part then gets the old model plus its own members'
mean update (uniform mean, the official `reduce_add_average`). Defaults ε₁ = 0.4, ε₂ = 1.6 and a 20-round
warm-up before any split are the official notebook's. (That notebook appends the split's local indices
as client ids; here they are mapped back to client ids.)

In fedlab_nb the cluster models and each client's cluster id are server state (`state["objective"]`,
broadcast); a split applies to the round's participants of the cluster, the others stay in c₁. The
message is Δ_i relative to θ; the server recovers the cluster update w_i − θ_c. The engine's single
global θ is the plain average of the participants' models, a one-model reference; each client's personal
model is its cluster's model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from ...core.method import LocalObjective, Method, OwnTraining, RoundInfo, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register


def cosine_matrix(updates: torch.Tensor) -> np.ndarray:
    """S_ij = ⟨Δ_i, Δ_j⟩ / (‖Δ_i‖‖Δ_j‖) of the rows of [n, d]."""
    u = updates / (updates.norm(dim=1, keepdim=True) + 1e-12)
    return (u @ u.T).cpu().double().numpy()


def bipartition(similarity: np.ndarray) -> np.ndarray:
    """Complete-linkage split of n ≥ 2 items into two groups by similarity: a 0/1 label per item (item 0 in 0)."""
    dist = np.clip(1.0 - similarity, 0.0, None)
    np.fill_diagonal(dist, 0.0)
    labels = fcluster(linkage(squareform(dist, checks=False), "complete"), 2, "maxclust") - 1
    return labels if labels[0] == 0 else 1 - labels


def should_split(updates: torch.Tensor, eps1: float, eps2: float) -> bool:
    """Stationary for the cluster (mean update norm < ε₁), not for its clients (max norm > ε₂), > 2 clients."""
    return len(updates) > 2 and float(updates.mean(0).norm()) < eps1 and float(updates.norm(dim=1).max()) > eps2


@dataclass
class ClusterTree(LocalObjective):
    eps1: float = 0.4
    eps2: float = 1.6
    warmup: int = 20
    max_clusters: int | None = None

    def init_state(self, theta, num_clients):
        return {"models": theta[None].clone(), "assign": torch.zeros(num_clients, dtype=torch.int64)}

    def broadcast(self, state):
        return {"models": state["models"], "assign": state["assign"]}

    def server_update(self, state, msgs, info: RoundInfo):
        models, assign = state["models"].clone(), state["assign"].clone()
        ids = torch.as_tensor(info.client_ids, dtype=torch.int64)
        a = assign[ids].to(models.device)
        dW = info.theta + msgs["delta"] - models[a]          # each client's update from its cluster's model
        for c in a.unique().tolist():
            rows = (a == c).nonzero().ravel()
            room = self.max_clusters is None or len(models) < self.max_clusters
            if room and info.round >= self.warmup and should_split(dW[rows], self.eps1, self.eps2):
                second = rows[torch.as_tensor(bipartition(cosine_matrix(dW[rows])), device=rows.device) == 1]
                first = rows[~torch.isin(rows, second)]
                models = torch.cat([models, (models[c] + dW[second].mean(0))[None]])
                assign[ids[second.cpu()]] = len(models) - 1
                rows = first
            models[c] = models[c] + dW[rows].mean(0)
        return {"models": models, "assign": assign}


@dataclass
class CFLClient(OwnTraining):
    trains_at_evaluation = True   # personal models come from the broadcast (`personal_at_evaluation` gets it)

    def local_train(self, method, ctx, jobs, down, cstate):
        models, theta = down["models"], down["theta"]
        ids = torch.tensor([j.client_id for j in jobs])
        start = models[down["assign"][ids].to(models.device)]
        W, losses = ctx.train(theta, jobs, LocalObjective(), start=start)
        return {"delta": W - theta}, cstate, losses

    def personal_at_evaluation(self, method, theta, cstate, ctx, down):
        """Each client's cluster model, as the server last assigned it."""
        return down["models"][down["assign"].to(down["models"].device)]


@register("cfl", claims="clustered_fl")
def cfl(eps1: float = 0.4, eps2: float = 1.6, warmup: int = 20, max_clusters: int | None = None) -> Method:
    if not eps1 > 0 or eps2 < 0 or warmup < 0:
        raise ValueError(f"CFL needs eps1 (ε₁) > 0, eps2 (ε₂) >= 0 and warmup >= 0; got {eps1}, {eps2}, {warmup}")
    return Method("cfl", ClusterTree(float(eps1), float(eps2), int(warmup), max_clusters), UniformWeighting(),
                  weighted_mean, ServerSGD(lr=1.0), client=CFLClient())
