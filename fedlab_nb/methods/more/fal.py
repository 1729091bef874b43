"""FAL — Li, Song, Yang, "Federated Adversarial Learning: A Framework with Convergence Analysis", ICML 2023
(https://arxiv.org/abs/2208.03635).

Federated adversarial training: the global robust loss L_rob(W) = Σ_k p_k (1/n_k) Σ_i max_{‖δ‖≤ρ}
ℓ(f_W(x_i + δ), y_i) is minimised as a min–max problem. On each client an inner loop builds adversarial
examples of the mini-batch (here PGD, `fedlab_nb.methods.more.adversarial.pgd`; the paper allows any perturbation oracle
inside the ρ-ball) and an outer loop takes local SGD steps on them; the server averages the local updates
(FedAvg's size weights) and broadcasts the result. With ρ = 0 the PGD output is the batch itself, so FAL
is FedAvg step for step. PGD's random start is keyed by (seed, stream "fal_pgd" = 75, round, client)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from .adversarial import check_pgd_args, model_fn, pgd
from ...core.registry import register
from ...core.streams import register_stream
from ...utils import rng
from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, weighted_mean

FAL_PGD = register_stream("fal_pgd", 75)


def pgd_generator(seed: int, rnd: int, client: int) -> torch.Generator:
    """The keyed torch generator of one client's PGD random starts in one round."""
    return torch.Generator().manual_seed(int(rng(seed, FAL_PGD, rnd, client).integers(2**62)))


@dataclass
class FALClient(OwnTraining):
    """Local adversarial SGD: for every mini-batch, PGD examples at the current local weights (inner max),
    then one SGD step on their loss (outer min). Plain SGD at the run's lr, as in the paper's analysis."""
    eps: float = 0.1
    alpha: float = 0.025
    steps: int = 5
    norm: str = "linf"

    def local_train(self, method, ctx, jobs, down, cstate):
        if not ctx.optimizer.plain:
            raise ValueError("FAL runs plain client SGD; build it with fal(...) and no client optimizer")
        theta, lr, model = down["theta"], ctx.lr, ctx.model
        grad_fn = grad_and_value(ctx.loss_fn)
        out, losses = [], []
        for job in jobs:
            g = pgd_generator(ctx.seed, ctx.round, job.client_id)
            w, total = theta.clone(), theta.new_zeros(())
            for idx in job.batches:
                idx = torch.as_tensor(idx, device=theta.device)
                x, y = job.x[idx], job.y[idx]
                x_adv = pgd(model_fn(model, w), x, y, self.eps, self.alpha, self.steps, self.norm, generator=g)
                grad, loss = grad_fn(w, x_adv, y)
                w = w - lr * grad  # FedAvg's step, on the adversarial batch
                total += loss.detach()
            out.append(w - theta)
            losses.append(total / max(len(job.batches), 1))
        return {"delta": torch.stack(out)}, cstate, torch.stack(losses)


@register("fal", claims="fal", kind="module")
def fal(eps: float = 0.1, alpha: float | None = None, steps: int = 5, norm: str = "linf",
        server_lr: float = 1.0) -> Method:
    """`eps`: the radius ρ of the perturbation ball (0 = FedAvg); `alpha`: the PGD step (None: ρ/4);
    `steps`: PGD steps of the inner loop; `norm`: "linf" or "l2"."""
    alpha = eps / 4 if alpha is None else alpha
    check_pgd_args(eps, alpha, steps, norm, who="FAL")
    return Method("fal", weighting=DataSizeWeighting(), rule=weighted_mean, server_opt=ServerSGD(lr=server_lr),
                  client=FALClient(float(eps), float(alpha), int(steps), norm))
