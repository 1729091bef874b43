"""FedAvg + local fine-tuning (FedAvg-FT) — the personalisation baseline of e.g. Wang, Mathews, Kiddon,
Eichner, Beaufays, Ramage, "Federated Evaluation of On-device Personalization", arXiv:1910.10252, 2019,
and the "FedAvg + fine-tuning" rows of FedBABU (Oh, Kim, Yun, ICLR 2022) and FedRep (Collins et al.,
ICML 2021).

Training is plain FedAvg. At every evaluation, *every* client (sampled or not) copies the global model
and takes k local SGD steps on its own training data (batches keyed by (seed, FINETUNE, round, client),
the client optimiser at the run's lr); that fine-tuned model is its personal model. Fine-tuning never
touches θ, the store or the next round. `FineTuneClient` is reused by FedBABU."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.groups import ParamGroups
from ...core.method import ClientUpdate, DataSizeWeighting, LocalContext, LocalObjective, Method, ServerSGD, weighted_mean
from ...core.registry import register
from ...core.round import LocalJob, batch_schedule
from ...core.streams import register_stream
from ...utils import rng

FINETUNE = register_stream("finetune", 11)   # the evaluation-time fine-tuning batches


def finetune_jobs(ctx: LocalContext, steps: int | None, epochs: int | None) -> list[LocalJob]:
    """Every client's fine-tuning work after round `ctx.round`: `epochs` passes, or `steps` mini-batches."""
    fed, jobs = ctx.fed, []
    for k in range(fed.num_clients):
        x, y = fed.client_train[k]
        g = rng(ctx.seed, FINETUNE, ctx.round, k)
        batches = batch_schedule(len(y), ctx.batch_size, epochs or 1, None if epochs else steps, g) if len(y) else []
        jobs.append(LocalJob(k, x, y, batches))
    return jobs


@dataclass
class FineTuneClient(ClientUpdate):
    """The default client update for training; at evaluation each client fine-tunes its starting model
    (θ with its kept-local tensors) for `steps` mini-batch steps (or `epochs` passes) on the tensors of
    `finetune` (None: every tensor, frozen ones included — FedBABU fine-tunes its frozen head)."""
    steps: int | None = 5
    epochs: int | None = None
    finetune: ParamGroups | None = None
    trains_at_evaluation = True

    def personal_at_evaluation(self, method, theta, cstate, ctx, down):
        """Every client's model fine-tuned from θ (with its kept-local tensors) on its own training data."""
        start = self.personal(method, theta, cstate, ctx.groups)  # None: θ for every client
        if next(ctx.model.buffers(), None) is not None:
            raise NotImplementedError("evaluation-time fine-tuning of models with buffers (BatchNorm) is not "
                                      "supported yet")
        which = (self.finetune or ParamGroups()).resolve(ctx.groups.spec)
        W, _ = ctx.train(theta, finetune_jobs(ctx, self.steps, self.epochs), LocalObjective(), start=start, groups=which)
        return W


def check_finetune(steps, epochs):
    if epochs is None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"fine-tuning needs steps >= 1 (or epochs >= 1), got steps={steps!r}")
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"fine-tuning epochs must be an int >= 1, got {epochs!r}")


@register("fedavg_ft", claims="personalisation_baselines")
def fedavg_ft(steps: int = 5, epochs: int | None = None, server_lr: float = 1.0) -> Method:
    """`steps`: k local SGD steps of fine-tuning before evaluation (`epochs`: passes instead)."""
    check_finetune(steps, epochs)
    return Method("fedavg_ft", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  client=FineTuneClient(steps, epochs))
