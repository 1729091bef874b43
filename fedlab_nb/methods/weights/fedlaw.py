"""FedLAW — Zexi Li, Tao Lin, Xinyi Shang, Chao Wu, "Revisiting Weighted Aggregation in Federated Learning
with Neural Networks", ICML 2023, https://arxiv.org/abs/2302.10911.
Official code: https://github.com/ZexiLee/ICML-2023-FedLAW (`server_funct.py`, `args.py`).

FedAvg aggregates the round's client models θ_k with normalised, size-proportional weights. FedLAW writes the
aggregate as

    θ_new = γ · Σ_k λ_k θ_k,      γ = exp(g) > 0 (global shrinking factor),  λ = softmax(l) (relative weights),

and learns (g, l) on a small labelled proxy set held by the server: a few epochs of Adam on the proxy
cross-entropy of θ_new, started each round from g = 0 and l = log(n_k / Σ n_j) (FedAvg's weights), as in the
official `fedlaw_optimization` ('exp' parameterisation, no SWA): Adam lr 0.005 (0.01 for CIFAR-10),
betas (0.5, 0.999), 20 server epochs, the step size halved every 20 epochs, proxy batch 128, proxy set 2 % of
the training data (`server_valid_ratio`). γ < 1 shrinks the whole model toward 0 (the paper's "global weight
shrinking", analogous to weight decay); γ is not constrained to be below 1.

With θ_k = θ + Δ_k and Σ λ_k = 1, θ_new = γ (θ + Σ_k λ_k Δ_k), so the rule works on the engine's [m, d]
update matrix and returns θ_new − θ = (γ − 1) θ + γ Σ_k λ_k Δ_k (the server optimiser at lr 1 adds it to θ).

Bilevel reading: the upper variables are the aggregation weights (g, l), the lower solutions are the clients'
trained models θ_k (fixed once they are sent). θ_new is an explicit function of (g, l), so the hypergradient of
the proxy loss is a plain gradient through the aggregate — no implicit differentiation or Hessian products
(`fedlab_nb.methods.bilevel.derivatives`) are needed.

Client coherence (paper §5): cosine similarity of client updates (the FL "local gradients"). `client_coherence`
returns each client's cosine with the round's mean update (local coherence) and the mean pairwise cosine
among the clients (global coherence), which the rules log every round.

Also here: `ShrinkRule` / `fedavg_shrink(γ)` (FedAvg with a fixed γ), `ProxyFinetuneRule` /
`fedavg_proxy_finetune` (the official code's fairness baseline: FedAvg, then SGD on the same proxy set) and
`federate_with_proxy` (a class-balanced proxy set that no client holds, as the official code builds it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ...core.history import per_client_columns
from ...core.registry import register
from ...core.streams import register_stream
from ...data.datasets import load_dataset
from ...data.federated import FederatedDataset
from ...data.partition import Partition, make_partition
from ...models import param_spec, unflatten
from ...core.method import DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD

PROXY_BATCHES = register_stream("fedlaw_proxy", 56)   # the order of the proxy rows in the server's epochs


def shrink_update(theta: torch.Tensor, updates: torch.Tensor, gamma, lam: torch.Tensor) -> torch.Tensor:
    """θ_new − θ = (γ − 1) θ + γ Σ_k λ_k Δ_k, i.e. θ_new = γ Σ_k λ_k θ_k (λ sums to one); differentiable in γ, λ.
    Written so that γ = 1 gives FedAvg's Σ λ_k Δ_k bit for bit (0·θ adds exactly nothing)."""
    return (gamma - 1) * theta + gamma * (lam.to(updates.dtype) @ updates)


def client_coherence(updates: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, float]:
    """(cosine of each client's update with the mean update [m], mean pairwise cosine between clients)."""
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2 or updates.shape[0] == 0:
        raise ValueError("updates must be a tensor of shape [m, d] with m >= 1")
    unit = updates / updates.norm(dim=1, keepdim=True).clamp_min(eps)
    mean = updates.mean(0)
    local = unit @ (mean / mean.norm().clamp_min(eps))
    m = updates.shape[0]
    cos = unit @ unit.T
    pairwise = float((cos.sum() - cos.diagonal().sum()) / (m * (m - 1))) if m > 1 else float("nan")
    return local, pairwise


def _normalised(name: str, weights: torch.Tensor | None, m: int, like: torch.Tensor) -> torch.Tensor:
    w = torch.ones(m, dtype=like.dtype) if weights is None else torch.as_tensor(weights, dtype=like.dtype)
    if w.shape != (m,) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"{name}: weights must be {m} non-negative values with a positive sum (data sizes), "
                         f"got shape {tuple(w.shape)}")
    return w / w.sum()


@dataclass
class ShrinkRule:
    """Fixed global shrinking: θ_new = γ Σ_k p_k θ_k with FedAvg's normalised weights p_k (γ = 1: FedAvg).
    Logs γ and the round's client coherence."""
    gamma: float = 1.0
    uses_context = True

    def __post_init__(self):
        if not (isinstance(self.gamma, (int, float)) and 0 < self.gamma <= 1.5):
            raise ValueError(f"gamma must be a number in (0, 1.5] (e.g. 0.95 to shrink), got {self.gamma!r}")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        nan = torch.full((num_clients,), float("nan"), dtype=torch.float64)
        return {"gamma": torch.tensor(float(self.gamma), dtype=torch.float64), "lam": nan.clone(),
                "coherence": torch.tensor(float("nan"), dtype=torch.float64), "local_coherence": nan.clone()}

    def weights(self, theta, updates, p, info) -> tuple[torch.Tensor, torch.Tensor]:
        """(γ, λ) for this round: the fixed factor and the data-size weights."""
        return torch.tensor(float(self.gamma), dtype=updates.dtype), p

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo):
        if info.theta is None:
            raise ValueError(f"{type(self).__name__} needs the broadcast θ in RoundInfo (info.theta)")
        theta = info.theta.to(updates.dtype)
        p = _normalised(type(self).__name__, weights, updates.shape[0], updates)
        gamma, lam = self.weights(theta, updates, p, info)
        return shrink_update(theta, updates, gamma, lam), self._logged(state, gamma, lam, updates, info)

    def _logged(self, state, gamma, lam, updates, info) -> dict:
        ids = torch.as_tensor(np.asarray(info.client_ids), dtype=torch.int64)
        local, pairwise = client_coherence(updates.detach())
        new = {"gamma": torch.tensor(float(gamma), dtype=torch.float64),
               "coherence": torch.tensor(pairwise, dtype=torch.float64),
               "lam": torch.full_like(state["lam"], float("nan")),
               "local_coherence": torch.full_like(state["lam"], float("nan"))}
        new["lam"][ids] = lam.detach().double().cpu()
        new["local_coherence"][ids] = local.double().cpu()
        return new

    def metrics(self, state: dict) -> dict:
        return {"gamma": float(state["gamma"]), "coherence": float(state["coherence"]),
                **per_client_columns(lam=state["lam"], local_coh=state["local_coherence"])}


def proxy_loss(model: nn.Module, spec, theta, updates, g, l, x, y) -> torch.Tensor:
    """Cross-entropy on proxy rows (x, y) of θ_new(g, l) = exp(g) (θ + softmax(l) · Δ): FedLAW's upper objective."""
    params = unflatten(theta + shrink_update(theta, updates, torch.exp(g), torch.softmax(l, 0)), spec)
    return F.cross_entropy(functional_call(model, params, (x,)), y)


@dataclass(eq=False)
class FedLAWRule(ShrinkRule):
    """FedLAW's server step: (g, l) learned each round by Adam on the proxy loss, from g = 0, l = log p."""
    model: nn.Module | None = None
    proxy: tuple | None = None
    epochs: int = 20
    lr: float = 0.005
    batch_size: int = 128
    learn_gamma: bool = True
    learn_lambda: bool = True

    def __post_init__(self):
        if not isinstance(self.model, nn.Module):
            raise ValueError("model must be the nn.Module whose flat parameters θ the run trains (same architecture)")
        if next(self.model.buffers(), None) is not None:
            raise ValueError("FedLAW supports models without buffers (no BatchNorm): use 'logreg', 'mlp' or 'cnn'")
        if not (isinstance(self.proxy, (tuple, list)) and len(self.proxy) == 2 and len(self.proxy[0]) == len(self.proxy[1])
                and len(self.proxy[1]) > 0):
            raise ValueError("proxy must be (x, y): the server's labelled proxy rows (e.g. 2 % of the training set)")
        for name in ("epochs", "batch_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0 (the official code uses 0.005), got {self.lr!r}")
        self.gamma = 1.0
        self.spec = param_spec(self.model)

    def weights(self, theta, updates, p, info):
        x, y = (torch.as_tensor(t).to(updates.device) for t in self.proxy)
        x = x.to(updates.dtype)
        g = torch.zeros((), dtype=updates.dtype, requires_grad=self.learn_gamma)
        l = torch.log(p.clamp_min(1e-12)).clone().requires_grad_(self.learn_lambda)
        trained = [t for t, on in ((g, self.learn_gamma), (l, self.learn_lambda)) if on]
        if trained:
            opt = torch.optim.Adam(trained, lr=self.lr, betas=(0.5, 0.999))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
            gen = info.generator(PROXY_BATCHES)
            for _ in range(self.epochs):
                order = torch.randperm(len(y), generator=gen).to(y.device)
                for rows in order.split(self.batch_size):
                    opt.zero_grad()
                    proxy_loss(self.model, self.spec, theta, updates, g, l, x[rows], y[rows]).backward()
                    opt.step()
                sched.step()
        return torch.exp(g).detach(), torch.softmax(l, 0).detach()


@register("fedlaw", claims="fedlaw")
def fedlaw(proxy, model: nn.Module, epochs: int = 20, lr: float = 0.005, batch_size: int = 128,
           learn_gamma: bool = True, learn_lambda: bool = True) -> Method:
    """FedAvg's local training with FedLAW's learned (γ, λ) on the server's proxy set `(x, y)`; `model` is the
    run's architecture (pass the same module to `simulate`). `learn_lambda=False` learns γ only."""
    rule = FedLAWRule(model=model, proxy=proxy, epochs=epochs, lr=lr, batch_size=batch_size,
                      learn_gamma=learn_gamma, learn_lambda=learn_lambda)
    name = "fedlaw" if learn_lambda else "fedlaw_gamma"
    return Method(name, LocalObjective(), DataSizeWeighting(), rule, ServerSGD(lr=1.0))


def fedavg_shrink(gamma: float = 1.0) -> Method:
    """FedAvg with a fixed global shrinking factor: θ ← γ Σ_k p_k θ_k (γ = 1 is FedAvg)."""
    return Method(f"fedavg_gamma{gamma:g}", LocalObjective(), DataSizeWeighting(), ShrinkRule(gamma), ServerSGD(lr=1.0))


def _balanced_rows(labels: np.ndarray, n_proxy: int, num_classes: int) -> np.ndarray:
    """Positions of the first n_proxy // C rows of every class in `labels` (a class-balanced proxy set, as the
    official code's `train_val_split_forServer` builds it); a class with too few rows gives what it has."""
    per_class = n_proxy // num_classes
    if per_class < 1:
        raise ValueError(f"n_proxy must be at least the number of classes ({num_classes}) for a class-balanced proxy set")
    return np.sort(np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(num_classes)]))


def federate_with_proxy(dataset, n_proxy: int = 100, n_clients: int = 10, n_train: int | None = None,
                        alpha: float = 0.5, seed: int = 0, test_fraction: float = 0.2):
    """(FederatedDataset, (x_proxy, y_proxy)): a class-balanced proxy set of `n_proxy` training rows kept by the
    server (n_proxy // C per class; no client holds them) and a Dirichlet(α) split of `n_train` further training
    rows (all the rest if None) over the clients."""
    ds = load_dataset(dataset) if isinstance(dataset, str) else dataset
    n = len(ds.y_train)
    if not (isinstance(n_proxy, int) and 1 <= n_proxy < n):
        raise ValueError(f"n_proxy must be an integer in [1, {n}) (the paper keeps 2 % of the training rows), got {n_proxy!r}")
    order = np.random.default_rng(seed).permutation(n)
    proxy_rows = _balanced_rows(ds.y_train.numpy()[order], n_proxy, ds.num_classes)
    proxy_rows, rest = order[proxy_rows], np.delete(order, proxy_rows)
    if n_train is not None:
        if not (isinstance(n_train, int) and n_clients <= n_train <= len(rest)):
            raise ValueError(f"n_train must be an integer in [{n_clients}, {len(rest)}], got {n_train!r}")
        rest = rest[:n_train]
    parts = make_partition("dirichlet", ds.y_train[rest].numpy(), n_clients, alpha=alpha, seed=seed)
    fed = FederatedDataset(ds, Partition([rest[np.asarray(p, dtype=int)] for p in parts], name="dirichlet"), test_fraction=test_fraction, seed=seed)
    return fed, (ds.x_train[proxy_rows], ds.y_train[proxy_rows])


@dataclass(eq=False)
class ProxyFinetuneRule(ShrinkRule):
    """The official code's fairness baseline ("finetune"): FedAvg, then `epochs` epochs of SGD (momentum,
    weight decay) of the aggregate on the same proxy set; the optimiser starts afresh every round."""
    model: nn.Module | None = None
    proxy: tuple | None = None
    epochs: int = 20
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 128

    def __post_init__(self):
        FedLAWRule.__post_init__(self)

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo):
        agg, state = super().aggregate(state, updates, weights, info)
        theta = info.theta.to(updates.dtype)
        w = (theta + agg).clone().requires_grad_(True)
        x, y = (torch.as_tensor(t).to(updates.device) for t in self.proxy)
        opt = torch.optim.SGD([w], lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        gen = info.generator(PROXY_BATCHES)
        for _ in range(self.epochs):
            for rows in torch.randperm(len(y), generator=gen).to(y.device).split(self.batch_size):
                opt.zero_grad()
                F.cross_entropy(functional_call(self.model, unflatten(w, self.spec), (x[rows].to(w.dtype),)), y[rows]).backward()
                opt.step()
        return w.detach() - theta, state


def fedavg_proxy_finetune(proxy, model: nn.Module, epochs: int = 20, lr: float = 0.05, momentum: float = 0.9,
                          weight_decay: float = 5e-4) -> Method:
    """FedAvg + server fine-tuning on the proxy set: what the proxy data buy without learning any weights."""
    rule = ProxyFinetuneRule(model=model, proxy=proxy, epochs=epochs, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return Method("fedavg_finetune", LocalObjective(), DataSizeWeighting(), rule, ServerSGD(lr=1.0))
