"""FedSelect — Tamirisa, Xie, Bao, Zhou, Arel, Shamsian, "FedSelect: Personalized Federated Learning with
Customized Selection of Parameters for Fine-Tuning", CVPR 2024 (arXiv:2404.02478; an earlier workshop version
is arXiv:2306.13264). Official code: https://github.com/lapisrocks/fedselect

Each client k keeps a binary mask m_k over the parameters (1 = personal, kept on the client; 0 = global,
averaged by the server); it starts all-zero and only grows. One round, client k:
  1. starts from θ on its global coordinates and from its own values on its personal ones;
  2. LocalAlt: each local epoch is one pass of SGD on the personal coordinates (global ones fixed), then one
     pass on the global coordinates (personal ones fixed);
  3. sends the update of its global coordinates only, Δ_k ⊙ (1 − m_k), with the mask;
  4. every `every`-th of its rounds (not the first), GradSelect grows m_k: in each eligible tensor ("weight"
     tensors) whose personal fraction is still ≤ the limit α, the fraction p of the still-global coordinates
     with the largest |w_now − w_at_last_growth| become personal (the new mask is used from the next round).
The server averages each coordinate over the clients that share it:  θ_j ← θ_j + Σ_k a_k s_kj Δ_kj / Σ_k a_k s_kj
with s_kj = 1 − m_kj (a_k = 1 in the official code: a plain count); a coordinate nobody shares stays put.

Checked against the official code (fedselect.py, lottery_ticket.py, broadcast.py, pflopt/optimizers.py):
the personal pass comes first in every epoch (`MaskLocalAltSGD` starts toggled to the mask); growth runs when
`round % lth_epoch_iters == 0 and round != 0` and skips a layer whose personal fraction is already above
`prune_target` (so a layer may end up to one step above the limit); the number selected is
n_free − round((1 − p)·n_free); the reference point of |Δ| is the client's trained weights at its last growth
(θ₀ at first); biases are never selected; coordinates that become personal in round r still receive round r's
average (the broadcast uses the mask the client trained with), so a new personal coordinate starts from the
global value. The personal model evaluated is, as in the official code (`cross_client_eval` on the clients'
state dicts before the broadcast), the client's weights right after its local training (`evaluate="trained"`);
`evaluate="next_start"` evaluates the model it starts its next round from instead (the shared coordinates
overwritten by the new average). The personal set grows from empty: the official `fedselect_algorithm` starts
from `init_mask_zeros` and calls `delta_update(..., invert=True)` (the `invert=False` default of
`lottery_ticket.delta_update` is the pruning direction, which it does not use). Differences: rounds are counted
per client (the official code trains every client every round, where the two counts agree), and ties in |Δ| are
broken by position (the code takes every tie at the cut-off)."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

import numpy as np
import torch

from ...core.messages import Transform
from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, UniformWeighting
from ...core.registry import register
from ...core.round import batch_schedule
from ...core.streams import register_stream
from ...utils import rng

FEDSELECT = register_stream("fedselect", 44)   # the batch order of LocalAlt's second (global) pass


# --- GradSelect: which coordinates become personal -----------------------------------------------------
def grow_mask(mask: torch.Tensor, delta: torch.Tensor, rate: float, limit: float, segments) -> torch.Tensor:
    """The grown bool mask [d] (True = personal): in each (start, end) segment whose personal fraction is
    ≤ `limit`, the n_free − round((1 − rate)·n_free) still-global coordinates with the largest |delta|
    join the personal set (ties: the earlier position first). Masks only grow."""
    new = mask.clone()
    for a, b in segments:
        part = mask[a:b]
        if part.float().mean().item() > limit:  # the layer reached its personalisation limit α
            continue
        free = (~part).nonzero().ravel()
        k = len(free) - int(round((1 - rate) * len(free)))
        if k <= 0:
            continue
        order = torch.sort(delta[a:b][free].abs(), descending=True, stable=True).indices
        new[a + free[order[:k]]] = True
    return new


def eligible_segments(spec, patterns) -> list[tuple[int, int]]:
    """(start, end) in the flat vector of the tensors whose names match `patterns` (default: '*weight')."""
    out, i = [], 0
    for name, shape in spec:
        n = int(np.prod(shape))
        if any(fnmatch(name, p) for p in patterns):
            out.append((i, i + n))
        i += n
    if not out:
        raise ValueError(f"FedSelect's eligible patterns {patterns!r} match no parameter; the model has "
                         f"{', '.join(n for n, _ in spec)}")
    return out


# --- the server: per-coordinate average over the clients that share the coordinate ---------------------
@dataclass
class SharedCoordinateMean:
    """Rule: Σ_k a_k s_kj Δ_kj / Σ_k a_k s_kj per coordinate j over the round's clients, s = the message's
    "shared" mask (0 where no client shares j). Its state keeps the round's mean shared fraction, reported
    as the History column `shared_fraction`."""
    uses_context = True

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"shared_fraction": torch.ones(())}

    def aggregate(self, state: dict, deltas: torch.Tensor, weights: torch.Tensor, info) -> tuple[torch.Tensor, dict]:
        shared = info.messages["shared"].to(deltas.dtype)
        return masked_mean(deltas, shared, weights), {"shared_fraction": shared.mean().cpu()}

    def metrics(self, state: dict) -> dict:
        return {"shared_fraction": float(state["shared_fraction"])}


def masked_mean(deltas: torch.Tensor, shared: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k a_k s_kj Δ_kj / Σ_k a_k s_kj for every coordinate j (0 where Σ_k a_k s_kj = 0)."""
    if (weights < 0).any():
        raise ValueError("aggregation weights must be non-negative")
    w = weights.to(deltas.dtype)[:, None] * shared
    total = w.sum(0)
    return torch.where(total > 0, (w * deltas).sum(0) / total.clamp_min(torch.finfo(deltas.dtype).tiny), 0.0)


# --- the uplink: only the shared coordinates travel ------------------------------------------------------
def encode_shared(delta: torch.Tensor, shared: torch.Tensor) -> bytes:
    """One client's wire message: the packed bit mask (⌈d/8⌉ bytes), then the shared coordinates' values."""
    s = shared.cpu().numpy().astype(bool)
    return np.packbits(s).tobytes() + np.ascontiguousarray(delta.detach().cpu().numpy()[s]).tobytes()


def decode_shared(blob: bytes, d: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta [d] with zeros on the personal coordinates, shared mask [d]) from `encode_shared`'s bytes."""
    nbits = -(-d // 8)
    s = np.unpackbits(np.frombuffer(blob[:nbits], dtype=np.uint8))[:d].astype(bool)
    values = np.frombuffer(blob[nbits:], dtype=torch.empty((), dtype=dtype).numpy().dtype)
    delta = np.zeros(d, dtype=values.dtype)
    delta[s] = values
    return torch.from_numpy(delta), torch.from_numpy(s)


class SharedPartBytes(Transform):
    """Uplink transform: each client's wire size is measured from `encode_shared` (mask bits + the values of
    its shared coordinates), so bytes_up falls as the personal sets grow."""

    def __call__(self, msgs, cstate, ctx):
        sizes = [len(encode_shared(d, s)) for d, s in zip(msgs["delta"], msgs["shared"])]
        msgs.bytes = torch.tensor(sizes, dtype=torch.int64)
        return msgs, cstate


# --- the client: LocalAlt on (personal, global) coordinates, then GradSelect -------------------------------
def local_alt(loss_fn, w: torch.Tensor, personal: torch.Tensor, batches, second, x, y, lr: float):
    """LocalAlt from w [d]: for each chunk of `batches` (one epoch), plain SGD on the personal coordinates
    (the rest fixed), then on the global ones over `second`'s batches of that epoch. Returns (w, mean loss)."""
    on_personal, on_global = personal.to(w.dtype), (~personal).to(w.dtype)
    losses = []
    for mine, theirs in zip(batches, second):
        for mask, chunk in ((on_personal, mine), (on_global, theirs)):
            if mask is on_personal and not personal.any():
                continue  # nothing personal yet: the pass would not move w
            for idx in chunk:
                idx = torch.as_tensor(idx, device=w.device)
                w = w.detach().requires_grad_()
                loss = loss_fn(w, x[idx], y[idx])
                g, = torch.autograd.grad(loss, w)  # plain autograd: ~10x less overhead than torch.func per step
                w = (w - lr * mask * g).detach()
                losses.append(loss.detach())
    return w, torch.stack(losses).mean() if losses else w.new_zeros(())


def epochs_of(batches: list, n: int, batch_size: int) -> list[list]:
    """A client's batch schedule cut into epochs of ⌈n / batch_size⌉ batches (the last may be shorter)."""
    per = max(1, -(-n // batch_size))
    return [batches[i:i + per] for i in range(0, len(batches), per)]


@dataclass
class FedSelectClient(OwnTraining):
    """Store entries per client: "mask" (personal set for its next round), "kept" (the personal set it
    trained with: those coordinates start from "own" next round), "own" (its last trained weights),
    "snapshot" (its weights at its last growth, θ₀ at first) and "rounds" (rounds it has trained)."""
    rate: float = 0.25
    limit: float = 0.8
    every: int = 3
    eligible: tuple = ("*weight",)
    evaluate: str = "trained"

    def client_state(self, method, theta, groups):
        off = torch.zeros(theta.numel(), dtype=torch.bool, device=theta.device)
        return {"mask": off, "kept": off.clone(), "own": theta.clone(), "snapshot": theta.clone(),
                "rounds": torch.zeros(1, dtype=torch.int64, device=theta.device)}

    def start_rows(self, theta: torch.Tensor, cstate: dict) -> torch.Tensor:
        """θ on the global coordinates, the client's own values on the personal ones it trained with."""
        return torch.where(cstate["kept"], cstate["own"].to(theta.dtype), theta)

    def local_train(self, method, ctx, jobs, down, cstate):
        model = ctx.model
        if next(model.buffers(), None) is not None:
            raise ValueError("FedSelect trains flat parameters only; use a model without buffers (BatchNorm)")
        theta = down["theta"]
        segments = eligible_segments(ctx.groups.spec, self.eligible)
        W, losses = self.start_rows(theta, cstate), []
        new = {k: v.clone() for k, v in cstate.items()}
        for i, job in enumerate(jobs):
            n, personal = len(job.y), cstate["mask"][i]
            second = batch_schedule(n, ctx.batch_size, 1, len(job.batches), rng(ctx.seed, FEDSELECT, ctx.round, job.client_id))
            mine = epochs_of(job.batches, n, ctx.batch_size)
            theirs = [second[sum(map(len, mine[:e])):][:len(c)] for e, c in enumerate(mine)]
            W[i], loss = local_alt(ctx.loss_fn, W[i], personal, mine, theirs, job.x, job.y, ctx.lr)
            losses.append(loss)
            t = int(cstate["rounds"][i])
            if t % self.every == 0 and t != 0:  # GradSelect, as the official code (round % lth_iters == 0, not 0)
                new["mask"][i] = grow_mask(personal, W[i] - cstate["snapshot"][i], self.rate, self.limit, segments)
                new["snapshot"][i] = W[i]
        new["kept"], new["own"], new["rounds"] = cstate["mask"].clone(), W.clone(), cstate["rounds"] + 1
        shared = ~cstate["mask"]
        delta = (W - theta) * shared.to(W.dtype)
        return {"delta": delta, "shared": shared}, new, torch.stack(losses)

    def personal(self, method, theta, cstate, groups):
        """The official protocol ("trained"): the weights of the client's last local training; before its first
        round, or with evaluate="next_start", the model it would start its next round from."""
        start = self.start_rows(theta, cstate)
        if self.evaluate == "next_start":
            return start
        return torch.where(cstate["rounds"] > 0, cstate["own"].to(theta.dtype), start)


def personal_fraction(mask: torch.Tensor, spec) -> dict:
    """Fraction of personal coordinates per parameter tensor, averaged over the rows of `mask` [K, d]."""
    out, i = {}, 0
    for name, shape in spec:
        n = int(np.prod(shape))
        out[name] = float(mask[:, i:i + n].float().mean())
        i += n
    return out


@register("fedselect", claims="fedselect")
def fedselect(rate: float = 0.25, limit: float = 0.8, every: int = 3, eligible=("*weight",),
              weighting: str = "uniform", evaluate: str = "trained") -> Method:
    """`rate` p: fraction of the still-global coordinates of a layer made personal per growth step; `limit` α:
    a layer stops growing once its personal fraction exceeds it; `every`: growth every that many rounds of the
    client (defaults: the official code's `prune_percent` 25, `prune_target` 80, `lth_epoch_iters` 3);
    `eligible`: glob patterns of the tensors that may become personal (the code: names containing "weight");
    `weighting`: "uniform" (the official count average) or "size" (n_k-weighted); `evaluate`: the personal model
    is the client's weights after local training ("trained", the official code) or its next round's start
    ("next_start")."""
    if not 0 < rate < 1:
        raise ValueError(f"FedSelect's rate (p) is a fraction in (0, 1), got {rate!r}")
    if not 0 <= limit <= 1:
        raise ValueError(f"FedSelect's limit (α) is a fraction in [0, 1], got {limit!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"FedSelect's every must be an int >= 1 (rounds between growth steps), got {every!r}")
    if evaluate not in ("trained", "next_start"):
        raise ValueError(f"FedSelect's evaluate must be 'trained' (official) or 'next_start', got {evaluate!r}")
    if weighting not in ("uniform", "size"):
        raise ValueError(f"FedSelect's weighting must be 'uniform' (official) or 'size', got {weighting!r}")
    eligible = (eligible,) if isinstance(eligible, str) else tuple(eligible)
    weights = UniformWeighting() if weighting == "uniform" else DataSizeWeighting()
    return Method("fedselect", weighting=weights, rule=SharedCoordinateMean(), server_opt=ServerSGD(),
                  uplink=(SharedPartBytes(),), client=FedSelectClient(float(rate), float(limit), every, eligible, evaluate))
