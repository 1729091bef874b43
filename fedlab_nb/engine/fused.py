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
step for small layers. It applies only to plain SGD on the cross-entropy of such a model, with no objective
loss term and no parameter groups; `fusable` says whether a run qualifies. An objective's `correction` (FedProx's
μ(w − θ), SCAFFOLD's c − c_k) is evaluated at the weights before each step and subtracted after the update.

`train_blocked` runs the steps in blocks of clients whose weights fit in cache (`BLOCK_BYTES`): each block
takes all its local steps before the next starts, so a client's weights are read from memory once per round
rather than once per step. The clients are independent, so the result is the same, bit for bit.

The clients' weights train as one contiguous [c, *shape] stack per parameter tensor (`separate`), not as
views of the flat rows [c, d]: torch runs an in-place batched product on a contiguous stack as one batched
GEMM, on strided views as one product per client. `write_rows` puts them back into the round's rows.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..models import MLP, LogisticRegression


def linear_layers(model: nn.Module | None) -> list[tuple[str, str]] | None:
    """[(weight name, bias name)] of the model's Linear layers in order, if it is the library's
    LogisticRegression or ReLU MLP (exactly those classes); else None."""
    if type(model) is LogisticRegression:
        return [("linear.weight", "linear.bias")]
    if type(model) is MLP:
        mods = list(model.body)
        linears = [i for i, m in enumerate(mods) if isinstance(m, nn.Linear)]
        if all(isinstance(m, nn.ReLU) for i, m in enumerate(mods) if i not in linears):
            return [(f"body.{i}.weight", f"body.{i}.bias") for i in linears]
    return None


def fusable(model, loss_fn, objective, optimizer, trained) -> list | None:
    """The model's layers when the fused step computes exactly this run's local training, else None."""
    plain = optimizer is None or optimizer.plain
    extra = getattr(objective, "extra_loss", None) is not None
    if not plain or extra or trained is not None:
        return None
    if getattr(loss_fn, "criterion", None) is not None:
        return None
    return linear_layers(model)


def separate(W: torch.Tensor, spec, c: int) -> dict[str, torch.Tensor]:
    """Each parameter of the c clients as its own contiguous [c, *shape] tensor (a copy), from their flat
    rows W [c, d], or from θ [d] (every client starts there)."""
    from .batched import stacked_views   # batched imports this module
    rows = W.expand(c, -1) if W.dim() == 1 else W
    return {name: v.clone(memory_format=torch.contiguous_format) for name, v in stacked_views(rows, spec).items()}


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


BLOCK_BYTES = 4 * 2**20   # weights of one block of clients: a share of this machine kind's 32 MiB L3 and 1 MiB L2


def block_clients(d: int, itemsize: int) -> int:
    """How many clients of d parameters make one cache block (at least one)."""
    return max(1, BLOCK_BYTES // max(1, d * itemsize))


def train_blocked(P: dict[str, torch.Tensor], layers, active, width, rows, mask, x, y, lr: float,
                  total: torch.Tensor, block: int, correction=None) -> None:
    """All local steps of the c clients in P, `block` clients at a time. active[s]: clients (a prefix, sorted
    by steps) still training at step s; width[s]: the step's largest real batch; rows [S, c, B] into x, y;
    mask [S, c, B]. Adds each client's batch losses to `total` [c]. `correction(lo, sub, a)`: the objective's
    term added to the gradient of clients lo..lo+a−1 (stacks like P), or None."""
    c = total.shape[0]
    for lo in range(0, c, block):
        hi = min(c, lo + block)
        sub = {name: p[lo:hi] for name, p in P.items()}
        for s, (a, b) in enumerate(zip(active, width)):
            a = min(a - lo, hi - lo)
            if a <= 0:
                break
            corr = None if correction is None else correction(lo, sub, a)  # at the weights before the step
            idx = rows[s, lo:lo + a, :b].reshape(-1)   # index_select: faster than x[idx] on CPU
            xb, yb = x.index_select(0, idx).view(a, b, *x.shape[1:]), y.index_select(0, idx).view(a, b)
            total[lo:lo + a] += sgd_step_(sub, layers, a, xb, yb, mask[s, lo:lo + a, :b], lr)
            for name, term in (corr or {}).items():
                sub[name][:a].sub_(term, alpha=lr)


def sgd_step_(P: dict[str, torch.Tensor], layers, a: int, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
              lr: float) -> torch.Tensor:
    """One SGD step of the first `a` clients in place on their stacked parameter views P ([c, out, in] and
    [c, out]); x [a, B, in], y [a, B], mask [a, B]. Returns each client's masked mean batch loss [a]."""
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
        P[w][:a].baddbmm_(delta.transpose(1, 2), hs[i], alpha=-lr)
        P[b][:a].sub_(delta.sum(1), alpha=lr)
        delta = below
    return loss
