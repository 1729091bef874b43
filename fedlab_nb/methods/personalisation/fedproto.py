"""FedProto — Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022 (Algorithm 1). Official code: https://github.com/yuetan031/FedProto

Clients never share weights: each keeps its own model and sends, per class j it holds, the prototype
C_k^j = mean representation f(x) of its class-j rows (with the count). The server averages them into
global prototypes C̄^j, and each client trains with a prototype regulariser:

    loss = ℓ_CE(w; x, y) + λ · (1/h) ‖f_w(x) − C̄^y‖²          (0 for a class with no global prototype yet)

Checked against the official code (`update_weights_het`, `proto_aggregation`): the regulariser is
`MSELoss(proto_new, protos)`, the mean over the batch and the h features, with the row's own feature in
place of a missing global prototype; the global prototype of a class is the plain mean over the clients
that hold it (the round's aggregate replaces the previous one). Differences: the official code averages the
representations seen during its last local epoch; here C_k^j is computed after training, with the trained
model, as the paper's Eq. 4 writes it.

The local model is the client's store entry "model" (θ₀ before its first round) and its personal model.
There is no global model: the engine's θ stays θ₀ (its "global" rows are the untrained start), and the
message is the prototypes and counts (aggregate_key "counts", with a server step that keeps θ).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...core.method import (DataSizeWeighting, LocalObjective, Method, OwnTraining, RoundInfo, ServerKeep,
                           weighted_mean)
from ...core.registry import register
from ...models import param_spec, representation, unflatten


@dataclass
class PrototypeRegulariser(LocalObjective):
    """extra_loss = λ·mean_h (f(x) − C̄^y)² per row; ctx = [C̄ flattened (C·h), availability (C)]."""
    lam: float = 1.0
    num_classes: int = 0

    def extra_loss(self, model, params, x, y, anchor, ctx):
        z = representation(model, params, x)
        C = self.num_classes
        protos, avail = ctx[:-C].view(C, -1), ctx[-C:]
        return self.lam * avail[y] * (z - protos[y]).pow(2).mean(-1)


@torch.no_grad()
def class_prototypes(model, w: torch.Tensor, x, y, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-class mean representation [C, h], class counts [C]) of (x, y) under the flat weights w."""
    z = representation(model, unflatten(w, param_spec(model)), x)
    counts = torch.bincount(y, minlength=num_classes).to(z.dtype)
    sums = z.new_zeros(num_classes, z.shape[1]).index_add_(0, y, z)
    return sums / counts.clamp_min(1)[:, None], counts


def aggregate_prototypes(protos: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C̄^j = mean of C_k^j over the clients k with class j ([m, C, h], [m, C] → [C, h], availability [C])."""
    has = (counts > 0).to(protos.dtype)
    n = has.sum(0)
    return (has[..., None] * protos).sum(0) / n.clamp_min(1)[:, None], (n > 0).to(protos.dtype)


@dataclass
class GlobalPrototypes(LocalObjective):
    """Server state: C̄ [C, h] and availability [C] (empty until the first round); broadcast to clients."""

    def init_state(self, theta, num_clients):
        return {"protos": theta.new_zeros(0), "avail": theta.new_zeros(0)}

    def broadcast(self, state):
        return {"protos": state["protos"], "avail": state["avail"]}

    def server_update(self, state, msgs, info: RoundInfo):
        protos, avail = aggregate_prototypes(msgs["protos"], msgs["counts"])
        return {"protos": protos, "avail": avail}


@dataclass
class FedProtoClient(OwnTraining):
    lam: float = 1.0

    def client_state(self, method, theta, groups):
        return {"model": theta.clone()}

    def local_train(self, method, ctx, jobs, down, cstate):
        model, C, theta = ctx.model, ctx.fed.num_classes, down["theta"]
        rows = self._context(model, theta, down, C, jobs[0].x[:1])   # the regulariser's context row
        jobs = [replace(j, ctx=rows) for j in jobs]
        W, losses = ctx.train(theta, jobs, PrototypeRegulariser(self.lam, C), start=cstate["model"].clone())
        protos, counts = zip(*(class_prototypes(model, W[i], j.x, j.y, C) for i, j in enumerate(jobs)))
        return {"protos": torch.stack(protos), "counts": torch.stack(counts)}, {"model": W}, losses

    @staticmethod
    def _context(model, theta, down, C, x0):
        """[C̄ flattened, availability]; all-unavailable zeros before the first aggregation."""
        if down["protos"].numel():
            return torch.cat([down["protos"].reshape(-1), down["avail"]])
        with torch.no_grad():
            h = representation(model, unflatten(theta, param_spec(model)), x0).shape[1]
        return theta.new_zeros(C * h + C)

    def personal(self, method, theta, cstate, groups):
        return cstate["model"]


@register("fedproto", claims="personalisation_more")
def fedproto(lam: float = 1.0) -> Method:
    if lam < 0:
        raise ValueError(f"FedProto's lam (λ) must be >= 0, got {lam}")
    return Method("fedproto", GlobalPrototypes(), DataSizeWeighting(), weighted_mean, ServerKeep(),
                  client=FedProtoClient(float(lam)), aggregate_key="counts")
