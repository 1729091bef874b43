"""FedLoGe — Xiao, Chen, Liu, Feng, Zhou, Wu, Liu, Yang, Liu, "FedLoGe: Joint Local and Generic Federated
Learning under Long-tailed Data", ICLR 2024 (arXiv:2401.08977). Official code:
https://github.com/ZackZikaiXiao/FedLoGe

One shared backbone φ and three linear classifiers on its features z = φ(x):
  - the SSE-C E ∈ ℝ^{h×C}, a simplex ETF  M = sqrt(C/(C−1)) · U (I − 11ᵀ/C)  (U: h×C orthonormal columns),
    sparsified and then fixed for the whole run. The backbone is trained *only* through it:
        L_φ = CE(z E, y)
  - the auxiliary global head g (W_g, b_g), trained on detached features, averaged by the server (FedAvg):
        L_g = CE(g(sg z), y)
  - a local head l_k per client, trained on detached features, never sent:
        L_l = CE(l_k(sg z), y)
  The three losses are taken on the same mini-batch at the same point (one step of the client optimiser on
  [φ, g, l_k]: ∇L_φ on φ, ∇L_g on g, ∇L_l on l_k, as the official update_weights_gaux does with one
  forward pass and three optimisers).
GLA-FR (after training, no extra data):
  - generic model (GA-FR): φ with g's rows rescaled to a common norm, W̃_c = s · W_g,c / ‖W_g,c‖ (s = 1.7,
    the official constant), b_g kept — undoing the head-class norm bias of long-tailed training;
  - personal model of client k (LA-FR): logits l_k(z) + ĝ_k(z) with ĝ_k's rows W_g,c · ‖W_l,c‖ (the
    "Euclidean norm transfer" of the local head's class norms onto the global head), b = b_l + b_g, and the
    classes absent from the client's training data masked out (the official localtest, p_mode 1).

In the library θ is the model with g as its last layer (so History's test_acc is body + raw g); E is a
constant of the run (seeded, stream 46), never a parameter. Checked against the official code (fetched):
the ETF construction and the sparse-ETF fitting (`util/etf_methods.py`: zero ⌊β·h·C⌋ random entries,
β = 0.6 in fedloge.py, then 10,000 Adam steps, lr 1e-4, on the non-zero entries only, minimising
Σ_c (‖E_c‖ − 0.1)² − mean_c arccos(max_{j≠c} cos(E_c, E_j))), the three losses, FedAvg of backbone and g
with n_k weights, the norm transfer and the masking (`realignment.py`, `util/update_baseline.py`), the
GA-FR constant 1.7. Choices here, not from the paper: the SSE-C has no bias (the official nn.Linear
keeps its random, untrained bias), each local head starts as θ₀'s last layer (officially an independent
random init), the mask uses the client's *training* classes (officially its local test distribution,
drawn from the same per-client distribution), and the client optimiser is the run's (official: SGD with
momentum 0.5). The paper's text beyond its abstract could not be read offline: the details above are the
official code's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.func import grad_and_value

from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, ServerSGD, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...models import param_spec, representation, unflatten
from ...utils import rng
from .fedrod import head_slice, train_extended
from ..heads import last_layer

SSE_C = register_stream("fedloge_sse_c", 46)   # the random frame U and the sparsity mask of the SSE-C


def simplex_etf(features: int, num_classes: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """M = sqrt(C/(C−1)) · U (I − 11ᵀ/C), [h, C]: unit-norm columns with pairwise cosine −1/(C−1); U from
    the QR of a uniform random h×C matrix (the official generate_random_orthogonal_matrix)."""
    if num_classes < 2 or features < num_classes:
        raise ValueError(f"a simplex ETF needs 2 <= num_classes <= feature dimension, got C={num_classes}, "
                         f"h={features}; widen the model's last hidden layer to at least {num_classes}")
    U, _ = torch.linalg.qr(torch.rand(features, num_classes, generator=generator, dtype=torch.float64))
    C = num_classes
    centring = torch.eye(C, dtype=torch.float64) - torch.full((C, C), 1.0 / C, dtype=torch.float64)
    return (C / (C - 1)) ** 0.5 * U @ centring


def fit_sparse_etf(etf: torch.Tensor, sparsity: float, generator: torch.Generator, steps: int = 10_000,
                   lr: float = 1e-4, norm: float = 0.1) -> torch.Tensor:
    """The official SSE-C: zero ⌊sparsity·h·C⌋ random entries of the ETF, then re-fit the others (Adam, the
    zeros stay zero) to equal column norms `norm` and a large minimum pairwise angle."""
    h, C = etf.shape
    n_zero = int(sparsity * h * C)
    keep = torch.ones(h * C, dtype=etf.dtype)
    keep[torch.randperm(h * C, generator=generator)[:n_zero]] = 0
    keep = keep.view(h, C)
    E = (etf * keep).clone().requires_grad_(True)
    opt = torch.optim.Adam([E], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        norms = E.norm(dim=0)
        cos = (E / norms).T @ (E / norms) - 2 * torch.eye(C, dtype=E.dtype)   # the diagonal never the max
        loss = ((norms - norm) ** 2).sum() - torch.arccos(cos.max(1).values.clamp(-0.99999, 0.99999)).mean()
        loss.backward()
        E.grad *= keep
        opt.step()
    return E.detach()


@lru_cache(maxsize=32)
def _sse_c(seed: int, features: int, num_classes: int, sparsity: float, steps: int, norm: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(rng(seed, SSE_C, 0).integers(2**62)))
    etf = simplex_etf(features, num_classes, g)
    # fitted in float32, as officially (in float64 some kept entries underflow to 0 when cast down)
    return fit_sparse_etf(etf.float(), sparsity, g, steps, norm=norm) if sparsity > 0 else etf.float()


def sse_classifier(seed: int, features: int, num_classes: int, sparsity: float = 0.6,
                   steps: int = 10_000, norm: float = 0.1) -> torch.Tensor:
    """The run's static classifier E [h, C], a pure function of (seed, shape, sparsity, norm): the same tensor
    in every round and on every client (sparsity 0: the exact simplex ETF, unit columns; `norm`: the column norm
    the sparse fit aims at, 0.1 in the official code)."""
    return _sse_c(int(seed), int(features), int(num_classes), float(sparsity), int(steps), float(norm)).clone()


def fedloge_losses(model, spec, w, local_head, x, y, etf):
    """(L_φ through the fixed SSE-C, L_g of the global head and L_l of the local head on detached features)."""
    params = unflatten(w, spec)
    wname, bname = last_layer(spec)
    z = representation(model, params, x).flatten(1)
    C, h = params[wname].shape
    zd = z.detach()
    return (F.cross_entropy(z @ etf, y),
            F.cross_entropy(zd @ params[wname].T + params[bname], y),
            F.cross_entropy(zd @ local_head[:C * h].view(C, h).T + local_head[C * h:], y))


def _split(head: torch.Tensor, C: int, h: int):
    """A flat head [..., C·h + C] as (weight [..., C, h], bias [..., C])."""
    return head[..., :C * h].unflatten(-1, (C, h)), head[..., C * h:]


def realign_global(theta: torch.Tensor, spec, scale: float = 1.7) -> torch.Tensor:
    """GA-FR: θ with the global head's class rows rescaled to norm `scale` (bias kept): the generic model."""
    sl, (C, h), _ = head_slice(spec)
    W, b = _split(theta[sl], C, h)
    out = theta.clone()
    out[sl] = torch.cat([(scale * W / W.norm(dim=1, keepdim=True).clamp_min(1e-12)).flatten(), b])
    return out


def personal_heads(global_head: torch.Tensor, local_heads: torch.Tensor, counts: torch.Tensor, C: int, h: int,
                   mask_value: float = -1e9) -> torch.Tensor:
    """LA-FR: l_k + ĝ_k with ĝ_k,c = W_g,c · ‖W_l,c‖ (norm transfer), as one flat head per client [K, C·h + C];
    the classes client k never saw in training get bias `mask_value` (none when its counts are all 0)."""
    Wg, bg = _split(global_head, C, h)
    Wl, bl = _split(local_heads, C, h)
    W = Wl + Wl.norm(dim=2, keepdim=True) * Wg
    b = bl + bg
    absent = (counts == 0) & (counts.sum(1, keepdim=True) > 0)
    b = torch.where(absent, torch.full_like(b, mask_value), b)
    return torch.cat([W.flatten(1), b], dim=1)


@dataclass
class FedLoGeClient(OwnTraining):
    sparsity: float = 0.6
    etf_steps: int = 10_000
    mask_absent: bool = True
    etf_norm: float = 0.1

    def client_state(self, method, theta, groups):
        sl, (C, _), _ = head_slice(groups.spec)
        return {"lhead": theta[sl].clone(),            # l_k⁰ = θ₀'s last layer
                "counts": torch.zeros(C, device=theta.device)}

    def classifier(self, seed: int, spec) -> torch.Tensor:
        _, (C, h), _ = head_slice(spec)
        return sse_classifier(seed, h, C, self.sparsity, self.etf_steps, self.etf_norm)

    def local_train(self, method, ctx, jobs, down, cstate):
        theta, model = down["theta"], ctx.model
        spec = param_spec(model)
        d, opt, lr = theta.numel(), ctx.optimizer, ctx.lr
        etf = self.classifier(ctx.seed, spec).to(theta.device, theta.dtype)

        def total(v, x, y):
            lb, lg, ll = fedloge_losses(model, spec, v[:d], v[d:], x, y, etf)
            return lb + lg + ll, lb
        grad_fn = grad_and_value(total, has_aux=True)
        W, L, losses = [], [], []
        for i, job in enumerate(jobs):
            v, loss = train_extended(torch.cat([theta, cstate["lhead"][i].to(theta.device)]), job, grad_fn, opt, lr)
            W.append(v[:d])
            L.append(v[d:])
            losses.append(loss)
        counts = torch.stack([torch.bincount(j.y, minlength=ctx.fed.num_classes).to(theta) for j in jobs])
        return {"delta": torch.stack(W) - theta}, {"lhead": torch.stack(L), "counts": counts}, torch.stack(losses)

    def personal(self, method, theta, cstate, groups):
        """φ + (l_k + ĝ_k) for every client: θ with its last layer replaced by the realigned personal head."""
        sl, (C, h), _ = head_slice(groups.spec)
        counts = cstate["counts"].to(theta.device)
        heads = personal_heads(theta[sl], cstate["lhead"].to(theta.device),
                               counts if self.mask_absent else torch.zeros_like(counts), C, h)
        W = theta.repeat(len(heads), 1)
        W[:, sl] = heads
        return W


@register("fedloge", claims="fedloge")
def fedloge(sparsity: float = 0.6, etf_steps: int = 10_000, mask_absent: bool = True, server_lr: float = 1.0,
            etf_norm: float = 0.1) -> Method:
    """FedLoGe: backbone trained against the static (sparse) ETF, global head averaged, local heads kept;
    `personal()` gives the LA-FR personal models, `realign_global(hist.theta, spec)` the GA-FR generic one.
    `sparsity`: fraction of zeroed ETF entries (0.6 official; 0: the dense, exact ETF). `etf_norm`: the SSE-C's
    column norm (0.1 official, picked for ResNet features by the authors' sweep, logs norm0_01 … norm2)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be a number in [0, 1), e.g. 0.6 (the official code's), got {sparsity!r}")
    if isinstance(etf_steps, bool) or not isinstance(etf_steps, int) or etf_steps < 0:
        raise ValueError(f"etf_steps must be an int >= 0 (Adam steps fitting the sparse ETF), got {etf_steps!r}")
    if isinstance(etf_norm, bool) or not isinstance(etf_norm, (int, float)) or not etf_norm > 0:
        raise ValueError(f"etf_norm must be a number > 0 (the SSE-C's column norm; official 0.1), got {etf_norm!r}")
    return Method("fedloge", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  client=FedLoGeClient(float(sparsity), etf_steps, mask_absent, float(etf_norm)))
