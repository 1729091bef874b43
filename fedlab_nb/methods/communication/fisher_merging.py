"""Fisher merging as one-shot federated learning — Michael Matena, Colin Raffel, "Merging Models with
Fisher-Weighted Averaging", NeurIPS 2022 (https://arxiv.org/abs/2111.09832).
Official code: https://github.com/mmatena/model_merging

Each model's posterior is approximated (Laplace) by a Gaussian at its parameters θ_k with precision its
Fisher information; with the diagonal Fisher, maximising Σ_k λ_k log N(θ; θ_k, diag(F_k)⁻¹) gives, per
parameter j,

    θ_j = Σ_k λ_k F_{k,j} θ_{k,j} / Σ_k λ_k F_{k,j},      F_k = (1/N) Σ_x Σ_c p_θk(c|x) (∂ log p_θk(c|x) / ∂θ)²

As in the official code (`model_merging/fisher.py`), the Fisher is the *exact* one for a classifier: the
expectation over the model's own predicted label distribution, not the empirical Fisher of the true
labels (`kind="empirical"` gives that variant); and each F_k is floored at ε = 1e-6 (`fisher_floor`,
`model_merging/merging.py`) so a parameter no model is sensitive to falls back to the plain average
instead of 0/0. The official code floors only its "target" model's Fisher and by default divides λ_k by
‖F_k‖₂; federated clients have no target model, so every client's F_k is floored, and the ‖F_k‖
normalisation is an option (`normalize=True`), off by default as in the paper's equation.

One-shot FL: all clients start from one shared initialisation, train locally (the engine's batch
schedule), and upload their model and its diagonal Fisher (2 × the model's bytes); the server merges
once, with λ_k = n_k (a client's posterior precision grows with its data: n_k F_k). With every F_k
equal this is the size-weighted plain average, i.e. one round of FedAvg with the same local training.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, ServerAssign
from ...core.registry import get_method, register
from ...data.federated import FederatedDataset
from ...engine import simulate
from ...merging import FISHER_FLOOR, diagonal_fisher, fisher_merge
from ...models import load_flat


def fisher_rows(n: int, n_fisher: int | None) -> torch.Tensor:
    """Which of a client's n training rows estimate its Fisher: all (n_fisher None or ≥ n), else n_fisher
    evenly spaced rows (deterministic: no random stream needed)."""
    if n_fisher is None or n_fisher >= n:
        return torch.arange(n)
    return torch.linspace(0, n - 1, n_fisher).round().long()


@dataclass
class FisherMergeRule:
    """The server's rule: `fisher_merge` of the clients' models with the Fishers they sent (λ_k = the
    method's weights, n_k by default)."""
    floor: float = FISHER_FLOOR
    normalize: bool = False
    uses_context = True

    def __call__(self, models: torch.Tensor, weights: torch.Tensor | None = None, info=None) -> torch.Tensor:
        if info is None or info.messages is None or "fisher" not in info.messages:
            raise ValueError("FisherMergeRule needs the clients' 'fisher' message entries (use fisher_merging_method)")
        return fisher_merge(models, info.messages["fisher"], weights, self.floor, self.normalize)


class FisherClient(OwnTraining):
    """Local training from θ (the engine's kernel and schedule), then the diagonal Fisher of the trained
    model on the client's rows; the message is {"model": θ_k, "fisher": F_k}."""

    def __init__(self, kind: str = "exact", n_fisher: int | None = 200):
        if kind not in ("exact", "empirical"):
            raise ValueError(f"kind must be 'exact' or 'empirical', got {kind!r}")
        if n_fisher is not None and (isinstance(n_fisher, bool) or not isinstance(n_fisher, int) or n_fisher < 1):
            raise ValueError(f"n_fisher must be None (all rows) or a positive integer, got {n_fisher!r}")
        self.kind, self.n_fisher = kind, n_fisher

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        W, losses = ctx.train(theta, jobs, LocalObjective())
        model = ctx.model
        fishers = []
        for i, job in enumerate(jobs):
            rows = fisher_rows(len(job.y), self.n_fisher).to(job.x.device)
            fishers.append(diagonal_fisher(model, W[i], job.x[rows], job.y[rows], self.kind))
        return {"model": W, "fisher": torch.stack(fishers)}, cstate, losses


def fisher_merging_method(kind: str = "exact", n_fisher: int | None = 200, floor: float = FISHER_FLOOR,
                          normalize: bool = False) -> Method:
    """The one-shot method on the round pipeline: run it for one round with every client."""
    return Method("fisher_merging", LocalObjective(), DataSizeWeighting(), FisherMergeRule(floor, normalize),
                  ServerAssign(), client=FisherClient(kind, n_fisher), aggregate_key="model")


@register("fisher_merging", claims="fisher_merging", kind="module")
def fisher_merging(fed, model, *, local_epochs: int = 20, lr: float = 0.05, batch_size: int = 32, seed: int = 0,
                   kind: str = "exact", n_fisher: int | None = 200, floor: float = FISHER_FLOOR,
                   normalize: bool = False, **simulate_kwargs):
    """One-shot Fisher merging: every client trains `local_epochs` from the model's weights (the shared
    initialisation), sends (θ_k, F_k), and the server merges once. Returns the one-round `History`."""
    method = fisher_merging_method(kind, n_fisher, floor, normalize)
    return simulate(method, fed, model, rounds=1, clients_per_round=None, local_epochs=local_epochs, lr=lr,
                    batch_size=batch_size, seed=seed, progress=False, **simulate_kwargs)


def pretrain(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, lr: float = 0.05,
             batch_size: int = 32, seed: int = 0) -> torch.nn.Module:
    """The shared initialisation: `epochs` of SGD on a small common set (x, y), run by the engine as one
    client; the model's weights are replaced in place by the result (returned)."""
    one = FederatedDataset.from_clients([(x.cpu().numpy(), y.cpu().numpy())], num_classes=None)
    hist = simulate(get_method("fedavg"), one, model, rounds=1, local_epochs=epochs, lr=lr, batch_size=batch_size,
                    seed=seed, progress=False)
    return load_flat(model, hist.theta)
