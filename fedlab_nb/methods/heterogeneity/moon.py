"""MOON — Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (Algorithm 1, Eq. 3–4).
Official code: https://github.com/QinbinLi/MOON

The local loss adds a model-contrastive term to cross-entropy: with z, z_glob, z_prev the representations
of x under the local model w, the broadcast global model θ and the client's previous local model,

    ℓ_con = −log [ e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) ],
    loss  = ℓ_CE(w; x, y) + μ ℓ_con          (sim: cosine similarity)

It pulls the local representation towards the global model's and away from the previous local model's.
The previous local model is the client's store entry (its weights after its last participation). As in
the official code (`train_net_fedcon`, where the pool of previous models is empty in the first round and the
contrastive logits have one column), a client with no previous model gets no contrastive gradient: here it
contrasts against the global model itself, whose ℓ_con = log 2 has zero gradient. The paper's models add a
projection head; fedlab_nb contrasts the model's penultimate layer (`models.representation`), the
variant without projection head. Defaults τ = 0.5, μ = 1 are the official code's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean
from ...core.registry import register
from ...models import param_spec, representation, unflatten


def contrastive_loss(z, z_glob, z_prev, tau: float) -> torch.Tensor:
    """Per-row ℓ_con [B]: cross-entropy of the logits (sim(z, z_glob), sim(z, z_prev)) / τ with label 0."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], -1) / tau
    return -torch.log_softmax(logits, -1)[..., 0]


@dataclass
class ModelContrastiveObjective(LocalObjective):
    """ctx = the previous local model (θ where the client has none yet); extra_loss = μ ℓ_con per row."""
    mu: float = 1.0
    tau: float = 0.5

    def client_state(self, theta):
        return {"prev": theta.clone(), "has_prev": torch.zeros(())}

    def context(self, down, cstate):
        return torch.where(cstate["has_prev"][:, None] > 0, cstate["prev"], down["theta"])

    def extra_loss(self, model, params, x, y, anchor, ctx):
        spec = param_spec(model)
        z = representation(model, params, x)
        z_glob = representation(model, unflatten(anchor, spec), x).detach()
        z_prev = representation(model, unflatten(ctx, spec), x).detach()
        return self.mu * contrastive_loss(z, z_glob, z_prev, self.tau)

    def finish(self, deltas, down, cstate, steps, lr):
        return {}, {"prev": down["theta"] + deltas, "has_prev": torch.ones_like(cstate["has_prev"])}


@register("moon", claims="moon_feddyn")
def moon(mu: float = 1.0, tau: float = 0.5, server_lr: float = 1.0) -> Method:
    if mu < 0 or not tau > 0:
        raise ValueError(f"MOON needs mu (μ) >= 0 and tau (τ) > 0, got mu={mu}, tau={tau}")
    return Method("moon", ModelContrastiveObjective(float(mu), float(tau)), DataSizeWeighting(), weighted_mean,
                  ServerSGD(lr=server_lr))
