"""A fused local SGD step for chains of Linear layers (the `fused` backend): the vmap backend's step for the
library's `LogisticRegression` and ReLU `MLP`, written out by hand with batched matrix products.

For m clients with weights W_l ∈ R^{m×out×in}, one step on padded batches X ∈ R^{m×B×in} with a 0/1 row mask is

    forward    Z_l = H_{l−1} W_lᵀ + b_l,  H_l = ReLU(Z_l)                  (torch.baddbmm)
    loss       f_k = Σ_i mask_ki CE(Z_L,ki, y_ki) / Σ_i mask_ki
    backward   δ_L = (softmax(Z_L) − onehot(y)) · mask / Σ mask,  δ_{l−1} = (δ_l W_l) ⊙ 1[H_{l−1} > 0]
    update     W_l ← W_l − η δ_lᵀ H_{l−1}  (one in-place baddbmm: the [m, out, in] gradient is never stored),
               b_l ← b_l − η Σ_i δ_l,i

which is the gradient autograd computes, so the result equals the vmap and loop backends' up to floating-point
summation order (tests/test_vmap.py). It skips autograd and torch.func's per-step dispatch, which dominate the
step for small layers. It applies to the cross-entropy of such a model with no objective loss term (MOON's
contrastive term needs autograd); `fusable` says whether a run qualifies. An objective's `correction` (FedProx's
μ(w − θ), SCAFFOLD's c − c_k) is evaluated at the weights before each step and subtracted after the update.
Client optimisers: heavy-ball momentum adds the product into its buffer in place (b ← μb + δᵀH, one
baddbmm_); Adam, Nesterov and weight decay alone take the gradient materialised (`make_update`). Frozen
tensors of parameter groups are not updated and their gradients are not formed.

`train_blocked` runs the steps in blocks of clients whose weights fit in cache (`BLOCK_BYTES`): each block
takes all its local steps before the next starts, so a client's weights are read from memory once per round
rather than once per step. The clients are independent, so the result is the same, bit for bit.

A block's weights train as one contiguous [block, *shape] stack per parameter tensor (reused by every
block), not as views of the flat rows [c, d]: torch runs an in-place batched product on a contiguous
stack as one batched GEMM, on strided views as one product per client. `write_rows` puts a finished block
into the round's rows.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..core.optim import SGD
from ..models import MLP, LogisticRegression
from .rows import stacked_views


def linear_layers(model: nn.Module | None) -> list[tuple[str, str]] | None:
    """[(weight name, bias name)] of the model's Linear layers in order, if it is the library's
    LogisticRegression or ReLU MLP or a bare torch Linear layer with a bias (exactly those classes); else None."""
    if type(model) is nn.Linear and model.bias is not None:
        return [("weight", "bias")]
    if type(model) is LogisticRegression:
        return [("linear.weight", "linear.bias")]
    if type(model) is MLP:
        mods = list(model.body)
        linears = [i for i, m in enumerate(mods) if isinstance(m, nn.Linear)]
        if all(isinstance(m, nn.ReLU) for i, m in enumerate(mods) if i not in linears):
            return [(f"body.{i}.weight", f"body.{i}.bias") for i in linears]
    return None


def fusable(model, loss_fn, objective) -> list | None:
    """The model's layers when the fused step computes exactly this run's local training (any client optimiser
    or parameter groups), else None."""
    if objective.extra_loss is not None or getattr(loss_fn, "criterion", None) is not None:
        return None
    return linear_layers(model)


def load_rows(P: dict[str, torch.Tensor], W: torch.Tensor, spec, n: int) -> None:
    """P[name][:n] = n clients' start parameters: their flat rows W [n, d], or θ [d] for all of them."""
    for name, v in stacked_views(W.expand(n, -1) if W.dim() == 1 else W, spec).items():
        P[name][:n].copy_(v)


ROW_BYTES = 4096   # rows at least this long are written one by one: one pass, the per-call overhead is small


def write_rows(out: torch.Tensor, where: torch.Tensor, P: dict[str, torch.Tensor], spec,
               minus: torch.Tensor | None) -> None:
    """out[where] = the clients' flat rows from their stacks P (less θ `minus` when given). Long rows are
    written client by client, the subtraction going straight into the row (one pass over the memory);
    short ones a parameter tensor at a time, for all clients in one call."""
    cut = [0]
    for _, shape in spec:
        cut.append(cut[-1] + math.prod(shape))
    parts = [(P[name].reshape(len(where), -1), slice(lo, hi)) for (name, _), lo, hi in zip(spec, cut, cut[1:])]
    if out.shape[1] * out.element_size() >= ROW_BYTES:
        for k, row in enumerate(where.tolist()):
            for src, cols in parts:
                if minus is None:
                    out[row, cols].copy_(src[k])
                else:
                    torch.sub(src[k], minus[cols], out=out[row, cols])
        return
    for src, cols in parts:
        out[:, cols].index_copy_(0, where, src if minus is None else src - minus[cols])


BLOCK_BYTES = 8 * 2**20   # one block's weights, within L3: the fastest of 0.5-32 MiB on an AMX Xeon (2 MiB L2)


def block_clients(d: int, itemsize: int) -> int:
    """How many clients of d parameters make one cache block (at least one)."""
    return max(1, BLOCK_BYTES // max(1, d * itemsize))


def train_blocked(start: torch.Tensor, spec, layers, active, width, rows, mask, x, y, lr: float,
                  total: torch.Tensor, block: int, write, correction=None, optimizer=None, trained=None) -> None:
    """All local steps of c clients, `block` clients at a time, from `start`: θ [d] (every client) or their
    start rows [c, d]. Each block trains in one set of stacks reused by the next (so it stays in cache and
    the round never holds c clients' stacks) and goes to write(lo, hi, stacks) when done. active[s]: clients
    (a prefix, sorted by steps) still training at step s; width[s]: the step's largest real batch; rows
    [S, c, B] into x, y; mask [S, c, B]. Adds each client's batch losses to `total` [c].
    `correction(lo, sub, a)`: the objective's term added to the gradient of clients lo..lo+a−1 (stacks like
    sub), or None. `optimizer`: the client optimiser (core.optim; None: plain SGD); `trained`: the parameter
    names that move (None: all)."""
    c = total.shape[0]
    names = () if optimizer is None else optimizer.state_names()
    P = {name: start.new_empty(min(block, c), *shape) for name, shape in spec}   # contiguous, filled per block
    for lo in range(0, c, block):
        hi = min(c, lo + block)
        load_rows(P, start if start.dim() == 1 else start[lo:hi], spec, hi - lo)
        sub = {name: p[:hi - lo] for name, p in P.items()}
        state = {k: {n: torch.zeros_like(p) for n, p in sub.items()} for k in names}  # fresh each round, as on the loop
        for s, (a, b) in enumerate(zip(active, width)):
            a = min(a - lo, hi - lo)
            if a <= 0:
                break
            corr = None if correction is None else correction(lo, sub, a)  # at the weights before the step
            idx = rows[s, lo:lo + a, :b].reshape(-1)   # index_select: faster than x[idx] on CPU
            xb, yb = x.index_select(0, idx).view(a, b, *x.shape[1:]), y.index_select(0, idx).view(a, b)
            update = make_update(optimizer, sub, state, a, s + 1, lr, corr)
            total[lo:lo + a] += sgd_step_(sub, layers, a, xb, yb, mask[s, lo:lo + a, :b], update, trained)
        write(lo, hi, sub)


def make_update(optimizer, P, state, a: int, t: int, lr: float, corr):
    """The update rule of one step of the first `a` clients (at their t-th step): plain SGD and heavy-ball
    momentum take the weight gradient δᵀH into an in-place product; other optimisers take it materialised."""
    if optimizer is None or optimizer.plain:
        return PlainUpdate(P, a, lr, corr)
    if isinstance(optimizer, SGD) and optimizer.momentum and not optimizer.nesterov:
        return HeavyBallUpdate(P, a, lr, corr, optimizer, state)
    return OptimizerUpdate(P, a, lr, corr, optimizer, state, t)


class PlainUpdate:
    """w ← w − η (δᵀH + correction): the product is added into the weights in place (one baddbmm_), so the
    [a, out, in] gradient is never stored. `corr`: the objective's term per parameter, or None."""

    def __init__(self, P, a, lr, corr):
        self.P, self.a, self.lr, self.corr = P, a, lr, corr

    def weight(self, name, delta_t, h):
        self.P[name][:self.a].baddbmm_(delta_t, h, alpha=-self.lr)
        self._correct(name)

    def bias(self, name, g):
        self.P[name][:self.a].sub_(g, alpha=self.lr)
        self._correct(name)

    def _correct(self, name):
        if self.corr is not None:
            self.P[name][:self.a].sub_(self.corr[name], alpha=self.lr)


class HeavyBallUpdate(PlainUpdate):
    """torch.optim's SGD with momentum μ and weight decay λ: b ← μb + δᵀH + λw + correction, the product
    added into b in place (b starts at 0, so b₁ = g as in torch.optim), then w ← w − ηb."""

    def __init__(self, P, a, lr, corr, optimizer, state):
        super().__init__(P, a, lr, corr)
        self.opt, self.buf = optimizer, state["buf"]

    def weight(self, name, delta_t, h):
        self._step(name, self.buf[name][:self.a].baddbmm_(delta_t, h, beta=self.opt.momentum))

    def bias(self, name, g):
        self._step(name, self.buf[name][:self.a].mul_(self.opt.momentum).add_(g))

    def _step(self, name, buf):
        w = self.P[name][:self.a]
        if self.opt.weight_decay:
            buf.add_(w, alpha=self.opt.weight_decay)
        if self.corr is not None:
            buf.add_(self.corr[name])
        w.sub_(buf, alpha=self.lr)


class OptimizerUpdate(PlainUpdate):
    """Any client optimiser (Adam, Nesterov, weight decay alone): the gradient plus the objective's term goes
    to its elementwise `step_` (the vmap backend's order)."""

    def __init__(self, P, a, lr, corr, optimizer, state, t):
        super().__init__(P, a, lr, corr)
        self.opt, self.state, self.t = optimizer, state, torch.tensor(t)  # every active client is at step t

    def weight(self, name, delta_t, h):
        self._step(name, torch.bmm(delta_t, h))

    def bias(self, name, g):
        self._step(name, g)

    def _step(self, name, g):
        g = g if self.corr is None else g + self.corr[name]
        self.opt.step_(self.P[name][:self.a], g, {k: v[name][:self.a] for k, v in self.state.items()}, self.t, self.lr)


def sgd_step_(P: dict[str, torch.Tensor], layers, a: int, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
              update: PlainUpdate, trained=None) -> torch.Tensor:
    """One local step of the first `a` clients in place on their stacked parameter views P ([c, out, in] and
    [c, out]); x [a, B, in], y [a, B], mask [a, B]. `update` applies each tensor's gradient; only the names in
    `trained` move (None: all; the others' gradients are not formed). Returns each client's masked mean
    batch loss [a]."""
    hs, h = [], x
    for i, (w, b) in enumerate(layers):
        hs.append(h)
        z = torch.baddbmm(P[b][:a].unsqueeze(1), h, P[w][:a].transpose(1, 2))
        h = z.relu() if i < len(layers) - 1 else z
    count = mask.sum(1).clamp_min(1)
    logp = torch.log_softmax(h, -1)
    rows = -logp.gather(2, y.unsqueeze(2)).squeeze(2)
    loss = (rows * mask).sum(1) / count
    delta = logp.exp()
    delta.scatter_add_(2, y.unsqueeze(2), -torch.ones_like(rows).unsqueeze(2))
    delta.mul_((mask / count[:, None]).unsqueeze(2))
    for i in range(len(layers) - 1, -1, -1):
        w, b = layers[i]
        # δ through ReLU as autograd computes it (threshold_backward), with the weights before the step
        below = torch.ops.aten.threshold_backward(torch.bmm(delta, P[w][:a]), hs[i], 0) if i > 0 else None
        if trained is None or w in trained:
            update.weight(w, delta.transpose(1, 2), hs[i])
        if trained is None or b in trained:
            update.bias(b, delta.sum(1))
        delta = below
    return loss
