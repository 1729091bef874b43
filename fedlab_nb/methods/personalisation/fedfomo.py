"""FedFomo — Zhang, Sapra, Fidler, Yeung, Alvarez, "Personalized Federated Learning with First Order Model
Optimization", ICLR 2021. Official code: https://github.com/NVlabs/FedFomo

Every client i keeps its own model θ_i and a local validation split V_i. The server keeps every client's
latest uploaded model. In a round, sampled client i downloads M other clients' models θ_n, scores each
by its validation-loss gain per unit of parameter distance

    r_n = (L_V(θ_i) − L_V(θ_n)) / ‖θ_n − θ_i‖,        w_n = max(r_n, 0) / Σ_m max(r_m, 0)

and moves to θ_i ← θ_i + Σ_n w_n (θ_n − θ_i) (no positive gain: θ_i unchanged), then trains locally on
its training rows (the run's epochs / local_steps, the client optimiser) and uploads θ_i. Which M models
it downloads is ε-greedy on its affinity row P_i (the client-to-client weights): each pick is, with
probability ε_t = max(ε − t·decay, 0), the next of a random order of the candidates, otherwise the next
highest P_i[n] (ties broken at random); P_i[n] += r_n / |Σ_m r_m| for the downloaded models. Candidates:
clients that have uploaded at least once (round 1: none, everyone trains locally from θ₀).

In fedlab_nb the server's table of all K models is server state (`state["objective"]["models"]`, with
"uploaded"), broadcast to the sampled clients; θ_i lives in the client store ("model"). The affinity
matrix P [K, K] is server state too (the official server also reads every client's weights to build
its adjacency matrix): client i gets row P_i with the broadcast and uploads its updated row ("affinity",
K floats) with its model. The message's "model" (the aggregate key) is the trained θ_i; the engine's
global θ is their size-weighted mean (a one-model reference row, not part of FedFomo). Personal model =
the client's stored θ_i.

Checked against the official code (federation.py `compute_fomo_weights` / `update_client_weights`,
client.py `get_federating_clients`, federated/configs.py): the weight formula and positive-only
normalisation, "no positive model → keep one's own", the affinity update normalised by |Σ r|, the
ε-greedy pick with random tie-breaking, and the defaults ε = 0.3, decay 0.05 per round, M = 8 and the L1
parameter distance (`--model_delta_norm l1`; `norm="l2"` for the paper's ‖·‖₂). Simplified: the official
baseline model is the client's model before its previous local training (`first_model`) and its
candidates also include the client's own model and the global average; here the baseline is the client's
current model and the candidates are other clients' models only; no hierarchical sub-federations. The
validation split (a fraction `val_fraction` of each client's training rows, fixed by (seed, client)) is
held out of local training; stragglers are not applied to FedFomo's local schedule. bytes_down counts the
broadcast table of all K models per sampled client (an upper bound: a client needs only its M).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.method import (DataSizeWeighting, LocalObjective, Method, OwnTraining, RoundInfo, ServerAssign,
                           weighted_mean)
from ...core.registry import register
from ...core.round import LocalJob, batch_schedule
from ...core.streams import BATCHES, register_stream
from ...utils import rng

FOMO_VAL = register_stream("fedfomo_val", 13)     # each client's fixed validation rows
FOMO_PICK = register_stream("fedfomo_pick", 14)   # the ε-greedy choice of downloaded models


def fomo_weights(own_loss: torch.Tensor, losses: torch.Tensor, dists: torch.Tensor):
    """(w [M], r [M]): r_n = (L(θ_i) − L(θ_n)) / dist_n (0 where dist_n = 0), w = max(r, 0) normalised
    (all zeros when no r_n > 0)."""
    gain = own_loss - losses
    r = torch.where(dists > 0, gain / dists.clamp_min(torch.finfo(dists.dtype).tiny), torch.zeros_like(gain))
    pos = r.clamp_min(0)
    total = pos.sum()
    return (pos / total if total > 0 else torch.zeros_like(pos)), r


def distance(a: torch.Tensor, b: torch.Tensor, norm: str = "l1") -> torch.Tensor:
    """‖a − b‖ over the last axis (L1: the official default, or L2)."""
    return (a - b).abs().sum(-1) if norm == "l1" else (a - b).norm(dim=-1)


def choose_models(pool, affinity: np.ndarray, m: int, eps: float, g: np.random.Generator) -> list:
    """ε-greedy: m of the candidate ids `pool`, each pick random with probability eps, else the next of the
    pool ordered by affinity (highest first, ties broken at random). All of them when len(pool) <= m."""
    pool = np.asarray(pool, dtype=np.int64)
    if len(pool) <= m:
        return pool.tolist()
    top = pool[np.lexsort((g.random(len(pool)), affinity[pool]))[::-1]].tolist()
    rand = g.permutation(pool).tolist()
    chosen = []
    while len(chosen) < m:
        source = rand if g.random() < eps else top
        c = source.pop(0)
        while c in chosen:
            c = source.pop(0)
        chosen.append(c)
    return chosen


def val_split(n: int, frac: float, seed: int, k: int):
    """(validation rows, training rows) of a client with n rows, fixed by (seed, client); frac = 0: both all."""
    if frac <= 0 or n < 2:
        every = np.arange(n)
        return every, every
    perm = rng(seed, FOMO_VAL, k).permutation(n)
    nv = min(max(1, int(round(frac * n))), n - 1)
    return np.sort(perm[:nv]), np.sort(perm[nv:])


@dataclass
class ModelTable(LocalObjective):
    """Server state: every client's latest uploaded model [K, d], whether it has uploaded [K], and the
    affinity matrix P [K, K] (row i: client i's client-to-client weights, uploaded by client i)."""

    def init_state(self, theta, num_clients):
        return {"models": theta.repeat(num_clients, 1), "uploaded": torch.zeros(num_clients, device=theta.device),
                "affinity": torch.zeros(num_clients, num_clients, device=theta.device, dtype=theta.dtype)}

    def broadcast(self, state):
        return dict(state)

    def server_update(self, state, msgs, info: RoundInfo):
        idx = torch.as_tensor(np.asarray(info.client_ids), device=state["models"].device)
        models, up, aff = state["models"].clone(), state["uploaded"].clone(), state["affinity"].clone()
        models[idx] = msgs["model"].to(models.dtype)
        aff[idx] = msgs["affinity"].to(aff.dtype)
        up[idx] = 1
        return {"models": models, "uploaded": up, "affinity": aff}


@dataclass
class FedFomoClient(OwnTraining):
    n_models: int = 8
    epsilon: float = 0.3
    epsilon_decay: float = 0.05
    val_fraction: float = 0.2
    norm: str = "l1"

    def client_state(self, method, theta, groups):
        return {"model": theta.clone()}

    def federated_update(self, loss_fn, own, models, ids, xv, yv):
        """(θ_i + Σ w_n (θ_n − θ_i), r) for the downloaded models `ids` on the validation rows."""
        cand = models[ids]
        with torch.no_grad():
            own_loss = loss_fn(own, xv, yv)
            losses = torch.stack([loss_fn(c, xv, yv) for c in cand])
        w, r = fomo_weights(own_loss, losses, distance(cand, own, self.norm))
        return own + w @ (cand - own), r

    def local_train(self, method, ctx, jobs, down, cstate):
        models, up = down["models"], down["uploaded"].cpu().numpy()
        K, eps = len(models), max(self.epsilon - ctx.round * self.epsilon_decay, 0.0)
        starts, train_jobs = [], []
        aff = down["affinity"][torch.as_tensor([j.client_id for j in jobs], device=models.device)].clone()
        for i, job in enumerate(jobs):
            k, own = job.client_id, cstate["model"][i].to(models.device)
            vi, ti = val_split(len(job.y), self.val_fraction, ctx.seed, k)
            pool = [n for n in range(K) if up[n] and n != k]
            if pool:
                ids = choose_models(pool, aff[i].cpu().numpy(), self.n_models, eps, rng(ctx.seed, FOMO_PICK, ctx.round, k))
                own, rr = self.federated_update(ctx.loss_fn, own, models, ids, job.x[vi], job.y[vi])
                aff[i, ids] += (rr / rr.sum().abs().clamp_min(1e-9)).to(aff.dtype)
            starts.append(own)
            g = rng(ctx.seed, BATCHES, ctx.round, k)
            train_jobs.append(LocalJob(k, job.x[ti], job.y[ti],
                                       batch_schedule(len(ti), ctx.batch_size, ctx.local_epochs, ctx.local_steps, g)))
        W, losses = ctx.train(down["theta"], train_jobs, LocalObjective(), start=torch.stack(starts))
        return {"model": W, "affinity": aff}, {"model": W.clone()}, losses

    def personal(self, method, theta, cstate, groups):
        return cstate["model"]


@register("fedfomo", claims="personalisation_more")
def fedfomo(n_models: int = 8, epsilon: float = 0.3, epsilon_decay: float = 0.05, val_fraction: float = 0.2,
            norm: str = "l1") -> Method:
    """`n_models`: M models downloaded per round; ε-greedy with ε − round·decay; `val_fraction` of each
    client's training rows held out for the weights; `norm`: "l1" (official default) or "l2"."""
    if not isinstance(n_models, int) or n_models < 1 or not 0 <= epsilon <= 1 or epsilon_decay < 0 \
            or not 0 <= val_fraction < 1 or norm not in ("l1", "l2"):
        raise ValueError(f"FedFomo needs n_models >= 1, epsilon in [0, 1], epsilon_decay >= 0, val_fraction in "
                         f"[0, 1) and norm 'l1' or 'l2'; got {n_models}, {epsilon}, {epsilon_decay}, {val_fraction}, "
                         f"{norm!r}")
    return Method("fedfomo", ModelTable(), DataSizeWeighting(), weighted_mean, ServerAssign(),
                  client=FedFomoClient(n_models, float(epsilon), float(epsilon_decay), float(val_fraction), norm),
                  aggregate_key="model")
