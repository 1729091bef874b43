"""Vectorised clients (the `vmap` backend): the local SGD of `train_clients_loop`, for many clients in
one batched computation with `torch.func`.

The m clients' parameters are stacked into W ∈ R^{m×d}. At local step s every client k with τ_k > s takes

    w_k ← w_k − η (∇f̂_k(w_k; B_k^s) + correction(w_k, θ, ctx_k)),

where f̂_k(w; B) is the mean loss over the *real* rows of batch B: batches are padded to the largest one
of the step and a 0/1 row mask removes the padding from the mean. A client whose schedule is shorter
(fewer rows, a straggler) is frozen once its τ_k steps are done. Clients are sorted by τ_k (longest
first), so the clients still active at step s are a prefix W[:a_s] and frozen ones cost nothing.
No data is truncated; batches and their order are exactly the loop backend's.

Memory: clients are processed in chunks sized from a budget (`MEMORY_BUDGET`, bytes; default 256 MiB
on CPU, half the free memory on CUDA) and an estimate of one client's working set (a few copies of d
parameters + its batch's saved activations, measured once with autograd's saved-tensor hooks).
"""
from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..core.optim import client_lr
from ..models import param_spec, unflatten
from . import fused
from .rows import rows_out, stacked_views

MEMORY_BUDGET: int | None = None      # bytes for one chunk's working set; None = device default
CPU_BUDGET = 256 * 2**20
CUDA_FREE_FRACTION = 0.5
PARAM_COPIES = 6                      # d-float buffers per client: W, ∇, correction temporaries, Δ, slack
_ACTIVATIONS = weakref.WeakKeyDictionary()  # model or loss_fn → {shapes: bytes per row}; a run's rounds share one


# --- the masked loss --------------------------------------------------------------------------------
def make_masked_loss(model: nn.Module, criterion=None):
    """loss(params, x [B, D], y [B], mask [B]) = Σ_i mask_i ℓ_i / Σ_i mask_i: the mean loss of the real rows
    of a padded batch (0 when the batch is all padding). `params`: name → tensor. ℓ: cross-entropy, or
    `criterion(outputs, y, reduction="none")` (a torch.nn.functional loss) when given."""
    crit = criterion or F.cross_entropy

    def loss(params, x, y, mask):
        per_row = crit(functional_call(model, params, (x,)), y, reduction="none")
        if criterion is not None:  # regression losses come per output entry
            per_row = per_row.reshape(per_row.shape[0], -1).mean(1)
        return (per_row * mask).sum() / mask.sum().clamp_min(1)
    return loss


def model_of(loss_fn) -> nn.Module | None:
    """The model behind a `make_loss(model)` closure (its `.model`, or the module among its cells)."""
    model = getattr(loss_fn, "model", None)
    if isinstance(model, nn.Module):
        return model
    for cell in getattr(loss_fn, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, nn.Module):
                return cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return None


def param_loss(loss_fn, theta: torch.Tensor, model: nn.Module | None):
    """(spec, loss(params, x, y, mask)): the masked loss as a function of the parameter tensors.

    With the model, gradients are taken per parameter tensor, which is what makes a vmapped step fast:
    differentiating through the slices of one flat vector would build and sum a zero-filled [m, d]
    gradient per parameter tensor. Without it, any row-mean `loss_fn(θ, x, y)` works, with one flat
    "parameter", evaluated row by row (slower)."""
    if model is not None:
        return param_spec(model), make_masked_loss(model, getattr(loss_fn, "criterion", None))

    def rowwise(params, x, y, mask):
        per_row = vmap(lambda xi, yi: loss_fn(params["theta"], xi[None], yi[None]))(x, y)
        return (per_row * mask).sum() / mask.sum().clamp_min(1)
    return [("theta", theta.shape)], rowwise


# --- chunk sizing -----------------------------------------------------------------------------------
def activation_bytes_per_row(loss_fn, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for the backward pass per input row (saved tensors at 2 rows − at 1 row;
    the parameters it saves cancel out)."""
    def saved_bytes(rows: int) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t
        w = theta.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(w, x[:rows], y[:rows])
        return total
    if len(y) < 2:
        return saved_bytes(1)
    return max(saved_bytes(2) - saved_bytes(1), 0)


def cached_activation_bytes(loss_fn, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, model=None) -> int:
    """`activation_bytes_per_row`, measured once per model (else loss_fn), row shape and row count (1 or 2
    rows take different paths there): the saved activations depend on the architecture, not the weights."""
    key = (len(y), tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype, theta.numel(), theta.dtype,
           theta.device.type)
    try:
        known = _ACTIVATIONS.setdefault(loss_fn if model is None else model, {})
    except TypeError:  # an owner that takes no weak reference is measured every time
        known = {}
    if key not in known:
        known[key] = activation_bytes_per_row(loss_fn, theta, x, y)
    return known[key]


def memory_budget(device: torch.device) -> int:
    """Bytes one chunk may use: `MEMORY_BUDGET` if set, else 256 MiB on CPU / half the free CUDA memory."""
    if MEMORY_BUDGET is not None:
        return int(MEMORY_BUDGET)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(CUDA_FREE_FRACTION * free)
    return CPU_BUDGET


def plan_chunks(cost: np.ndarray, budget: int) -> list[np.ndarray]:
    """Cut positions 0..m−1 into consecutive chunks whose summed `cost` stays within `budget`
    (at least one client per chunk)."""
    chunks, start, used = [], 0, 0
    for i, c in enumerate(cost):
        if i > start and used + c > budget:
            chunks.append(np.arange(start, i))
            start, used = i, 0
        used += c
    chunks.append(np.arange(start, len(cost)))
    return chunks


# --- one chunk ----------------------------------------------------------------------------------------
GATHER_MIN_BYTES = 1 << 22  # below 4 MiB of client data, copying every row costs less than finding the used ones


def used_rows_only(jobs: list) -> list:
    """The jobs with only the rows their batches use (batches re-indexed), when that is under half of their
    rows and their data is over `GATHER_MIN_BYTES`: a step or two on large clients need not copy every
    client's data into the chunk each round."""
    if sum(j.x.numel() * j.x.element_size() for j in jobs) < GATHER_MIN_BYTES:
        return jobs
    used = [np.unique(np.concatenate([np.asarray(b, dtype=np.int64) for b in j.batches]))
            if j.batches else np.zeros(1, dtype=np.int64) for j in jobs]  # row 0: a padding row for τ = 0
    if 2 * sum(len(u) for u in used) >= sum(len(j.y) for j in jobs):
        return jobs
    return [replace(j, x=j.x[torch.as_tensor(u)], y=j.y[torch.as_tensor(u)],
                    batches=[np.searchsorted(u, np.asarray(b, dtype=np.int64)) for b in j.batches])
            for j, u in zip(jobs, used)]


def padded_schedule(jobs, offsets: np.ndarray):
    """(rows [S, c, B] int64 into the chunk's concatenated data, mask [S, c, B], steps τ [c]); padding
    points at the client's first row and has mask 0."""
    tau = np.array([len(j.batches) for j in jobs])
    S = int(tau.max(initial=0))
    B = max((len(b) for j in jobs for b in j.batches), default=1)
    rows = np.repeat(offsets[None, :, None], S, 0).repeat(B, 2)
    mask = np.zeros((S, len(jobs), B), dtype=np.float32)
    for k, job in enumerate(jobs):
        for s, idx in enumerate(job.batches):
            rows[s, k, :len(idx)] = offsets[k] + np.asarray(idx)
            mask[s, k, :len(idx)] = 1.0
    return rows, mask, tau


def _masked_extra_loss(loss, objective, model):
    """The masked loss plus the objective's per-row `extra_loss` averaged over the real rows (MOON)."""
    if model is None:
        raise ValueError(f"{type(objective).__name__} adds a loss term on the model; build the loss with make_loss(model)")

    def full(params, x, y, mask, ctx, anchor):
        extra = objective.extra_loss(model, params, x, y, anchor, ctx)
        return loss(params, x, y, mask) + (extra * mask).sum() / mask.sum().clamp_min(1)
    return full


def _client_step(loss, spec, objective, with_correction: bool, model=None):
    """One client's (update direction ∇f̂_k + correction per parameter tensor, batch loss); vmapped."""
    extra = objective.extra_loss is not None
    grad_loss = grad_and_value(_masked_extra_loss(loss, objective, model) if extra else loss)

    def step(params, x, y, mask, ctx, anchor):
        g, value = grad_loss(params, x, y, mask, *((ctx, anchor) if extra else ()))
        if with_correction:  # the objective's term sees the flat w, as in the loop
            w = torch.cat([params[name].reshape(-1) for name, _ in spec])
            corr = unflatten(objective.correction(w, anchor, ctx), spec)
            g = {name: g[name] + corr[name] for name in g}
        return g, value
    return step


def _fused_correction(objective, theta: torch.Tensor, ctx: torch.Tensor | None, spec):
    """correction(lo, sub, a) for fused.train_blocked: the objective's term for clients lo..lo+a−1 at their
    weights `sub` (per-parameter stacks), vmapped over clients as in the vmap step, as [a, *shape] stacks."""
    term = vmap(objective.correction, in_dims=(0, None, None if ctx is None else 0))

    def correction(lo, sub, a):
        w = torch.cat([sub[name][:a].reshape(a, -1) for name, _ in spec], 1)  # the flat w the objective sees
        return stacked_views(term(w, theta, None if ctx is None else ctx[lo:lo + a]), spec)
    return correction


def _train_chunk(step, spec, theta, jobs, lr, out, where, weights, start=None, optimizer=None, trained=None,
                 layers=None, corrected=None):
    """Local training of `jobs` (sorted by τ, longest first) from their start rows (θ by default), anchored
    at θ; writes their rows out[where] (W, or W − θ unless `weights`) and returns their mean loss [c]. Only
    tensors in `trained` move (all when None). `layers`: take the fused step of engine/fused.py instead of
    the vmapped autograd step, a cache block of clients at a time (fused.train_blocked), with the correction
    term of the objective `corrected` (None: no term) and the client optimiser."""
    dev, c = theta.device, len(jobs)
    jobs = used_rows_only(jobs)
    sizes = np.array([len(j.y) for j in jobs])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows, mask, tau = padded_schedule(jobs, offsets)
    active = [int((tau > s).sum()) for s in range(len(rows))]      # prefix of still-training clients
    width = [int(mask[s].sum(1).max()) for s in range(len(rows))]  # largest real batch of the step
    x = torch.cat([j.x for j in jobs]).to(dev)
    y = torch.cat([j.y for j in jobs]).to(dev)
    rows, mask = torch.as_tensor(rows, device=dev), torch.as_tensor(mask, device=dev, dtype=theta.dtype)
    with_ctx = jobs[0].ctx is not None
    ctx = torch.stack([j.ctx for j in jobs]).to(dev) if with_ctx else None
    steps = torch.as_tensor(tau, device=dev, dtype=theta.dtype).clamp_min(1)
    total = theta.new_zeros(c)
    step_lr = client_lr(optimizer, lr)
    if layers is not None:
        block = fused.block_clients(theta.numel(), theta.element_size())
        correction = None if corrected is None else _fused_correction(corrected, theta, ctx, spec)
        write = lambda lo, hi, sub: fused.write_rows(out, where[lo:hi], sub, spec, None if weights else theta)
        fused.train_blocked(theta if start is None else start, spec, layers, active, width, rows, mask, x, y,
                            step_lr, total, block, write, correction, optimizer, trained)
        return total / steps
    batched = vmap(step, in_dims=(0, 0, 0, 0, 0 if with_ctx else None, None))
    W = theta.repeat(c, 1) if start is None else start   # the clients' flat parameters, [c, d] (a fresh copy)
    P = stacked_views(W, spec)    # the same memory, one [c, *shape] view per parameter tensor
    moving = [n for n in P if trained is None or n in trained]
    plain = optimizer is None or (optimizer.plain and trained is None)
    if not plain:
        buffers = {k: torch.zeros_like(W) for k in optimizer.state_names()}
        views = {k: stacked_views(b, spec) for k, b in buffers.items()}
    for s, (a, b) in enumerate(zip(active, width)):
        idx = rows[s, :a, :b]
        g, loss = batched({n: p[:a] for n, p in P.items()}, x[idx], y[idx], mask[s, :a, :b],
                          ctx[:a] if with_ctx else None, theta)
        t = torch.tensor(s + 1)  # every active client is at its (s+1)-th step
        for name in moving:
            if plain:
                P[name][:a].sub_(g[name], alpha=step_lr)  # w ← w − η·u
            else:
                optimizer.step_(P[name][:a], g[name], {k: v[name][:a] for k, v in views.items()}, t, step_lr)
        total[:a] += loss.detach()
    out.index_copy_(0, where, W if weights else W.sub_(theta))
    return total / steps


# --- the backend --------------------------------------------------------------------------------------
def train_clients_vmap(loss_fn, theta: torch.Tensor, jobs: list, lr: float, objective, *,
                       budget: int | None = None, model: nn.Module | None = None, start: torch.Tensor | None = None,
                       optimizer=None, groups=None, weights: bool = False, fuse: bool = False,
                       out: torch.Tensor | None = None):
    """Same contract and result as `train_clients_loop`: every job's local training from its start row
    (θ by default), returned as (Δ [m, d], mean local loss [m]) — or (W, losses) with `weights=True` —
    computed in memory-bounded chunks of vmapped clients. `budget`: bytes per chunk (default
    `memory_budget`); `model`: gives the masked loss directly; `optimizer`, `groups`, `out`: as in the loop;
    `fuse`: use the fused Linear-chain step (engine/fused.py) where the run qualifies."""
    if not jobs:
        return theta.new_zeros(0, theta.numel()), theta.new_zeros(0)
    if not objective.vmappable:
        raise ValueError(f"{type(objective).__name__} is not vmappable; use backend='loop'")
    model = model or model_of(loss_fn)
    if model is not None and next(model.buffers(), None) is not None:
        raise ValueError("models with buffers (BatchNorm running statistics) train on the loop backend only")
    spec, loss = param_loss(loss_fn, theta, model)
    ctx0 = jobs[0].ctx
    with_correction = objective.correction(theta, theta, None if ctx0 is None else ctx0.to(theta.device)) is not None
    step = _client_step(loss, spec, objective, with_correction, model)
    order = np.argsort([-len(j.batches) for j in jobs], kind="stable")
    jobs_sorted = [jobs[i] for i in order]
    trained = None if groups is None or len(groups.trained) == len(groups.spec) else groups.trained
    if trained is not None and spec[0][0] == "theta":
        raise ValueError("parameter groups need the model behind loss_fn (make_loss(model)); use backend='loop'")
    layers = fused.fusable(model, loss_fn, objective) if fuse else None

    j0 = jobs_sorted[0]
    row_bytes = j0.x[:1].numel() * j0.x.element_size() + j0.y.element_size()
    batch = max((len(b) for j in jobs for b in j.batches), default=1)
    act = cached_activation_bytes(loss_fn, theta, j0.x[:2].to(theta.device), j0.y[:2].to(theta.device), model)
    copies = PARAM_COPIES + (j0.ctx is not None) + (0 if optimizer is None else len(optimizer.state_names()))
    per_param = theta.numel() * theta.element_size() * copies
    cost = np.array([per_param + 2 * batch * (act + row_bytes) + len(j.y) * row_bytes for j in jobs_sorted])
    chunks = plan_chunks(cost, budget if budget is not None else memory_budget(theta.device))

    out = rows_out(out, len(jobs), theta)
    losses = theta.new_empty(len(jobs))
    for chunk in chunks:
        where = torch.as_tensor(order[chunk], device=theta.device)
        W0 = None if start is None else start.index_select(0, where)
        l = _train_chunk(step, spec, theta, [jobs_sorted[i] for i in chunk], lr, out, where, weights, W0, optimizer,
                         trained, layers, objective if with_correction else None)
        losses.index_copy_(0, where, l)
    return out, losses


def train_clients_fused(loss_fn, theta: torch.Tensor, jobs: list, lr: float, objective, **kwargs):
    """The `fused` backend: `train_clients_vmap` with the fused Linear-chain SGD step where the run
    qualifies (engine/fused.py `fusable`), the vmapped autograd step otherwise."""
    return train_clients_vmap(loss_fn, theta, jobs, lr, objective, fuse=True, **kwargs)
