"""Local training, one client after another (the `loop` backend), as a pure function of flat parameters.

A client's work is a `LocalJob` (core.round): its data and its mini-batch schedule, so the `vmap`
backend replays exactly the same steps. Each step is  u = ∇f̂_k(w; B) + correction(w, θ, ctx),  then the
client optimiser updates the trained tensors with u (plain SGD: w ← w − η u)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

from ..core.optim import SGD, client_lr
from ..core.round import LocalJob, batch_schedule  # noqa: F401  (re-exported: the engine's public names)
from ..models import buffer_spec, param_spec, unflatten, unflatten_buffers
from .rows import rows_out


def make_loss(model: torch.nn.Module, criterion=None):
    """loss(θ_flat, x, y) = mean of `criterion(outputs, y)` (default cross-entropy) of `model` with parameters θ
    (stateless, vmappable). `criterion` is any per-batch mean loss, e.g. `torch.nn.functional.mse_loss`."""
    spec = param_spec(model)
    crit = criterion or F.cross_entropy

    def loss(theta, x, y, buffers=None):
        params = unflatten(theta, spec)
        if buffers is not None:  # BatchNorm running statistics: a training-mode forward updates them in place
            params = {**params, **buffers}
        return crit(functional_call(model, params, (x,)), y)
    loss.model = model  # the vmap backend builds its masked, per-tensor loss from the same module
    loss.criterion = criterion
    loss.buffer_spec = buffer_spec(model)
    return loss


def with_extra_loss(loss_fn, objective, anchor: torch.Tensor):
    """f(w, x, y, ctx) = loss_fn(w, x, y) + mean of the objective's per-row `extra_loss` (MOON)."""
    model = getattr(loss_fn, "model", None)
    if model is None:
        raise ValueError(f"{type(objective).__name__} adds a loss term on the model; build the loss with make_loss(model)")
    spec = param_spec(model)

    def f(w, x, y, ctx):
        return loss_fn(w, x, y) + objective.extra_loss(model, unflatten(w, spec), x, y, anchor, ctx).mean()
    return f


def _opt_state(optimizer, like: torch.Tensor) -> dict:
    return {n: torch.zeros_like(like) for n in optimizer.state_names()}


def train_clients_loop(loss_fn, theta: torch.Tensor, jobs: list[LocalJob], lr: float, objective, *,
                       start: torch.Tensor | None = None, optimizer=None, groups=None, weights: bool = False,
                       buffers: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """Run every job's local training from its start row (θ for every client by default), anchored at θ.

    Returns (Δ = W − θ [m, d], mean local loss [m]), or (W [m, d], losses) with `weights=True`.
    `optimizer`: a `core.optim` SGD / Adam (default plain SGD at `lr`); `groups`: resolved parameter groups
    (only their trained tensors move); `buffers`: [m, b] each client's flat model buffers (BatchNorm running
    statistics, `models.flatten_buffers`), updated in place by its training (needed for models with buffers);
    `out`: an [m, d] matrix of θ's dtype and device to write the rows into (e.g. last round's, `rows.RoundRows`)
    instead of a fresh one."""
    optimizer = optimizer or SGD()
    step_lr = client_lr(optimizer, lr)
    segments = None if groups is None or len(groups.trained) == len(groups.spec) else groups.segments("trained")
    plain = optimizer.plain and segments is None
    extra = objective.extra_loss is not None
    grad_fn = grad_and_value(with_extra_loss(loss_fn, objective, theta) if extra else loss_fn)
    trained, losses = [], []
    for i, job in enumerate(jobs):
        w = (theta if start is None else start[i]).clone()
        state, total = _opt_state(optimizer, w), theta.new_zeros(())
        bufs = {} if buffers is None else {"buffers": unflatten_buffers(buffers[i], loss_fn.buffer_spec)}
        if bufs and extra:
            raise ValueError(f"{type(objective).__name__}'s extra loss does not support models with buffers (BatchNorm)")
        for t, idx in enumerate(job.batches, 1):
            idx = torch.as_tensor(idx, device=theta.device)
            g, loss = grad_fn(w, job.x[idx], job.y[idx], *((job.ctx,) if extra else ()), **bufs)
            corr = objective.correction(w, theta, job.ctx)
            u = g if corr is None else g + corr
            if plain:
                w = w - step_lr * u   # the FedAvg step, exactly as written
            else:
                _optimizer_step(optimizer, w, u, state, torch.tensor(t), step_lr, segments)
            total += loss.detach()
        if bufs:  # the client's updated running statistics back into its row
            buffers[i] = torch.cat([v.reshape(-1).to(buffers.dtype) for v in bufs["buffers"].values()])
        trained.append(w if weights else w - theta)
        losses.append(total / max(len(job.batches), 1))
    if not jobs:
        return theta.new_zeros(0, theta.numel()), theta.new_zeros(0)
    return torch.stack(trained, out=rows_out(out, len(jobs), theta)), torch.stack(losses)


def _optimizer_step(optimizer, w, u, state, t, lr, segments):
    """The optimiser's in-place step on each trained segment of the flat w (all of w when segments is None)."""
    for a, b in segments if segments is not None else [(0, w.numel())]:
        optimizer.step_(w[a:b], u[a:b], {n: s[a:b] for n, s in state.items()}, t, lr)
