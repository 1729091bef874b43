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


class ModelLoss:
    """loss(θ_flat, x, y) = mean of `criterion(outputs, y)` (default cross-entropy) of `model` with parameters θ
    (stateless, vmappable): what `make_loss` returns. Being one, rather than any callable of (θ, x, y), is what
    lets the loop train the module eagerly (`_train_eager`): the engine knows the loss is the model's own."""

    def __init__(self, model: torch.nn.Module, criterion=None):
        self.model = model            # the vmap backend builds its masked, per-tensor loss from the same module
        self.criterion = criterion
        self.spec = param_spec(model)
        self.buffer_spec = buffer_spec(model)

    def __call__(self, theta, x, y, buffers=None):
        params = unflatten(theta, self.spec)
        if buffers is not None:  # BatchNorm running statistics: a training-mode forward updates them in place
            params = {**params, **buffers}
        return (self.criterion or F.cross_entropy)(functional_call(self.model, params, (x,)), y)


def make_loss(model: torch.nn.Module, criterion=None) -> ModelLoss:
    """loss(θ_flat, x, y) = mean of `criterion(outputs, y)` (default cross-entropy) of `model` with parameters θ
    (stateless, vmappable). `criterion` is any per-batch mean loss, e.g. `torch.nn.functional.mse_loss`."""
    return ModelLoss(model, criterion)


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
    instead of a fresh one.

    With the model's own loss (`make_loss`, a `ModelLoss`) and no extra loss term the module is trained eagerly
    (`_train_eager`); any other `loss_fn(θ, x, y)` is differentiated as a function of the flat θ. Both take the
    same steps with the same arithmetic: the results are the same to the bit (tests/test_engine_loop.py)."""
    optimizer = optimizer or SGD()
    step_lr = client_lr(optimizer, lr)
    segments = None if groups is None or len(groups.trained) == len(groups.spec) else groups.segments("trained")
    plain = optimizer.plain and segments is None
    extra = objective.extra_loss is not None
    if isinstance(loss_fn, ModelLoss) and not extra:
        return _train_eager(loss_fn, theta, jobs, objective, optimizer, step_lr, plain, segments, start=start,
                            weights=weights, buffers=buffers, out=out)
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


def _train_eager(loss_fn: ModelLoss, theta, jobs, objective, optimizer, step_lr, plain, segments, *, start, weights,
                 buffers, out):
    """`train_clients_loop` on the module itself, as an eager torch loop trains one model (pfl-research's way).

    One flat working vector w holds the client's weights; the module's parameters are pointed, for the whole
    call, at leaf tensors that are views of w, so each step is a forward pass of the module, `autograd.grad` per
    parameter tensor and an in-place update of w through those views: no flattening, no `functional_call` and no
    zero-filled flat gradient per parameter tensor (what differentiating through slices of a flat θ builds).
    The arithmetic is the flat loop's, elementwise: the plain step is w ← w − (η·g) per tensor (`p.sub_(η * g)`
    has the bits of `w - η * g`); with a correction or another optimiser the tensors' gradients are concatenated
    into the flat g and the same flat step runs."""
    if not jobs:
        return theta.new_zeros(0, theta.numel()), theta.new_zeros(0)
    W = rows_out(out, len(jobs), theta)
    model, crit = loss_fn.model, loss_fn.criterion or F.cross_entropy
    work = torch.empty_like(theta)
    leaves = {name: v.detach().requires_grad_() for name, v in unflatten(work, loss_fn.spec).items()}
    params = tuple(leaves.values())
    slots = _Slots(model)
    losses = []
    try:
        slots.point(leaves)
        for i, job in enumerate(jobs):
            work.copy_(theta if start is None else start[i])
            state, total = _opt_state(optimizer, work), theta.new_zeros(())
            bufs = None if buffers is None else unflatten_buffers(buffers[i], loss_fn.buffer_spec)
            if bufs is not None:   # this client's running statistics: the forward updates them in place
                slots.point(bufs)
            for t, idx in enumerate(job.batches, 1):
                xb, yb = _rows(job, torch.as_tensor(idx, device=theta.device))
                loss = crit(model(xb), yb)
                grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
                corr = objective.correction(work, theta, job.ctx)
                with torch.no_grad():
                    if plain and corr is None:   # w ← w − η g, tensor by tensor through the views
                        torch._foreach_sub_(params, torch._foreach_mul(grads, step_lr))
                    else:
                        g = torch.cat([v.reshape(-1) for v in grads])
                        u = g if corr is None else g + corr
                        if plain:
                            work.sub_(step_lr * u)
                        else:
                            _optimizer_step(optimizer, work, u, state, torch.tensor(t), step_lr, segments)
                total += loss.detach()
            if bufs is not None:
                buffers[i] = torch.cat([v.reshape(-1).to(buffers.dtype) for v in bufs.values()])
            if weights:
                W[i].copy_(work)
            else:
                torch.sub(work, theta, out=W[i])
            losses.append(total / max(len(job.batches), 1))
    finally:
        slots.restore()
    return W, torch.stack(losses)


def _rows(job: LocalJob, idx: torch.Tensor) -> tuple:
    """The batch's rows (x[idx], y[idx]): `index_select` for an index vector (the same copy, half the dispatch)."""
    if idx.dim() == 1 and idx.dtype == torch.int64:
        return job.x.index_select(0, idx), job.y.index_select(0, idx)
    return job.x[idx], job.y[idx]


class _Slots:
    """Every place in a module that holds one of its parameters or buffers (a tied tensor: each place), to point
    them at other tensors by name for a while and back, as `torch.func.functional_call` does per call."""

    def __init__(self, model: torch.nn.Module):
        names = {id(p): n for n, p in model.named_parameters()} | {id(b): n for n, b in model.named_buffers()}
        self.places, seen = {}, set()
        for _, mod in model.named_modules(remove_duplicate=False):
            for table in (mod._parameters, mod._buffers):
                for key, t in table.items():
                    if t is not None and id(t) in names and (id(table), key) not in seen:
                        seen.add((id(table), key))
                        self.places.setdefault(names[id(t)], []).append((table, key, t))

    def point(self, tensors: dict) -> None:
        for name, t in tensors.items():
            for table, key, _ in self.places[name]:
                table[key] = t

    def restore(self) -> None:
        for places in self.places.values():
            for table, key, original in places:
                table[key] = original


def _optimizer_step(optimizer, w, u, state, t, lr, segments):
    """The optimiser's in-place step on each trained segment of the flat w (all of w when segments is None)."""
    for a, b in segments if segments is not None else [(0, w.numel())]:
        optimizer.step_(w[a:b], u[a:b], {n: s[a:b] for n, s in state.items()}, t, lr)
