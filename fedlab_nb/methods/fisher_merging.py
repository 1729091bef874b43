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
from torch.func import functional_call, jacrev, vmap, grad

from ..core.method import ClientUpdate, DataSizeWeighting, LocalObjective, Method, ServerAssign
from ..core.registry import register
from ..models import load_flat, param_spec, unflatten

FISHER_FLOOR = 1e-6  # the official code's default `fisher_floor`


# --- the diagonal Fisher -------------------------------------------------------------------------
def _log_probs(model, spec):
    def f(flat, x_row):
        return torch.log_softmax(functional_call(model, unflatten(flat, spec), (x_row.unsqueeze(0),))[0], -1)
    return f


def diagonal_fisher(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None,
                    kind: str = "exact", chunk: int = 128) -> torch.Tensor:
    """The diagonal Fisher [d] of the classifier `model` at flat parameters `theta` on the rows x.

    kind="exact" (the paper's code): mean over rows of Σ_c p(c|x) (∇ log p(c|x))², from per-sample
    Jacobians of the log-probabilities (torch.func.jacrev under vmap). kind="empirical": mean over rows
    of (∇ log p(y|x))² with the true labels y."""
    if kind not in ("exact", "empirical"):
        raise ValueError(f"kind must be 'exact' (expectation over the model's labels) or 'empirical' (true labels), got {kind!r}")
    if len(x) == 0:
        raise ValueError("diagonal_fisher needs at least one row of x")
    if kind == "empirical" and (y is None or len(y) != len(x)):
        raise ValueError("kind='empirical' needs the labels y, one per row of x")
    if next(model.buffers(), None) is not None:
        raise ValueError("diagonal_fisher supports models without buffers (no BatchNorm); use 'logreg', 'mlp' or 'cnn'")
    log_p = _log_probs(model, param_spec(model))
    theta = theta.detach()
    total = torch.zeros_like(theta)
    for i in range(0, len(x), chunk):
        xb = x[i:i + chunk].to(theta.dtype)
        if kind == "exact":
            jac = vmap(jacrev(log_p), in_dims=(None, 0))(theta, xb)             # [b, C, d]
            p = vmap(log_p, in_dims=(None, 0))(theta, xb).exp()                 # [b, C]
            total += torch.einsum("bc,bcd->d", p, jac.square())
        else:
            yb = y[i:i + chunk]
            g = vmap(grad(lambda f, xr, yr: log_p(f, xr).gather(0, yr[None])[0]), in_dims=(None, 0, 0))(theta, xb, yb)
            total += g.square().sum(0)
    return total / len(x)


def fisher_rows(n: int, n_fisher: int | None) -> torch.Tensor:
    """Which of a client's n training rows estimate its Fisher: all (n_fisher None or ≥ n), else n_fisher
    evenly spaced rows (deterministic: no random stream needed)."""
    if n_fisher is None or n_fisher >= n:
        return torch.arange(n)
    return torch.linspace(0, n - 1, n_fisher).round().long()


# --- the merge -----------------------------------------------------------------------------------
def fisher_merge(thetas: torch.Tensor, fishers: torch.Tensor, weights: torch.Tensor | None = None,
                 floor: float = FISHER_FLOOR, normalize: bool = False) -> torch.Tensor:
    """θ = Σ_k c_k θ_k with per-parameter coefficients c_k = λ_k F̃_k / Σ_j λ_j F̃_j, F̃_k = max(F_k, floor).

    Written with normalised coefficients so that one model merges to itself exactly (c = 1).
    `weights`: λ_k (None: all 1). `normalize`: divide λ_k by ‖F_k‖₂ (the official code's default)."""
    if thetas.ndim != 2 or thetas.shape != fishers.shape:
        raise ValueError(f"thetas and fishers must both be [K, d] and of one shape, got {tuple(thetas.shape)} "
                         f"and {tuple(fishers.shape)}")
    if len(thetas) == 0:
        raise ValueError("fisher_merge needs at least one model")
    if (fishers < 0).any():
        raise ValueError("a Fisher diagonal is a mean of squares and cannot be negative")
    if not floor >= 0:
        raise ValueError(f"floor (ε) must be >= 0, got {floor}")
    lam = torch.ones(len(thetas), dtype=thetas.dtype, device=thetas.device) if weights is None \
        else torch.as_tensor(weights, dtype=thetas.dtype, device=thetas.device)
    if lam.shape != (len(thetas),) or (lam < 0).any() or lam.sum() <= 0:
        raise ValueError(f"weights must be {len(thetas)} non-negative merging coefficients with a positive sum")
    f = fishers.to(thetas.dtype).clamp_min(floor)
    if normalize:
        lam = lam / fishers.to(thetas.dtype).norm(dim=1)
    precision = lam[:, None] * f
    total = precision.sum(0)
    if (total <= 0).any():
        raise ValueError("some parameter has zero total Fisher weight: use floor > 0")
    return ((precision / total) * thetas).sum(0)


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


class FisherClient(ClientUpdate):
    """Local training from θ (the engine's kernel and schedule), then the diagonal Fisher of the trained
    model on the client's rows; the message is {"model": θ_k, "fisher": F_k}."""

    def __init__(self, kind: str = "exact", n_fisher: int | None = 200):
        if kind not in ("exact", "empirical"):
            raise ValueError(f"kind must be 'exact' or 'empirical', got {kind!r}")
        if n_fisher is not None and (isinstance(n_fisher, bool) or not isinstance(n_fisher, int) or n_fisher < 1):
            raise ValueError(f"n_fisher must be None (all rows) or a positive integer, got {n_fisher!r}")
        self.kind, self.n_fisher = kind, n_fisher

    def local_train(self, setup, r, jobs, down, cstate):
        theta = down["theta"]
        W, losses = setup.train(setup.loss_fn, theta, jobs, setup.cfg.lr, LocalObjective(),
                                optimizer=setup.method.optimizer, groups=setup.groups, weights=True)
        model = setup.loss_fn.model
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


@register("fisher_merging", claims="fisher_merging", notebook="fisher_merging", kind="module")
def fisher_merging(fed, model, *, local_epochs: int = 20, lr: float = 0.05, batch_size: int = 32, seed: int = 0,
                   kind: str = "exact", n_fisher: int | None = 200, floor: float = FISHER_FLOOR,
                   normalize: bool = False, **simulate_kwargs):
    """One-shot Fisher merging: every client trains `local_epochs` from the model's weights (the shared
    initialisation), sends (θ_k, F_k), and the server merges once. Returns the one-round `History`."""
    from ..engine import simulate
    method = fisher_merging_method(kind, n_fisher, floor, normalize)
    return simulate(method, fed, model, rounds=1, clients_per_round=None, local_epochs=local_epochs, lr=lr,
                    batch_size=batch_size, seed=seed, progress=False, **simulate_kwargs)


def pretrain(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, lr: float = 0.05,
             batch_size: int = 32, seed: int = 0) -> torch.nn.Module:
    """The shared initialisation: `epochs` of SGD on a small common set (x, y), run by the engine as one
    client; the model's weights are replaced in place by the result (returned)."""
    from ..data.federated import FederatedDataset
    from ..engine import simulate
    from . import get_method
    one = FederatedDataset.from_clients([(x.cpu().numpy(), y.cpu().numpy())], num_classes=None)
    hist = simulate(get_method("fedavg"), one, model, rounds=1, local_epochs=epochs, lr=lr, batch_size=batch_size,
                    seed=seed, progress=False)
    return load_flat(model, hist.theta)
