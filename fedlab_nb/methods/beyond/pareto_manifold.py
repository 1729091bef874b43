"""Pareto Manifold Learning (PaMaL), after Nikolaos Dimitriadis, Pascal Frossard and François Fleuret,
"Pareto Manifold Learning: Tackling multiple tasks via ensembles of single-task models", ICML 2023 (PMLR
202:8015-8052), https://arxiv.org/abs/2210.09759; official code https://github.com/nik-dim/pamal.

PaMaL keeps one weight-space *member* θ_t per task (each initialised independently) and trains the whole
simplex at once: every step samples α ~ Dirichlet(p·1), forms the weights Σ_t α_t θ_t and descends the
scalarised loss Σ_t α_t L_t. At inference any α picks a trade-off, so one run gives a continuous front.
Per the official `src/trainer/multi_forward_ensemble_trainer.py`, each step makes `num` such forward passes
(the paper's "window") and adds a penalty when a task's loss is not monotone in its own weight:
R = Σ_t log( mean_j exp(T·relu(L_t(α_(j+1)) − L_t(α_(j)))) ), the window ordered by α_t, added with
coefficient λ only while λR is below the summed loss. See `monotonicity_penalty` for the ordering.

Exact side: for quadratics L_i(θ) = ½(θ − θ_i*)ᵀH_i(θ − θ_i*), the Pareto set of two tasks is
θ(α) = (αH₁ + (1−α)H₂)⁻¹(αH₁θ₁* + (1−α)H₂θ₂*) (`quadratic_pareto_set`) — the family of Fisher-weighted
merges; it is the segment [θ₂*, θ₁*] exactly when H₂ ∝ H₁ and a curve otherwise, so the paper's conjecture of a
*linear* Pareto parameterisation is an empirical claim about deep nets, not a theorem.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from ...core.registry import register
from ...data.datasets import load_dataset
from ...data.natural_data import load_adult
from ...models import param_spec, unflatten


# --- the exact quadratic case ----------------------------------------------------------------------
def quadratic_pareto_set(H1: Tensor, H2: Tensor, theta1: Tensor, theta2: Tensor, alphas) -> Tensor:
    """[len(alphas), d]: the minimiser of α·L₁ + (1 − α)·L₂ for each α in [0, 1] (float64 solve)."""
    d = theta1.shape[0]
    if H1.shape != (d, d) or H2.shape != (d, d) or theta2.shape != (d,):
        raise ValueError(f"need H1, H2 of shape ({d}, {d}) and theta1, theta2 of shape ({d},)")
    rows = []
    for a in alphas:
        if not 0 <= a <= 1:
            raise ValueError(f"alphas must lie in [0, 1], got {a}")
        H = a * H1 + (1 - a) * H2
        rows.append(torch.linalg.solve(H, a * H1 @ theta1 + (1 - a) * H2 @ theta2))
    return torch.stack(rows)


def segment_distance(points: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Distance of each row of `points` to the segment [a, b]."""
    ab = b - a
    t = ((points - a) @ ab / (ab @ ab)).clamp(0, 1)
    return (points - a - t[:, None] * ab).norm(dim=1)


def hypervolume_2d(points, ref) -> float:
    """Area dominated by `points` ([n, 2], both objectives minimised) and bounded by the reference point
    `ref`; points not strictly better than ref in both objectives add nothing."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    r = np.asarray(ref, dtype=np.float64)
    p = p[(p < r).all(1)]
    area, best_y = 0.0, r[1]
    for x, y in p[np.lexsort((p[:, 1], p[:, 0]))]:  # by the first objective, ties by the second
        if y < best_y:
            area += (r[0] - x) * (best_y - y)
            best_y = y
    return float(area)


# --- two binary tasks on one network -----------------------------------------------------------------
def adult_two_tasks(max_train: int | None = None, seed: int = 0, root: str | None = None):
    """UCI Adult as two binary tasks (income > 50K, never married) with the marital-status columns removed
    from the inputs (the tabular benchmark of the paper uses Census-Income, tasks income and never-married).
    Returns (x_train, Y_train [n, 2], x_test, Y_test, kept column names)."""
    ds = load_adult(root=root, max_train=max_train, seed=seed)
    cols = ds.meta["columns"]
    never = cols.index("marital_status_Never-married")
    keep = [i for i, c in enumerate(cols) if not c.startswith("marital_status_")]

    def split(x, y):
        return x[:, keep], torch.stack([y, (x[:, never] > 0.5).long()], 1)

    return (*split(ds.x_train, ds.y_train), *split(ds.x_test, ds.y_test), [cols[i] for i in keep])


def multi_mnist(seed: int = 0, shift: int = 6, pool: int = 2):
    """MultiMNIST built offline from MNIST-5k (after Sabour et al., 2017, as in the paper's image benchmark):
    each example overlays two digits on a (28 + shift)² canvas, one at the top left and one shifted by `shift`
    pixels down and right (pixel-wise max), then `pool`×`pool` average-pooled. Tasks: the left digit and the
    right digit. Train pairs come from the train split, test pairs from the test split (partners drawn with
    `seed`). Returns (x_train, Y_train [n, 2], x_test, Y_test)."""
    ds = load_dataset("mnist5k")
    rng = np.random.default_rng(seed)

    def pairs(x, y):
        img = x.reshape(-1, 28, 28)
        j = torch.as_tensor(rng.permutation(len(y)))
        size = 28 + shift
        canvas = torch.zeros(len(y), size, size)
        canvas[:, :28, :28] = img
        canvas[:, shift:, shift:] = torch.maximum(canvas[:, shift:, shift:], img[j])
        pooled = torch.nn.functional.avg_pool2d(canvas[:, None], pool).flatten(1)
        return pooled, torch.stack([y, y[j]], 1)

    return (*pairs(ds.x_train, ds.y_train), *pairs(ds.x_test, ds.y_test))


def task_logits(model: torch.nn.Module, theta: Tensor, x: Tensor, n_tasks: int = 2) -> Tensor:
    """[n, T, C]: the model's outputs at θ read as one C-class head per task (outputs = T·C)."""
    out = functional_call(model, unflatten(theta, param_spec(model)), (x,))
    return out.reshape(len(x), n_tasks, -1)


def task_losses(logits: Tensor, Y: Tensor) -> Tensor:
    """[T]: the mean cross-entropy of each task's head."""
    return torch.stack([torch.nn.functional.cross_entropy(logits[:, t], Y[:, t]) for t in range(Y.shape[1])])


def scalarised_loss(weights):
    """loss_fn(outputs, Y) = Σ_t w_t L_t for `merging.fit` (outputs are [n, T·C])."""
    w = torch.as_tensor(weights, dtype=torch.float32)

    def loss_fn(out, Y):
        return (w * task_losses(out.reshape(len(out), len(w), -1), Y)).sum()
    return loss_fn


@torch.no_grad()
def evaluate_tasks(model: torch.nn.Module, theta: Tensor, x: Tensor, Y: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(per-task error rates [T], per-task mean losses [T]) of the model at θ."""
    logits = task_logits(model, theta, x, Y.shape[1])
    errors = (logits.argmax(-1) != Y).double().mean(0).numpy()
    return errors, task_losses(logits, Y).double().numpy()


def task_gradient_cosine(model: torch.nn.Module, theta: Tensor, x: Tensor, Y: Tensor) -> float:
    """cos(∇L₁, ∇L₂) over the shared parameters (every parameter but the output layer, whose rows are the
    task-specific heads): below 0 the tasks conflict."""
    spec = param_spec(model)
    t = theta.detach().clone().requires_grad_(True)
    g1, g2 = (torch.autograd.grad(loss, t, retain_graph=True)[0] for loss in task_losses(task_logits(model, t, x, Y.shape[1]), Y))
    n_head = sum(int(np.prod(shape)) for _, shape in spec[-2:])  # the last Linear's weight and bias
    g1, g2 = g1[:-n_head], g2[:-n_head]
    return float(g1 @ g2 / (g1.norm() * g2.norm()))


# --- PaMaL training ----------------------------------------------------------------------------------
def monotonicity_penalty(alphas: Tensor, losses: Tensor, temperature: float = 1.0, order: str = "violations") -> Tensor:
    """The multi-forward penalty over a window of W ≥ 2 samples. `alphas`, `losses`: [W, T].

    For task t, the window is sorted by α_t in increasing order; its loss should then decrease, so each
    increase relu(L_t(α_(j+1)) − L_t(α_(j))) is a violation, and R_t = log(mean_j exp(T·violation_j)) (0 when
    the losses are monotone). `order="official"` sorts by decreasing α_t instead, as the official trainer
    does (`sorted(..., reverse=True)` before `diff()`): read literally, that penalises the expected order —
    kept as an option so the two readings can be compared."""
    if order not in ("violations", "official"):
        raise ValueError(f"order must be 'violations' or 'official', got {order!r}")
    W = alphas.shape[0]
    total = losses.new_zeros(())
    for t in range(alphas.shape[1]):
        idx = torch.argsort(alphas[:, t], descending=(order == "official"))
        diff = losses[idx, t].diff()
        total = total + torch.relu(diff).mul(temperature).exp().sum().div(W - 1).log()
    return total


def _dirichlet(rng: np.random.Generator, p: float, n_tasks: int) -> Tensor:
    g = rng.gamma(p, 1.0, size=n_tasks)
    return torch.as_tensor(g / g.sum(), dtype=torch.float32)


@register("pamal", claims="pareto_manifold", kind="module")
def pamal_train(model: torch.nn.Module, members: Tensor, x: Tensor, Y: Tensor, *, epochs: int = 10,
                lr: float = 1e-3, batch_size: int = 256, p: float = 1.0, num: int = 2, reg_coefficient: float = 5.0,
                temperature: float = 1.0, order: str = "violations", seed: int = 0) -> Tensor:
    """Train the members [T, d] (one per task, independently initialised) jointly with Adam: per mini-batch,
    `num` forward passes at α ~ Dirichlet(p·1), loss Σ_w Σ_t α_t L_t at the weights αᵀ·members, plus
    reg_coefficient·`monotonicity_penalty` when num ≥ 2 and it stays below the loss (as the official
    trainer, whose R > 0.002 test only gates logging). Defaults: the official census configuration
    (Adam 1e-3, num = 2, λ = 5, p = 1). Returns the trained members."""
    T = Y.shape[1]
    if members.ndim != 2 or members.shape[0] != T:
        raise ValueError(f"members must be [T, d] with T = {T} (one per task), got {tuple(members.shape)}")
    if num < 1 or not p > 0 or epochs < 0:
        raise ValueError(f"need num >= 1, p > 0 and epochs >= 0, got {num}, {p}, {epochs}")
    theta = members.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(int(seed))
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            alphas = torch.stack([_dirichlet(rng, p, T) for _ in range(num)])
            losses = torch.stack([task_losses(task_logits(model, a @ theta, x[idx], T), Y[idx]) for a in alphas])
            loss = (alphas * losses).sum()
            if num > 1:
                reg = monotonicity_penalty(alphas, losses, temperature, order)
                if reg_coefficient * reg < loss:
                    loss = loss + reg_coefficient * reg
            opt.zero_grad()
            loss.backward()
            opt.step()
    return theta.detach()


def simplex_line(n_points: int = 11) -> Tensor:
    """[n, 2]: α = (a, 1 − a) for a = 0, 1/(n−1), …, 1 (the official code validates 11 such points)."""
    a = torch.linspace(0, 1, n_points)
    return torch.stack([a, 1 - a], 1)


def front(model: torch.nn.Module, members: Tensor, x: Tensor, Y: Tensor, n_points: int = 11):
    """(α [n, 2], errors [n, T], losses [n, T]) of the weights αᵀ·members along the line of the 2-simplex."""
    alphas = simplex_line(n_points)
    ev = [evaluate_tasks(model, a @ members, x, Y) for a in alphas]
    return alphas.numpy(), np.stack([e for e, _ in ev]), np.stack([l for _, l in ev])
