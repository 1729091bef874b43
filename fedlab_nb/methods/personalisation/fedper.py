"""FedPer — Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019 (no official code).

The base layers (body) are trained by FedAvg; the personalisation layers (head) are trained by each client
and never leave it. One round: client k starts from (θ_body, h_k), runs E epochs of SGD on both, sends
Δ_body and stores h_k; the server averages the body updates only. Personal model = (θ_body, h_k)."""
from __future__ import annotations

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean
from ..heads import HEAD, HeadSplit, as_patterns


@register("fedper", claims="personalisation_baselines")
def fedper(head=None, server_lr: float = 1.0) -> Method:
    """`head`: glob patterns of the personalisation layers (None: the model's last layer)."""
    return Method("fedper", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=HeadSplit(local=(HEAD,), head=as_patterns(head)))
