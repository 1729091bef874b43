"""FedMBO — federated bilevel optimisation with client sampling in the hypergradient estimate.

Huang, Zhang, Ji, "Achieving Linear Speedup in Non-IID Federated Bilevel Learning", ICML 2023.

M clients hold f_i (upper) and g_i (lower); the problem uses the *global* averages,

    min_x F(x) = (1/M) Σ_i f_i(x, y*(x)),   y*(x) = argmin_y (1/M) Σ_i g_i(x, y),

so ∇F = ∇_x f − ∇²_xy g [∇²_yy g]⁻¹ ∇_y f with every term a global average. With non-IID clients, the average
of the clients' *local* hypergradients ∇_x f_i − ∇²_xy g_i [∇²_yy g_i]⁻¹ ∇_y f_i is not ∇F: the mean of
products is not the product of means. A round of FedMBO, with n clients sampled:
  1. lower level: the sampled clients run τ local SGD steps on g_i from y_k; the server averages → y_{k+1};
  2. hypergradient: the server averages the clients' ∇_y f_i into b and estimates v ≈ [∇²_yy g]⁻¹ b by a
     Neumann series v = η Σ_{j<Q} (I − η H)^j b, where the j-th factor's Hessian-vector product is averaged over
     a *fresh, independent* sample of n clients — independence makes E[product] the product of the expected
     (global) Hessians, so the estimate is unbiased up to the truncation at Q terms, with variance ~1/n;
  3. upper level: h = mean ∇_x f_i − mean ∇²_xy g_i v, the second mean over one more independent sample (the
     same clients as b would add their covariance, a bias of order 1/n), and x_{k+1} = x_k − α h.
`estimator="local"` is the naive contrast: each client solves with its own Hessian and the server averages the
local hypergradients (biased under non-IID data, whatever n).

What was taken from where: the problem, the partial participation and the role of client sampling in the
federated hypergradient estimate follow the paper's abstract and setting; we could not consult the paper's
algorithm box offline, so the staging above (fresh client samples per Neumann term, τ local steps on y, the
step sizes) is our reading of it and is named as such in the notebook. Second-order products come from
fedlab_nb.methods.bilevel.derivatives (matrix-free) or, for the quadratic test problem, from its matrices (checked
equal in tests/test_fedmbo.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad, vmap

from ...core.registry import register
from ...core.streams import register_stream
from . import derivatives as d
from ...data import load_dataset
from .dsbo import QuadraticNodes

FEDMBO_SAMPLING = register_stream("fedmbo", 52)   # client samples and mini-batches of a FedMBO run


@dataclass
class FedMBOConfig:
    rounds: int = 1000
    clients_per_round: int = 4      # n
    local_steps: int = 5            # τ: local SGD steps on y
    neumann_terms: int = 30         # Q
    alpha: float = 0.5              # upper step size
    beta: float = 0.05              # lower (local SGD) step size
    eta: float = 0.25               # Neumann step: must be < 1 / L of ∇²_yy g
    estimator: str = "fedmbo"       # "fedmbo" | "local"

    def check(self, m: int) -> "FedMBOConfig":
        for name in ("rounds", "local_steps", "neumann_terms", "clients_per_round"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"FedMBOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.clients_per_round > m:
            raise ValueError(f"FedMBOConfig.clients_per_round = {self.clients_per_round} > {m} clients; lower it")
        for name in ("alpha", "beta", "eta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FedMBOConfig.{name} (a step size) must be > 0, got {getattr(self, name)}")
        if self.estimator not in ("fedmbo", "local"):
            raise ValueError(f"FedMBOConfig.estimator must be 'fedmbo' or 'local', got {self.estimator!r}")
        return self


class AutodiffClients:
    """Client oracles from per-client objectives f(x, y, data, batch), g(x, y, data, batch) (the DSBO
    convention): gradients by torch.func, Hessian- and Jacobian-vector products matrix-free, vmapped over the
    sampled clients. `data`: tensors with a leading client axis; `sample(clients, generator)` returns the
    clients' mini-batches (leading axis = len(clients))."""

    def __init__(self, f, g, data, sample):
        self.f, self.g, self.data, self.sample = f, g, data, sample
        self.m = _leading(data)
        bind = lambda fn, di, b: (lambda x, y: fn(x, y, di, b))
        self._gy = vmap(lambda x, y, di, b: d.grad_y(bind(g, di, b), x, y), in_dims=(None, 0, 0, 0))
        self._f = vmap(lambda x, y, di, b: grad(bind(f, di, b), argnums=(0, 1))(x, y), in_dims=(None, None, 0, 0))
        self._hvp = vmap(lambda x, y, v, di, b: d.hvp_yy(bind(g, di, b), x, y, v), in_dims=(None, None, 0, 0, 0))
        self._cross = vmap(lambda x, y, v, di, b: d.cross_vjp(bind(g, di, b), x, y, v), in_dims=(None, None, 0, 0, 0))

    def _part(self, clients):
        return tuple(t[clients] for t in self.data) if isinstance(self.data, tuple) else self.data[clients]

    def grad_y_g(self, x, Y, clients, gen):
        return self._gy(x, Y, self._part(clients), self.sample(clients, gen))

    def grad_f(self, x, y, clients, gen):
        return self._f(x, y, self._part(clients), self.sample(clients, gen))

    def hvp(self, x, y, V, clients, gen):
        return self._hvp(x, y, V, self._part(clients), self.sample(clients, gen))

    def cross(self, x, y, V, clients, gen):
        return self._cross(x, y, V, self._part(clients), self.sample(clients, gen))


class QuadraticClients:
    """The same oracles for QuadraticNodes in closed form (batched matrix products; much faster than
    autodiff for thousands of rounds). Mini-batches are rows of each client's data, as in QuadraticNodes."""

    def __init__(self, problem: QuadraticNodes):
        self.p, self.m = problem, problem.rows.shape[0]

    def _rows(self, clients, gen):
        n_rows = self.p.rows.shape[1]
        if self.p.batch >= n_rows:   # full batches: exact oracles
            return self.p.rows[clients]
        idx = torch.randint(n_rows, (len(clients), self.p.batch), generator=gen)
        return torch.gather(self.p.rows[clients], 1, idx[..., None].expand(-1, -1, self.p.rows.shape[2]))

    def _a_times(self, zb, V):
        return torch.einsum("cbq,cb->cq", zb, torch.einsum("cbq,cq->cb", zb, V)) / zb.shape[1] + self.p.mu * V

    def grad_y_g(self, x, Y, clients, gen):
        return self._a_times(self._rows(clients, gen), Y) - self.p.B[clients] @ x

    def grad_f(self, x, y, clients, gen):
        noise = self.p.target_noise * torch.randn(len(clients), y.shape[0], generator=gen, dtype=y.dtype)
        return (self.p.lam * x).expand(len(clients), -1), y - self.p.C[clients] - noise

    def hvp(self, x, y, V, clients, gen):
        return self._a_times(self._rows(clients, gen), V)

    def cross(self, x, y, V, clients, gen):
        return -torch.einsum("cqp,cq->cp", self.p.B[clients], V)


def fedmbo(oracles, x0: torch.Tensor, y0: torch.Tensor, config: FedMBOConfig = FedMBOConfig(), seed: int = 0,
           monitor=None) -> dict:
    """Run FedMBO (or the local-hypergradient contrast) for config.rounds rounds; `monitor(k, x, y)` may
    return a dict logged after round k. Returns x, y and the log."""
    cfg = config.check(oracles.m)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + FEDMBO_SAMPLING)
    x, y, log = x0.clone(), y0.clone(), []
    for k in range(cfg.rounds):
        clients = _sample(oracles.m, cfg.clients_per_round, gen)
        y = _lower_level(oracles, x, y, clients, cfg, gen)
        h = (_hypergradient if cfg.estimator == "fedmbo" else _local_hypergradients)(oracles, x, y, clients, cfg, gen)
        x = x - cfg.alpha * h
        if monitor is not None and (row := monitor(k + 1, x, y)):
            log.append({"round": k + 1, **row})
    return {"x": x, "y": y, "log": log}


def lower_level_only(oracles, x: torch.Tensor, y0: torch.Tensor, config: FedMBOConfig, seed: int = 0) -> torch.Tensor:
    """The baseline with the upper variable frozen at x (e.g. uniform weights): FedAvg on the lower level alone."""
    cfg = config.check(oracles.m)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + FEDMBO_SAMPLING)
    y = y0.clone()
    for _ in range(cfg.rounds):
        y = _lower_level(oracles, x, y, _sample(oracles.m, cfg.clients_per_round, gen), cfg, gen)
    return y


def _sample(m, n, gen):
    return torch.randperm(m, generator=gen)[:n]


def _lower_level(oracles, x, y, clients, cfg, gen):
    """τ local SGD steps on g_i from the broadcast y on every sampled client, then the server's average."""
    Y = y.expand(len(clients), -1).clone()
    for _ in range(cfg.local_steps):
        Y = Y - cfg.beta * oracles.grad_y_g(x, Y, clients, gen)
    return Y.mean(0)


def _hypergradient(oracles, x, y, clients, cfg, gen):
    """FedMBO's estimate: global ∇_y f from the round's clients, then a Neumann series whose every factor
    averages the HVPs of a fresh, independent client sample."""
    fx, fy = oracles.grad_f(x, y, clients, gen)
    term = fy.mean(0)
    v = cfg.eta * term
    for _ in range(cfg.neumann_terms - 1):
        fresh = _sample(oracles.m, cfg.clients_per_round, gen)
        term = term - cfg.eta * oracles.hvp(x, y, term.expand(len(fresh), -1), fresh, gen).mean(0)
        v = v + cfg.eta * term
    fresh = _sample(oracles.m, cfg.clients_per_round, gen)   # independent of b's clients: no covariance bias
    return fx.mean(0) - oracles.cross(x, y, v.expand(len(fresh), -1), fresh, gen).mean(0)


def _local_hypergradients(oracles, x, y, clients, cfg, gen):
    """The naive contrast: client i solves with its own Hessian, h_i = ∇_x f_i − ∇²_xy g_i H_i⁻¹ ∇_y f_i
    (the same Neumann series, local HVPs only); the server averages the h_i."""
    fx, fy = oracles.grad_f(x, y, clients, gen)
    term, V = fy, cfg.eta * fy
    for _ in range(cfg.neumann_terms - 1):
        term = term - cfg.eta * oracles.hvp(x, y, term, clients, gen)
        V = V + cfg.eta * term
    return (fx - oracles.cross(x, y, V, clients, gen)).mean(0)


def correlated_quadratic(m: int = 50, p: int = 5, q: int = 8, n: int = 64, seed: int = 0, correlation: float = 1.0,
                         **kw) -> QuadraticNodes:
    """A QuadraticNodes problem whose targets c_i move with the clients' coupling B_i (c_i = κ B'_i w + noise):
    the non-IID case where averaging local hypergradients is biased, since mean(B_iᵀ H⁻¹ c_i) ≠ B̄ᵀ H⁻¹ c̄."""
    problem = QuadraticNodes.random(m=m, p=p, q=q, n=n, seed=seed, **kw)
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    w = torch.randn(p, generator=gen, dtype=problem.B.dtype)
    spread = problem.B - problem.B.mean(0)
    problem.C = problem.C + correlation * q ** 0.5 * spread @ w
    return problem


def _leading(data) -> int:
    return (data[0] if isinstance(data, tuple) else data).shape[0]


@register("fedmbo", claims="fedmbo", kind="module")
def run_quadratic(problem: QuadraticNodes, config: FedMBOConfig = FedMBOConfig(), seed: int = 0,
                  every: int = 1) -> dict:
    """FedMBO on a QuadraticNodes problem (clients = nodes), logging the exact ‖∇F(x_k)‖² every `every` rounds."""
    p, q = problem.B.shape[2], problem.B.shape[1]
    a_bar, b_bar, c_bar = problem.A().mean(0), problem.B.mean(0), problem.C.mean(0)
    ainv_b = torch.linalg.solve(a_bar, b_bar)

    def monitor(k, x, y):
        if k % every:
            return {}
        grad_f = problem.lam * x + ainv_b.T @ (ainv_b @ x - c_bar)   # QuadraticNodes.hypergradient, factored once
        return {"grad_sq": float(grad_f @ grad_f)}

    x0, y0 = torch.zeros(p, dtype=problem.B.dtype), torch.zeros(q, dtype=problem.B.dtype)
    return fedmbo(QuadraticClients(problem), x0, y0, config, seed, monitor)


# --- federated data hyper-cleaning: per-sample weights σ(x_j) learned against clean validation data ----------
@dataclass
class HyperCleaning:
    """Client i holds n training rows with partly flipped labels and a small clean validation set. Lower level:
    weighted softmax regression, g_i = Σ_j σ(x_j)·CE(y; s_j, ỹ_j)/n + (μ/2)‖y‖²; upper level: f_i = CE on the
    client's clean validation rows. x has one logit per training row of every client (row j of client i is
    x[index[i, j]]), so a client's hypergradient touches only its own rows' weights."""
    features: torch.Tensor     # [M, n, d]
    labels: torch.Tensor       # [M, n]  (noisy)
    noisy: torch.Tensor        # [M, n]  bool: was this label flipped?
    index: torch.Tensor        # [M, n]  position of each row in x
    val_features: torch.Tensor  # [M, v, d]
    val_labels: torch.Tensor    # [M, v]
    test_features: torch.Tensor  # [t, d]  held out, for reporting only
    test_labels: torch.Tensor    # [t]
    num_classes: int
    mu: float = 0.01
    batch: int = 50

    @property
    def data(self):
        return (self.features, self.labels, self.index, self.val_features, self.val_labels)

    def logits(self, y, feats):
        d = feats.shape[-1]
        w, b = y[: d * self.num_classes].reshape(d, self.num_classes), y[d * self.num_classes:]
        return feats @ w + b

    def g(self, x, y, data, batch):
        feats, labels, index, _, _ = data
        rows = batch["rows"]
        weights = torch.sigmoid(torch.index_select(x, 0, torch.index_select(index, 0, rows)))
        ce = torch.nn.functional.cross_entropy(self.logits(y, torch.index_select(feats, 0, rows)),
                                               torch.index_select(labels, 0, rows), reduction="none")
        return (weights * ce).mean() + 0.5 * self.mu * y @ y

    def f(self, x, y, data, batch):
        _, _, _, val_feats, val_labels = data
        return torch.nn.functional.cross_entropy(self.logits(y, val_feats), val_labels)

    def sampler(self):
        n = self.features.shape[1]
        return lambda clients, gen: {"rows": torch.stack([torch.randperm(n, generator=gen)[: self.batch]
                                                          for _ in range(len(clients))])}

    def oracles(self) -> AutodiffClients:
        return AutodiffClients(self.f, self.g, self.data, self.sampler())

    def test_accuracy(self, y) -> float:
        return float((self.logits(y, self.test_features).argmax(1) == self.test_labels).double().mean())

    def weight_auroc(self, x) -> float:
        """AUROC of the learned weights σ(x_j) separating clean rows (positives) from flipped ones."""
        from sklearn.metrics import roc_auc_score
        return float(roc_auc_score(~self.noisy.reshape(-1).numpy(), torch.sigmoid(x[self.index.reshape(-1)]).numpy()))

    @property
    def dims(self):
        return int(self.index.numel()), (self.features.shape[-1] + 1) * self.num_classes


def digits_hyper_cleaning(clients: int = 10, rows: int = 100, val_rows: int = 20, noise: float = 0.4,
                          seed: int = 0, dtype=torch.float64, **kw) -> HyperCleaning:
    """sklearn's 8×8 digits split IID over `clients`; a fraction `noise` of each client's training labels is
    replaced by a different random class. Features standardised on the training rows."""
    ds = load_dataset("digits")
    x_all = torch.cat([ds.x_train, ds.x_test]).reshape(-1, 64).to(dtype)
    y_all = torch.cat([ds.y_train, ds.y_test]).long()
    gen = torch.Generator().manual_seed(int(seed))
    need = clients * (rows + val_rows)
    if need > len(y_all):
        raise ValueError(f"clients·(rows + val_rows) = {need} exceeds the {len(y_all)} digits images; lower them")
    order = torch.randperm(len(y_all), generator=gen)[:need].reshape(clients, rows + val_rows)
    feats, labels = x_all[order], y_all[order]
    mean, std = feats[:, :rows].reshape(-1, 64).mean(0), feats[:, :rows].reshape(-1, 64).std(0) + 1e-3
    feats = (feats - mean) / std
    train_labels = labels[:, :rows].clone()
    noisy = torch.rand(clients, rows, generator=gen) < noise
    shift = torch.randint(1, ds.num_classes, (clients, rows), generator=gen)
    train_labels[noisy] = (train_labels[noisy] + shift[noisy]) % ds.num_classes   # always a wrong class
    index = torch.arange(clients * rows).reshape(clients, rows)
    rest = torch.ones(len(y_all), dtype=torch.bool)
    rest[order.reshape(-1)] = False
    return HyperCleaning(feats[:, :rows], train_labels, noisy, index, feats[:, rows:], labels[:, rows:],
                         (x_all[rest] - mean) / std, y_all[rest], ds.num_classes, **kw)
