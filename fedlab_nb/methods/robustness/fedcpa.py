"""FedCPA — Sungwon Han, Sungwon Park, Fangzhao Wu, Sundong Kim, Bin Zhu, Xing Xie, Meeyoung Cha, "Towards
Attack-tolerant Federated Learning via Critical Parameter Analysis", ICCV 2023, https://arxiv.org/abs/2308.09318.
Official code: https://github.com/Sungwon-Han/FEDCPA (`defense_utils.py`, branch `global_defense == 'cpa'`,
and the round loop of `main_targeted_attack.py`); this module follows that code, written from scratch.

Observation (abstract): benign local models share similar sets of top-k and bottom-k *critical parameters*;
poisoned ones do not. Per round, with θ the broadcast global, θ_k = θ + Δ_k the local models:

    importance_k   = |(θ_k − θ) ⊙ θ_k|            (weights of 2-D / 4-D tensors only, biases skipped)
    top_k, bot_k   = indices of the largest / smallest `frac` (1 %) importances
    s(i, j)        = mean_{top,bot} (Pearson(imp_i, imp_j on the shared indices) + 1) / 2
                   + mean_{top,bot} Jaccard(set_i, set_j)
    score_k        = mean_j s(k, j)  (j over every client; the code sets s(k, k) = 1)
                   + s(k, global), global importance |(θ − θ_prev) ⊙ θ| of the last global step
    w_k            = clip(ln(v / (1 − v)) + 0.5, 0, 1),  v = clip(minmax(score), 0.01, 0.99)   (FoolsGold's map)
    θ_new          = mean over {k : w_k > 0} of (θ + w_k Δ_k)

Round 0 (no previous global step) follows the official loop: the reference is the plain mean of the local
models θ̄ (importance |(θ_k − θ̄) ⊙ θ_k|) and the global importance is |(θ̄ − θ) ⊙ θ̄|; afterwards the
"previous global" is the previous round's reference. Guards the code lacks: a Pearson term on fewer than 2
shared indices (or constant values) counts as 0.5 (no correlation; the code gets NaN), and equal scores give
every client w = 1 (the code's min-max would divide by zero).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call

from ...core.history import per_client_columns
from ...core.registry import register
from ...core.streams import register_stream
from ...models import param_spec, unflatten
from .rules import fltrust
from ...core.method import LocalObjective, Method, RoundInfo, ServerSGD, UniformWeighting

FLTRUST_ROOT = register_stream("fltrust_root", 57)   # the batch order of the server's root-set training (FLTrust)


def weight_mask(model: torch.nn.Module) -> torch.Tensor:
    """Boolean mask over the flat parameter vector: True on weights of 2-D and 4-D tensors (the code's
    `val.dim() in [2, 4]`: linear and conv kernels; biases and norm scales are not scored)."""
    parts = [torch.full((int(np.prod(s)),), len(s) in (2, 4)) for _, s in param_spec(model)]
    return torch.cat(parts)


def critical_sets(importance: torch.Tensor, frac: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, bottom): boolean masks [m, d] of each row's `frac`·d largest and smallest importances
    (k = int(frac·d) as in the code, at least 1)."""
    if importance.dim() != 2 or importance.shape[1] == 0:
        raise ValueError(f"importance must have shape [m, d] with d >= 1, got {tuple(importance.shape)}")
    if not 0 < frac <= 0.5:
        raise ValueError(f"frac (share of parameters in each critical set) must be in (0, 0.5], got {frac}; the paper uses 0.01")
    k = max(1, int(importance.shape[1] * frac))
    top = torch.zeros_like(importance, dtype=torch.bool)
    bot = torch.zeros_like(importance, dtype=torch.bool)
    top.scatter_(1, importance.topk(k, dim=1).indices, True)
    bot.scatter_(1, importance.topk(k, dim=1, largest=False).indices, True)
    return top, bot


def _pearson01(a: torch.Tensor, b: torch.Tensor) -> float:
    """(Pearson r + 1) / 2, or 0.5 (no evidence) on < 2 points or a constant vector."""
    if len(a) < 2:
        return 0.5
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = a.norm() * b.norm()
    return 0.5 if den <= 0 else float((a @ b / den).clamp(-1, 1) + 1) / 2


def set_similarity(imp_i, imp_j, sets_i, sets_j) -> float:
    """s(i, j): over the top and the bottom set, the mean of (Pearson on shared indices + 1)/2 plus the mean
    Jaccard overlap. `sets_*` are (top, bottom) boolean masks [d]."""
    corr, jac = [], []
    for a, b in zip(sets_i, sets_j):
        shared = a & b
        n_shared = int(shared.sum())
        jac.append(n_shared / (int(a.sum()) + int(b.sum()) - n_shared))
        corr.append(_pearson01(imp_i[shared], imp_j[shared]))
    return float(np.mean(corr) + np.mean(jac))


def cpa_scores(importance: torch.Tensor, global_importance: torch.Tensor, frac: float = 0.01) -> torch.Tensor:
    """score_k = mean_j s(k, j) (s(k, k) = 1, as the official code fills the diagonal) + s(k, global)."""
    m = importance.shape[0]
    top, bot = critical_sets(importance, frac)
    gtop, gbot = critical_sets(global_importance.reshape(1, -1), frac)
    pair = torch.eye(m, dtype=torch.float64)
    for i in range(m):
        for j in range(i):
            pair[i, j] = pair[j, i] = set_similarity(importance[i], importance[j], (top[i], bot[i]), (top[j], bot[j]))
    glob = torch.tensor([set_similarity(importance[i], global_importance, (top[i], bot[i]), (gtop[0], gbot[0]))
                         for i in range(m)], dtype=torch.float64)
    return pair.mean(1) + glob


def foolsgold_weights(scores: torch.Tensor) -> torch.Tensor:
    """FoolsGold's logit map of min-max normalised scores: v clipped to [0.01, 0.99] at the ends,
    w = clip(ln(v/(1−v)) + 0.5, 0, 1). Equal scores → all ones (guard)."""
    lo, hi = scores.min(), scores.max()
    if hi <= lo:
        return torch.ones_like(scores)
    v = (scores - lo) / (hi - lo)
    v = torch.where(v >= 1, torch.full_like(v, 0.99), torch.where(v <= 0, torch.full_like(v, 0.01), v))
    return (torch.log(v / (1 - v)) + 0.5).clamp(0, 1)


@dataclass
class CriticalParameterRule:
    """The FedCPA rule for the `Method.rule` slot. `mask` (from `weight_mask(model)`) picks the scored
    coordinates (None: all). Logs per client `cpa_score<k>` and `cpa_w<k>` (NaN for absent clients)."""
    mask: torch.Tensor | None = None
    frac: float = 0.01
    uses_context = True

    def __post_init__(self):
        if not 0 < self.frac <= 0.5:
            raise ValueError(f"frac must be in (0, 0.5], got {self.frac}; the paper uses 0.01 (1 %)")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if self.mask is not None and self.mask.shape != theta.shape:
            raise ValueError(f"mask has shape {tuple(self.mask.shape)} but θ has {tuple(theta.shape)}; build it "
                             "with weight_mask(model) for the model the run trains")
        nan = torch.full((num_clients,), float("nan"), dtype=torch.float64)
        return {"prev": None, "score": nan.clone(), "w": nan.clone()}

    def aggregate(self, state: dict, updates: torch.Tensor, weights, info: RoundInfo):
        if not torch.isfinite(updates).all():
            raise ValueError("updates has NaN/Inf rows; drop them first "
                             "(fedlab_nb.methods.robustness.rules.drop_nonfinite)")
        theta = info.theta.to(updates)
        if state["prev"] is None:       # round 0, as the official loop: the reference is the plain mean
            ref, prev = theta + updates.mean(0), theta
        else:
            ref, prev = theta, state["prev"].to(updates)
        local = theta + updates
        sel = slice(None) if self.mask is None else self.mask.to(updates.device)
        imp = ((local - ref) * local).abs()[:, sel]
        gimp = ((ref - prev) * ref).abs()[sel]
        scores = cpa_scores(imp.cpu(), gimp.cpu(), self.frac)
        w = foolsgold_weights(scores)
        kept = w > 0
        agg = (w[kept].to(updates) @ updates[kept.to(updates.device)]) / int(kept.sum())
        ids = torch.as_tensor(np.asarray(info.client_ids), dtype=torch.int64)
        new = {"prev": ref.detach().clone(), "score": torch.full_like(state["score"], float("nan")),
               "w": torch.full_like(state["w"], float("nan"))}
        new["score"][ids], new["w"][ids] = scores, w
        return agg, new

    def metrics(self, state: dict) -> dict:
        return per_client_columns(cpa_score=state["score"], cpa_w=state["w"])


@register("fedcpa", claims="fedcpa")
def fedcpa(model: torch.nn.Module | None = None, frac: float = 0.01, server_lr: float = 1.0) -> Method:
    """FedAvg's local training with the FedCPA rule (uniform client weights, as the official code's mean).
    Pass the run's `model` to score only weight matrices / kernels as the paper's code does."""
    mask = None if model is None else weight_mask(model)
    return Method("fedcpa", LocalObjective(), UniformWeighting(), CriticalParameterRule(mask, frac),
                  ServerSGD(lr=server_lr))


# --- FLTrust with a server root set (a baseline for the FedCPA notebook) ------------------------------
@dataclass
class RootTrustRule:
    """FLTrust (Cao, Fang, Liu, Gong, NDSS 2021): each round the server trains θ on its small clean root set
    (`epochs` of SGD, batch `batch_size`, step `lr`; batch order keyed by (seed, round)) to get g_0, then
    applies `robustness.rules.fltrust`."""
    model: torch.nn.Module
    root: tuple
    lr: float = 0.05
    epochs: int = 1
    batch_size: int = 32
    uses_context = True

    def init_state(self, theta, num_clients):
        return {}

    def server_update(self, theta: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        x, y = (t.to(theta.device) for t in self.root)
        spec, w = param_spec(self.model), theta.detach().clone().requires_grad_(True)
        for _ in range(self.epochs):
            for rows in torch.randperm(len(y), generator=g).split(self.batch_size):
                out = functional_call(self.model, unflatten(w, spec), (x[rows],))
                grad, = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y[rows]), w)
                w = (w - self.lr * grad).detach().requires_grad_(True)
        return (w - theta).detach()

    def aggregate(self, state, updates, weights, info: RoundInfo):
        return fltrust(updates, server_update=self.server_update(info.theta.to(updates), info.generator(FLTRUST_ROOT))), state


def fltrust_method(model: torch.nn.Module, root: tuple, lr: float = 0.05, epochs: int = 1,
                   batch_size: int = 32) -> Method:
    """FedAvg's local training with FLTrust on a server root set `root = (x, y)`."""
    if len(root) != 2 or len(root[1]) == 0:
        raise ValueError("root must be (x, y) with at least one row: the server's clean root data set")
    return Method("fltrust", LocalObjective(), UniformWeighting(), RootTrustRule(model, root, lr, epochs, batch_size),
                  ServerSGD())
