"""LG-FedAvg — Liang, Liu, Liu, Salakhutdinov, Morency, "Think Locally, Act Globally: Federated Learning
with Local and Global Representations", NeurIPS 2019 Workshop on Federated Learning (arXiv:2001.01523).
Official code: https://github.com/pliang279/LG-FedAvg

The mirror image of FedPer: each client keeps its own representation layers (the body, local) and only
the top layers (the head, global) are averaged. One round: client k starts from (b_k, θ_head), trains
both, sends Δ_head and stores b_k. `head` defaults to the last layer; the official code and FedRep's
re-implementation share the last *two* layers of their CNNs — pass `head=[...]` for that. (The paper also
initialises from a FedAvg-trained model; start from such a θ₀ by passing the model.)"""
from __future__ import annotations

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean
from ..heads import BODY, HeadSplit, as_patterns


@register("lg_fedavg", claims="personalisation_baselines")
def lg_fedavg(head=None, server_lr: float = 1.0) -> Method:
    """`head`: glob patterns of the shared (global) top layers (None: the model's last layer)."""
    return Method("lg_fedavg", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=HeadSplit(local=(BODY,), head=as_patterns(head)))
