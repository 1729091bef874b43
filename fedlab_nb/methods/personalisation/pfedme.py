"""pFedMe — T Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020
(Algorithm 1). Official code: https://github.com/CharlieDinh/pFedMe

Each client's personalised model is the proximal point of its loss around its local copy w of the global
model (a Moreau envelope):  θ_k(w) = argmin_θ f_k(θ) + (λ/2)‖θ − w‖². At each of the R local steps the
client draws a batch B, solves that inner problem approximately with K gradient steps on the same batch,

    θ ← θ − η_p (∇f_k(θ; B) + λ(θ − w))          (K times; θ starts at the broadcast w^t, warm from then on)

and moves w towards it:  w ← w − ηλ(w − θ). The server takes a β-step towards the participants'
size-weighted mean:  w^{t+1} = (1 − β) w^t + β Σ_k p_k w_k  (β = 1: plain averaging).

Checked against the official code (`userpFedMe.train`, `pFedMeOptimizer.step`,
`serverbase.persionalized_aggregate_parameters`): the personal model starts from the global one each
round and is warm-started across batches; aggregation weights are n_k/Σn over the round's users; the
personalised accuracy is that of the last θ. The optimiser's extra `mu·θ` term (default 0.001 there) is
weight decay, left out (as in the paper). The personal model θ_k lives in the client store; a client never
sampled is evaluated with its default θ_k = w⁰.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, weighted_mean
from ...core.registry import register


def pfedme_client(loss_fn, w0: torch.Tensor, x, y, batches, lr: float, personal_lr: float, lam: float,
                  inner_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One client's pass from the broadcast w0: (local w, personal θ, mean inner loss)."""
    grad_fn = grad_and_value(loss_fn)
    w, theta, total = w0.clone(), w0.clone(), w0.new_zeros(())
    for idx in batches:
        xb, yb = x[idx], y[idx]
        for _ in range(inner_steps):
            g, value = grad_fn(theta, xb, yb)
            theta = theta - personal_lr * (g + lam * (theta - w))
        w = w - lr * lam * (w - theta)
        total = total + value.detach()
    return w, theta, total / max(len(batches), 1)


@dataclass
class PFedMeClient(OwnTraining):
    lam: float = 15.0
    personal_lr: float = 0.09
    inner_steps: int = 5

    def client_state(self, method, theta, groups):
        return {"personal": theta.clone()}

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        out = [pfedme_client(ctx.loss_fn, theta, j.x, j.y, j.batches, ctx.lr, self.personal_lr,
                             self.lam, self.inner_steps) for j in jobs]
        W, P, losses = (torch.stack(t) for t in zip(*out))
        return {"delta": W - theta}, {"personal": P}, losses

    def personal(self, method, theta, cstate, groups):
        return cstate["personal"]


@register("pfedme", claims="personalisation_baselines")
def pfedme(lam: float = 15.0, personal_lr: float = 0.09, inner_steps: int = 5, beta: float = 1.0) -> Method:
    """Defaults: λ = 15, K = 5, η_p = 0.09, β = 1 — the official code's MNIST run (its results file
    `Mnist_pFedMe_0.005_1.0_15_..._5_0.09`); the client step size η is the run's `lr`."""
    if not lam > 0 or not personal_lr > 0 or inner_steps < 1 or not beta > 0:
        raise ValueError(f"pFedMe needs lam (λ) > 0, personal_lr > 0, inner_steps (K) >= 1 and beta (β) > 0; got "
                         f"{lam}, {personal_lr}, {inner_steps}, {beta}")
    return Method("pfedme", weighting=DataSizeWeighting(), rule=weighted_mean, server_opt=ServerSGD(lr=float(beta)),
                  client=PFedMeClient(float(lam), float(personal_lr), int(inner_steps)))
