"""FedRoD — Chen, Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022 (Fed-RoD, linear personalised head). Official repository: https://github.com/hongyouc/Fed-RoD

One shared network (body φ + generic head h_G) and a personalised head h_P^k kept on client k. With
z = φ(x), the generic logits g = h_G(z) and the client's class prior π_k (its training label frequencies):
  - the body and the generic head minimise the balanced-softmax loss (balanced risk)
        L_BSM = CE(g + log π_k, y)
    — the same logit adjustment on every client, so the generic model targets the class-balanced risk;
  - the personalised head minimises the plain empirical risk of the summed logits, on detached inputs
        L_P = CE(sg(g) + h_P^k(sg(z)), y)        (sg: stop-gradient; only h_P^k moves under L_P)
Both losses are taken on the same mini-batch at the same point and each set of tensors takes one step of
the client optimiser per batch (the two updates are simultaneous: one step on [w, h_P] with the gradient
of L_BSM + L_P, which is ∇L_BSM on w and ∇L_P on h_P). The client sends Δ on (φ, h_G) only; the server
averages as FedAvg; h_P^k stays in the client store ("phead", never sent). Personal model for
evaluation: φ + h_G + h_P^k; with a linear head the logit sum is the one linear layer (W_G + W_P, b_G + b_P),
so it is scored as an ordinary model of the same architecture.

What was checked: the official repository (fetched) holds only a README — no code — so nothing could be
checked against it. The losses above follow the paper's description (balanced softmax of Ren et al. 2020
for the generic head; the personalised predictor as a module on top of the generic one, trained by
empirical risk, logits added). Choices made here, not verified: the personalised head starts at zero (the
personal model starts as the generic one), it is a linear layer of the model's last layer's shape (not
the paper's hypernetwork variant), features and generic logits are detached in L_P, and a class with no
training sample has log π = −∞ (its generic logit is masked out of the client's BSM).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, ServerSGD, weighted_mean
from ...core.registry import register
from ...models import param_spec, representation, unflatten
from ..heads import last_layer


def class_log_prior(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log π_c = log(n_c / n) of the labels y, [C] (−∞ for a class with no sample)."""
    counts = torch.bincount(y, minlength=num_classes).float()
    return (counts / counts.sum()).log()


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Balanced softmax (Ren et al., NeurIPS 2020): CE(logits + log π, y), the batch mean."""
    return F.cross_entropy(logits + log_prior, y)


def train_extended(v: torch.Tensor, job, grad_fn, opt, lr: float, *extra) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's local steps on v = [θ, its extra head]: `grad_fn(v, x, y, *extra)` returns (g, (_, loss));
    returns the trained v and the mean mini-batch loss (shared by FedRoD and FedLoGe)."""
    state = {n: torch.zeros_like(v) for n in opt.state_names()}
    run = v.new_zeros(())
    for t, idx in enumerate(job.batches, 1):
        idx = torch.as_tensor(idx, device=v.device)
        g, (_, loss) = grad_fn(v, job.x[idx], job.y[idx], *extra)
        if opt.plain:
            v = v - lr * g
        else:
            opt.step_(v, g, state, torch.tensor(t), lr)
        run += loss.detach()
    return v, run / max(len(job.batches), 1)


def head_slice(spec) -> tuple[slice, tuple, tuple]:
    """(flat slice of the last layer's weight and bias, weight shape, bias shape); the last layer must be
    one linear layer (weight [C, h] then bias [C]) at the end of the flat vector."""
    names = last_layer(spec)
    shapes = dict(spec)
    if len(names) != 2 or len(shapes[names[0]]) != 2 or len(shapes[names[1]]) != 1 or [n for n, _ in spec[-2:]] != list(names):
        raise ValueError(f"this method (a personal head on the last layer: FedRoD, FedLoGe) needs a model whose last layer "
                         f"is one linear layer (weight, bias); got {names}")
    n = sum(int(np.prod(shapes[k])) for k in names)
    d = sum(int(np.prod(s)) for _, s in spec)
    return slice(d - n, d), tuple(shapes[names[0]]), tuple(shapes[names[1]])


def fedrod_losses(model, spec, w, p, x, y, log_prior):
    """(L_BSM of the generic model w, L_P of the personal head p on the detached features and logits)."""
    params = unflatten(w, spec)
    wname, bname = last_layer(spec)
    z = representation(model, params, x).flatten(1)
    g = z @ params[wname].T + params[bname]
    C, h = params[wname].shape
    personal = z.detach() @ p[:C * h].view(C, h).T + p[C * h:]
    return balanced_softmax_loss(g, y, log_prior), F.cross_entropy(g.detach() + personal, y)


@dataclass
class FedRoDClient(OwnTraining):

    def client_state(self, method, theta, groups):
        sl, _, _ = head_slice(groups.spec)
        return {"phead": torch.zeros_like(theta[sl])}   # h_P⁰ = 0: the personal model starts as the generic one

    def local_train(self, method, ctx, jobs, down, cstate):
        theta, model = down["theta"], ctx.model
        spec = param_spec(model)
        head_slice(spec)
        d, opt, lr = theta.numel(), ctx.optimizer, ctx.lr

        def total(v, x, y, log_prior):
            lg, lp = fedrod_losses(model, spec, v[:d], v[d:], x, y, log_prior)
            return lg + lp, lg
        grad_fn = grad_and_value(total, has_aux=True)
        W, P, losses = [], [], []
        for i, job in enumerate(jobs):
            log_prior = class_log_prior(job.y, ctx.fed.num_classes).to(theta.device)
            v, loss = train_extended(torch.cat([theta, cstate["phead"][i].to(theta.device)]), job, grad_fn, opt,
                                     lr, log_prior)
            W.append(v[:d])
            P.append(v[d:])
            losses.append(loss)
        W = torch.stack(W)
        return {"delta": W - theta}, {"phead": torch.stack(P)}, torch.stack(losses)

    def personal(self, method, theta, cstate, groups):
        """φ + h_G + h_P^k for every client: θ with the last layer's weight and bias plus the client's h_P."""
        sl, _, _ = head_slice(groups.spec)
        W = theta.repeat(len(cstate["phead"]), 1)
        W[:, sl] += cstate["phead"].to(theta.device)
        return W


@register("fedrod", claims="personalisation_more")
def fedrod(server_lr: float = 1.0) -> Method:
    """FedRoD with a linear personalised head (the model's last layer); the client optimiser is the run's."""
    return Method("fedrod", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  client=FedRoDClient())
