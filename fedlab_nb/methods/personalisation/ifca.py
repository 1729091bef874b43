"""IFCA — Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated Learning",
NeurIPS 2020 (Algorithm 2, model averaging). Official code: https://github.com/jichan3751/ifca

The server keeps k cluster models θ_1 … θ_k and sends all of them to each sampled client. Client i
estimates its cluster as the model with the lowest loss on its local training data,
ĵ_i = argmin_j F_i(θ_j), runs its local SGD from θ_ĵ and returns the trained model with ĵ. The server
averages, per cluster, the models of the clients that chose it (uniformly, as the official code's
`average_model_weights`); a cluster nobody chose keeps its model.

In fedlab_nb the k models are server state (`state["objective"]["models"]`, broadcast as `down["models"]`),
each client's last choice is its store entry "cluster" (−1 until it first trains), and the message is
Δ_i = w_i − θ plus the cluster id: the server rebuilds w_i = θ + Δ_i. The engine's single global model θ
is the plain average of the participants' trained models — a one-model reference row, not part of IFCA.
Each client's personal model is the cluster model it picks on its own data at evaluation (every client,
sampled or not). Initial models: the official code initialises the network k times; here θ_1 = θ₀ and
θ_j = θ₀ + σ·std(θ₀)·ε_j (ε_j ~ N(0, I), keyed by `init_seed`), or pass `init_models` [k, d].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.method import LocalObjective, Method, OwnTraining, RoundInfo, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register


@torch.no_grad()
def choose_cluster(loss_fn, models: torch.Tensor, x, y) -> int:
    """argmin_j F(θ_j; x, y): the index of the cluster model with the lowest loss on (x, y)."""
    return int(torch.stack([loss_fn(m, x, y) for m in models]).argmin())


def cluster_average(models: torch.Tensor, theta: torch.Tensor, deltas: torch.Tensor, cluster: torch.Tensor):
    """θ_j ← mean of the clients' models w_i = θ + Δ_i over the clients with cluster j (unchanged if none)."""
    new = models.clone()
    for j in cluster.unique().tolist():
        new[j] = theta + deltas[cluster == j].mean(0)
    return new


@dataclass
class ClusterModels(LocalObjective):
    """Server state: the k cluster models (broadcast); server_update: their per-cluster averages."""
    k: int = 2
    init_noise: float = 0.1
    init_seed: int = 0
    init_models: torch.Tensor | None = None

    def init_state(self, theta, num_clients):
        if self.init_models is not None:
            return {"models": self.init_models.to(theta.device, theta.dtype).clone()}
        g = torch.Generator(device="cpu").manual_seed(self.init_seed)
        eps = torch.randn(self.k, theta.numel(), generator=g, dtype=theta.dtype).to(theta.device)
        eps[0] = 0
        return {"models": theta + self.init_noise * theta.std() * eps}

    def broadcast(self, state):
        return {"models": state["models"]}

    def server_update(self, state, msgs, info: RoundInfo):
        return {"models": cluster_average(state["models"], info.theta, msgs["delta"], msgs["cluster"])}


@dataclass
class IFCAClient(OwnTraining):
    trains_at_evaluation = True   # personal models need each client's data and the broadcast k models

    def client_state(self, method, theta, groups):
        return {"cluster": torch.tensor(-1, dtype=torch.int64)}

    def local_train(self, method, ctx, jobs, down, cstate):
        models, theta = down["models"], down["theta"]
        chosen = torch.tensor([choose_cluster(ctx.loss_fn, models, j.x, j.y) for j in jobs], device=theta.device)
        W, losses = ctx.train(theta, jobs, LocalObjective(), start=models[chosen])
        return {"delta": W - theta, "cluster": chosen}, {"cluster": chosen}, losses

    def personal_at_evaluation(self, method, theta, cstate, ctx, down):
        """Each client's choice among the broadcast k models, on its own training data."""
        models = down["models"]
        return torch.stack([models[choose_cluster(ctx.loss_fn, models, x, y)] for x, y in ctx.fed.client_train])


def assignments(loss_fn, models: torch.Tensor, fed) -> np.ndarray:
    """Every client's cluster choice [K] on its local training data (for cluster-recovery scores)."""
    return np.array([choose_cluster(loss_fn, models, x, y) for x, y in fed.client_train])


@register("ifca", claims="clustered_fl")
def ifca(k: int = 2, init_noise: float = 0.1, init_seed: int = 0, init_models: torch.Tensor | None = None) -> Method:
    if init_models is not None:
        k = len(init_models)
    if k < 1:
        raise ValueError(f"IFCA needs k >= 1 cluster models, got {k}")
    return Method("ifca", ClusterModels(int(k), float(init_noise), int(init_seed), init_models), UniformWeighting(),
                  weighted_mean, ServerSGD(lr=1.0), client=IFCAClient())
