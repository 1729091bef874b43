"""FedRep — Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021. Official code: https://github.com/lgcollins/FedRep

A shared representation (body φ) and a local head h_k per client. One round, client k:
  1. head phase: from (φ^t, h_k), `head_epochs` epochs of SGD on h_k with φ frozen;
  2. body phase: from the new h_k, `body_epochs` epochs of SGD on φ with h_k frozen;
then it sends Δφ and stores h_k; the server averages the body updates (FedAvg). Personal model = (φ, h_k).
Checked against the official code (models/Update.py): the head epochs come first, then the representation
epochs (`head_eps = local_ep - local_rep_ep`); its CIFAR scripts use 10 head epochs and 1 body epoch
(`--local_ep 11 --local_rep_ep 1`), the defaults here. `None` takes the run's schedule (E / local_steps)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.method import ClientUpdate, DataSizeWeighting, LocalObjective, Method, ServerSGD, Track, weighted_mean
from ...core.registry import register
from ..heads import BODY, HEAD, HeadSplit, as_patterns


@dataclass
class FedRepClient(ClientUpdate):
    """Two tracks: "head" (body frozen, from θ with the stored head) then "body" (head frozen, from the
    head phase's result)."""
    head_epochs: int | None = 10
    body_epochs: int | None = 1

    def tracks(self, method):
        head = method.groups.head
        return [Track("head", LocalObjective(), method.optimizer, HeadSplit(local=(HEAD,), frozen=(BODY,), head=head),
                      epochs=self.head_epochs),
                Track("body", LocalObjective(), method.optimizer, HeadSplit(frozen=(HEAD,), head=head),
                      epochs=self.body_epochs)]

    def start(self, track, theta, down, cstate, done, groups, m):
        if track.name == "body":
            return done["head"].clone()
        return super().start(track, theta, down, cstate, done, groups, m)  # θ with the client's stored head

    def finish(self, done, theta, down, cstate, steps, lr, method, groups):
        return super().finish({"w": done["body"]}, theta, down, cstate, steps, lr, method, groups)


@register("fedrep", claims="personalisation_baselines")
def fedrep(head=None, head_epochs: int | None = 10, body_epochs: int | None = 1, server_lr: float = 1.0) -> Method:
    """`head`: glob patterns of the local head (None: the model's last layer)."""
    for name, e in (("head_epochs", head_epochs), ("body_epochs", body_epochs)):
        if e is not None and (not isinstance(e, int) or e < 1):
            raise ValueError(f"FedRep's {name} must be an int >= 1 or None (the run's schedule), got {e!r}")
    return Method("fedrep", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=HeadSplit(local=(HEAD,), head=as_patterns(head)),
                  client=FedRepClient(head_epochs, body_epochs))
