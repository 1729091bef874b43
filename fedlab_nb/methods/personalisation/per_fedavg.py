"""Per-FedAvg — Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020 (Algorithm 1). No official code from the authors;
the widely used implementation is in https://github.com/CharlieDinh/pFedMe (`userperavg.py`).

The global model is trained for the MAML objective F_k(w) = f_k(w − α∇f_k(w)): one adaptation step of size
α on a client's data should give a good personal model. Each local step uses independent batches D, D', D'':

    w̃ = w − α ∇f_k(w; D)                                   (temporary adapted model)
    FO: w ← w − β ∇f_k(w̃; D')                              (first-order: the Hessian term dropped)
    HF: w ← w − β (I − α ∇²f_k(w; D'')) ∇f_k(w̃; D')        (Hessian-free: a Hessian-vector product)

The paper approximates the Hessian-vector product by a finite difference of gradients; here it is exact,
by forward-over-reverse differentiation (`torch.func.jvp` of `torch.func.grad`), which needs no Hessian
either. The server averages the participants' models uniformly (w ← (1/|A|) Σ_k w_k, as in Algorithm 1).
The batches come from the engine's schedule, two (FO) or three (HF) per local step, so E epochs give
⌊E·⌈n/B⌉ / 2⌋ (or /3) MAML steps. The personal model of client k is one step w − α∇f_k(w; D_k) on its
local training data (`adapt`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad, grad_and_value, jvp

from ...core.method import Method, OwnTraining, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register


def maml_step(loss_fn, w, batches, alpha: float, beta: float, hessian_free: bool):
    """One Per-FedAvg local step on (x, y) batches [D, D'(, D'')]: (new w, loss of the adapted model)."""
    (x, y), (x1, y1) = batches[0], batches[1]
    w_tilde = w - alpha * grad(loss_fn)(w, x, y)
    g, value = grad_and_value(loss_fn)(w_tilde, x1, y1)
    if hessian_free:
        x2, y2 = batches[2]
        _, hvp = jvp(lambda v: grad(loss_fn)(v, x2, y2), (w,), (g,))  # ∇²f(w; D'') g
        g = g - alpha * hvp
    return w - beta * g, value


def per_fedavg_client(loss_fn, w0, x, y, batches, alpha, beta, hessian_free):
    """One client's local training from the broadcast w0: (w, mean loss of the adapted models)."""
    per_step = 3 if hessian_free else 2
    w, losses = w0.clone(), []
    for s in range(len(batches) // per_step):
        group = [(x[b], y[b]) for b in batches[s * per_step:(s + 1) * per_step]]
        w, value = maml_step(loss_fn, w, group, alpha, beta, hessian_free)
        losses.append(value.detach())
    return w, torch.stack(losses).mean() if losses else w0.new_zeros(())


def adapt(loss_fn, w, x, y, alpha: float):
    """The personal model: one gradient step of size α on the client's local data."""
    return w - alpha * grad(loss_fn)(w, x, y)


@dataclass
class PerFedAvgClient(OwnTraining):
    alpha: float = 0.01
    hessian_free: bool = False

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        out = [per_fedavg_client(ctx.loss_fn, theta, j.x, j.y, j.batches, self.alpha, ctx.lr,
                                 self.hessian_free) for j in jobs]
        W, losses = (torch.stack(t) for t in zip(*out))
        return {"delta": W - theta}, cstate, losses

    trains_at_evaluation = True   # personal models adapt θ on each client's data at every evaluation

    def personal_at_evaluation(self, method, theta, cstate, ctx, down):
        """Every client's one-step adaptation of the global model on its local training data, [K, d]."""
        return torch.stack([adapt(ctx.loss_fn, theta, x, y, self.alpha) if len(y) else theta
                            for x, y in ctx.fed.client_train])


@register("per_fedavg", claims="personalisation_baselines")
def per_fedavg(alpha: float = 0.01, variant: str = "fo", server_lr: float = 1.0) -> Method:
    """`alpha`: the adaptation step α (the run's `lr` is the meta step β); `variant`: "fo" or "hf"."""
    if variant not in ("fo", "hf"):
        raise ValueError(f"Per-FedAvg variant must be 'fo' (first-order) or 'hf' (Hessian-free), got {variant!r}")
    if not alpha > 0:
        raise ValueError(f"Per-FedAvg's alpha (α) must be > 0, got {alpha}")
    return Method("per_fedavg", weighting=UniformWeighting(), rule=weighted_mean, server_opt=ServerSGD(lr=server_lr),
                  client=PerFedAvgClient(float(alpha), variant == "hf"))
