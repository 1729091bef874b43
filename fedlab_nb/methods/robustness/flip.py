"""FLIP — Zhang, Tao, Xu, Cheng, An, Liu, Feng, Shen, Chen, Ma, Zhang, "FLIP: A Provable Defense Framework for
Backdoor Mitigation in Federated Learning", ICLR 2023. https://arxiv.org/abs/2210.12873 ·
official code: https://github.com/KaiyuanZh/FLIP

The *benign* clients harden themselves, so that the global model forgets what the attackers teach it:

1. trigger inversion (Neural Cleanse, Wang et al., S&P 2019) on the client's own data with the broadcast model:
   for a candidate target label t, a mask m ∈ [0, 1]^d and a pattern p ∈ [0, 1]^d minimise

       CE(f((1 − m) ⊙ x + m ⊙ p), t) + λ ‖m‖₁        over rows x of other labels,

   parametrised as m = tanh(a)/2 + ½, p = tanh(b)/2 + ½ and optimised with Adam(β = (0.5, 0.9)) as in the
   official `invert_*.py`;
2. adversarial training: local SGD on the client's data with a fraction of the rows stamped with the inverted
   triggers but keeping their *true* labels — the model learns that the trigger means nothing;
3. at inference, predictions whose max softmax is below a threshold are rejected (`reject_low_confidence`).

The server is plain FedAvg. Compromised clients do not run the defence: by default the clients of the run's
`poison` (poison.py) are the compromised ones. Simplifications against the official code (said in the
notebook): one mask per *target* label (the repository inverts (source, target) label pairs, MOTH-style, with
an adaptive λ schedule); a few targets drawn per client and round, with a fixed λ, to bound the CPU time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ...core.registry import register
from ...core.round import LocalJob
from ...core.streams import register_stream
from ...models import param_spec, unflatten
from ...utils import check_positive_int, rng
from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, ServerSGD, weighted_mean

FLIP_INVERSION = register_stream("flip_inversion", 58)   # targets, rows and mask initialisation of the inversion
EPS = 1e-7  # keeps arctanh finite at the box edges (the official code's epsilon)


def _to_box(a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a) / (2 - EPS) + 0.5


def invert_trigger(forward, x: torch.Tensor, target, *, steps: int = 50, lam: float = 1e-3,
                   lr: float = 0.1, generator: torch.Generator | None = None,
                   init: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neural-Cleanse trigger inversion: (mask, pattern), each of shape x.shape[1:] in [0, 1], that send the rows
    of `x` to class `target` under `forward` (a callable x → logits) with a small ‖mask‖₁ (weight `lam`).

    Several targets at once: `target` a sequence of T labels and `x` [T, n, ...] (rows for each target); the
    result is [T, ...]. Adam is elementwise and the loss a sum over targets, so this equals T separate runs.
    `init`: a starting (mask, pattern) in [0, 1] (a warm start, as the official code's init_m / init_p); default
    uniform random draws from `generator`."""
    many = not isinstance(target, (int, np.integer))
    targets = torch.as_tensor(list(target) if many else [int(target)], device=x.device)
    xs = x if many else x[None]
    if xs.ndim < 3 or xs.shape[0] != len(targets) or xs.shape[1] == 0:
        raise ValueError(f"x must be a non-empty batch [n, features...] (or [T, n, ...] for T targets), got shape "
                         f"{tuple(x.shape)} for target {target!r}")
    check_positive_int("steps", steps)
    if not lam >= 0 or not lr > 0:
        raise ValueError(f"lam (the mask's L1 weight) must be >= 0 and lr > 0, got lam={lam}, lr={lr}")
    T, n, shape = len(targets), xs.shape[1], xs.shape[2:]
    if init is None:
        init = [torch.rand((T, *shape), generator=generator, dtype=x.dtype) for _ in range(2)]
    else:
        init = [torch.as_tensor(v, dtype=x.dtype).reshape(T, *shape) for v in init]
    a, b = (torch.atanh((v.clamp(0, 1) - 0.5) * (2 - EPS)).to(x.device).requires_grad_(True) for v in init)
    opt = torch.optim.Adam([a, b], lr=lr, betas=(0.5, 0.9))
    labels = targets.repeat_interleave(n)
    view = (T, 1, *shape)
    for _ in range(steps):
        m, p = _to_box(a), _to_box(b)
        x_adv = (1 - m.reshape(view)) * xs + m.reshape(view) * p.reshape(view)
        ce = F.cross_entropy(forward(x_adv.reshape(T * n, *shape)), labels, reduction="none").reshape(T, n)
        loss = (ce.mean(1) + lam * m.reshape(T, -1).abs().sum(1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    m, p = _to_box(a).detach(), _to_box(b).detach()
    return (m, p) if many else (m[0], p[0])


def stamp(x: torch.Tensor, mask: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """(1 − m) ⊙ x + m ⊙ p, row by row."""
    if mask.shape != x.shape[1:] or pattern.shape != x.shape[1:]:
        raise ValueError(f"mask {tuple(mask.shape)} and pattern {tuple(pattern.shape)} must have the shape of one "
                         f"row of x, {tuple(x.shape[1:])}")
    return (1 - mask) * x + mask * pattern


def reject_low_confidence(logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Boolean [n]: True where the prediction is rejected, i.e. its max softmax probability is below `threshold`
    (the official code's `confidence_threshold`, 0.4 for continuous attacks)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, classes], got shape {tuple(logits.shape)}")
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold is a probability in [0, 1] (0 rejects nothing), got {threshold}")
    return logits.softmax(1).max(1).values < threshold


def model_forward(model: torch.nn.Module, theta: torch.Tensor):
    """x → logits of `model` with the flat parameters θ (no gradient to θ)."""
    params = {k: v.detach() for k, v in unflatten(theta, param_spec(model)).items()}
    return lambda x: functional_call(model, params, (x,))


def harden_rows(forward, x: torch.Tensor, y: torch.Tensor, num_classes: int, g: np.random.Generator, *,
                targets: int | None, fraction: float, rows: int, steps: int, lam: float, lr: float) -> torch.Tensor:
    """The client's rows with a `fraction` of them stamped by triggers inverted towards `targets` random labels
    (None: every label, as the official warm-up does); each stamped row gets one of them. Labels are unchanged."""
    tg = torch.Generator().manual_seed(int(g.integers(2 ** 31)))
    chosen_targets = np.arange(num_classes) if targets is None else \
        g.choice(num_classes, size=min(targets, num_classes), replace=False)
    others = [np.flatnonzero(y.cpu().numpy() != t) for t in chosen_targets]
    n = min([rows] + [len(o) for o in others])
    if n == 0:
        return x
    picks = np.stack([g.choice(o, n, replace=False) for o in others])
    masks, patterns = invert_trigger(forward, x[torch.as_tensor(picks, device=x.device)], chosen_targets.tolist(),
                                     steps=steps, lam=lam, lr=lr, generator=tg)
    x = x.clone()
    chosen = g.choice(len(y), max(1, int(round(fraction * len(y)))), replace=False)
    which = g.integers(len(chosen_targets), size=len(chosen))
    for i in range(len(chosen_targets)):
        idx = torch.as_tensor(chosen[which == i], device=x.device)
        if len(idx):
            x[idx] = stamp(x[idx], masks[i], patterns[i])
    return x


@dataclass
class FLIPClient(OwnTraining):
    """Local SGD on data hardened by trigger inversion (benign clients); the compromised clients (`compromised`,
    default: the run's poison clients) train on their own data as given."""
    targets: int | None = None  # candidate target labels inverted per client and round (None: all)
    fraction: float = 0.5     # share of the local rows stamped with an inverted trigger (true label kept)
    rows: int = 32            # rows used by one inversion
    steps: int = 30           # Adam steps of one inversion
    lam: float = 0.05         # λ, the mask's L1 weight
    lr: float = 0.3           # the inversion's Adam step (the official code: 0.1 with 200–500 steps)
    compromised: tuple | None = None

    def __post_init__(self):
        if self.targets is not None:
            check_positive_int("targets", self.targets)
        check_positive_int("rows", self.rows)
        check_positive_int("steps", self.steps)
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction (of rows to stamp with inverted triggers) must be in (0, 1], got {self.fraction}")

    def _compromised(self, ctx) -> set:
        """The clients that keep their rows as they are: the given ones, else those the run's data poison rewrites."""
        return set(self.compromised) if self.compromised is not None else set(ctx.poisoned)

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        forward = model_forward(ctx.model, theta)
        bad, C = self._compromised(ctx), ctx.fed.num_classes
        hardened = []
        for j in jobs:
            if j.client_id in bad:
                hardened.append(j)
                continue
            g = rng(ctx.seed, FLIP_INVERSION, ctx.round, j.client_id)
            x = harden_rows(forward, j.x, j.y, C, g, targets=self.targets, fraction=self.fraction, rows=self.rows,
                            steps=self.steps, lam=self.lam, lr=self.lr)
            hardened.append(LocalJob(j.client_id, x, j.y, j.batches, j.ctx))
        W, losses = ctx.train(theta, hardened, method.objective)
        return {"delta": W - theta}, cstate, losses


@register("flip", claims="flip")
def flip(targets: int | None = None, fraction: float = 0.5, steps: int = 30, lam: float = 0.05, rows: int = 32,
         lr: float = 0.3,
         compromised: tuple | None = None, server_lr: float = 1.0) -> Method:
    """FedAvg whose benign clients train on trigger-inverted (true-label) data."""
    client = FLIPClient(targets=targets, fraction=fraction, rows=rows, steps=steps, lam=lam, lr=lr,
                        compromised=compromised)
    return Method("flip", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr), client=client)
