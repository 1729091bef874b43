"""DSBO — decentralised stochastic bilevel optimisation with Hessian-vector and Jacobian-vector products only.

Chen, Huang, Ma, Balasubramanian, "Decentralized Stochastic Bilevel Optimization with Improved
per-Iteration Complexity", ICML 2023.

m nodes on a graph with a doubly stochastic mixing matrix W (fedlab_nb.gossip) solve

    min_x  F(x) = (1/m) Σ_i f_i(x, y*(x)),    y*(x) = argmin_y (1/m) Σ_i g_i(x, y),

without a server. The hypergradient is ∇F = ∇_x f − ∇²_xy g · z*, with z* = [∇²_yy g]⁻¹ ∇_y f. Each node keeps
x_i, y_i, z_i and, per outer iteration k,
  1. runs T gossip steps of stochastic gradient descent on y:   y_i ← Σ_j W_ij y_j − β ∇_y g_i(x_i, y_i; ξ);
  2. runs N gossip steps on the linear system for z:             z_i ← Σ_j W_ij z_j − γ (∇²_yy g_i z_i − ∇_y f_i);
     (∇²_yy g_i z_i is one Hessian-vector product: the Hessian is never formed);
  3. forms its hypergradient estimate h_i = ∇_x f_i − ∇²_xy g_i z_i   (one Jacobian-vector product);
  4. tracks the network-average hypergradient and gossips x:
         s_i ← Σ_j W_ij s_j + h_i − h_i^prev,     x_i ← Σ_j W_ij x_j − α s_i.
The per-iteration cost is O(q) HVPs instead of the O(q²) memory and O(q) backward passes of an explicit
Hessian; `explicit=True` forms ∇²_yy g and ∇²_xy g as matrices and runs the same iteration, for the exactness
test and the cost comparison.

What was taken from where: steps 1–3 follow the paper's description (gossip on y and on the Hessian-inverse
vector z, HVP and JVP oracles, inner loops warm-started from the previous iterate). The gradient tracking in
step 4 is the standard heterogeneity correction of decentralised SGD (Pu & Nedić 2021); we could not check
the paper's exact outer update and step sizes offline, so it is an option (`tracking=False` gossips x with h_i
directly) and the notebook names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import grad, hessian, jacrev, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from ...core.registry import register
from ...core.streams import register_stream
from ...gossip import check_mixing, consensus_error, mix
from . import derivatives as d

DSBO_BATCHES = register_stream("dsbo_batches", 51)   # each node's mini-batches of the stochastic oracles

# A node's objective: (x, y, data, batch) -> scalar, where data and batch are that node's slices of
# tensors stacked over nodes; every oracle below is vmapped over the nodes.
Objective = Callable[[torch.Tensor, torch.Tensor, object, object], torch.Tensor]


def _bind(fn: Objective, data, batch):
    """fn with one node's data and mini-batch fixed: the (x, y) -> scalar form of
    fedlab_nb.methods.bilevel.derivatives."""
    return lambda x, y: fn(x, y, data, batch)


def explicit_matrices(g: Objective, x, y, data, batch):
    """∇²_yy g [q, q] and ∂(∇_y g)/∂x [q, p] as matrices: what an explicit-Hessian method forms."""
    g_xy = _bind(g, data, batch)
    return hessian(g_xy, argnums=1)(x, y), jacrev(lambda x_: d.grad_y(g_xy, x_, y))(x)


@dataclass
class DSBOConfig:
    outer_steps: int = 500
    inner_y: int = 5          # T: gossip-SGD steps on y per outer step
    inner_z: int = 5          # N: gossip steps on the linear system for z
    alpha: float = 0.05       # outer step size
    beta: float = 0.05        # y step size
    gamma: float = 0.05       # z step size
    tracking: bool = True     # gradient tracking of the hypergradient (see the module docstring)
    explicit: bool = False    # form the Hessian and Jacobian (the baseline DSBO improves on)

    def check(self) -> "DSBOConfig":
        for name in ("outer_steps", "inner_y", "inner_z"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DSBOConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DSBOConfig.{name} (a step size) must be > 0, got {getattr(self, name)}")
        return self


def dsbo(f: Objective, g: Objective, data, sample: Callable, w, x0: torch.Tensor, y0: torch.Tensor,
         config: DSBOConfig = DSBOConfig(), seed: int = 0, monitor: Callable | None = None) -> dict:
    """Run DSBO on m nodes. `f`, `g`: node objectives (x, y, data, batch) -> scalar; `data`: a tensor or tuple
    of tensors with a leading node axis; `sample(kind, generator)` returns the nodes' mini-batches (leading
    node axis) for kind "g" (lower) or "f" (upper); `w`: the [m, m] mixing matrix; x0 [p], y0 [q]: every
    node's start. `monitor(k, X, Y)` may return a dict logged after outer step k. Returns the stacked final
    states X [m, p], Y, Z [m, q] and the log."""
    cfg = config.check()
    w = torch.as_tensor(check_mixing(w), dtype=x0.dtype)
    m = w.shape[0]
    X, Y = x0.expand(m, -1).clone(), y0.expand(m, -1).clone()
    Z = torch.zeros_like(Y)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + DSBO_BATCHES)
    step_y = vmap(lambda x, y, data_i, b: d.grad_y(_bind(g, data_i, b), x, y))
    H_prev = S = None
    log = []
    for k in range(cfg.outer_steps):
        for _ in range(cfg.inner_y):
            Y = mix(w, Y) - cfg.beta * step_y(X, Y, data, sample("g", gen))
        Z, H = _z_and_hypergradient(f, g, data, sample("g", gen), sample("f", gen), w, X, Y, Z, cfg)
        S = H if S is None or not cfg.tracking else mix(w, S) + H - H_prev
        H_prev = H
        X = mix(w, X) - cfg.alpha * S
        if monitor is not None:
            row = monitor(k + 1, X, Y)
            if row:
                log.append({"step": k + 1, "consensus_x": consensus_error(X), **row})
    return {"x": X, "y": Y, "z": Z, "log": log}


def _z_and_hypergradient(f, g, data, batch_g, batch_f, w, X, Y, Z, cfg):
    """N gossip steps on ∇²_yy g z = ∇_y f, then h_i = ∇_x f_i − ∇²_xy g_i z_i, one batch per node."""
    fx, fy = vmap(grad(f, argnums=(0, 1)))(X, Y, data, batch_f)
    if cfg.explicit:
        h_yy, j_yx = vmap(lambda x, y, data_i, b: explicit_matrices(g, x, y, data_i, b))(X, Y, data, batch_g)
        hvp = lambda z: torch.einsum("mij,mj->mi", h_yy, z)
        cross = lambda z: torch.einsum("mij,mi->mj", j_yx, z)
    else:
        hvp = lambda z: vmap(lambda x, y, v, data_i, b: d.hvp_yy(_bind(g, data_i, b), x, y, v))(X, Y, z, data, batch_g)
        cross = lambda z: vmap(lambda x, y, v, data_i, b: d.cross_vjp(_bind(g, data_i, b), x, y, v))(X, Y, z, data, batch_g)
    for _ in range(cfg.inner_z):
        Z = mix(w, Z) - cfg.gamma * (hvp(Z) - fy)
    return Z, fx - cross(Z)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch operation produces while active (bytes): a measured memory
    footprint on any device, e.g. the [q, q] Hessian an explicit method materialises."""

    def __enter__(self):
        self.bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


# --- the notebook's problem: a non-IID quadratic bilevel problem with data-defined stochastic oracles ----------
@dataclass
class QuadraticNodes:
    """Node i: g_i(x, y) = ½ yᵀ A_i y − yᵀ B_i x with A_i = Z_iᵀZ_i/n + μI from n data rows, and
    f_i(x, y) = ½‖y − c_i‖² + (λ/2)‖x‖². Mini-batches are rows of Z_i (g) and noisy copies of c_i (f), so the
    oracle noise comes from sampling, not from noise added to a gradient."""
    rows: torch.Tensor      # [m, n, q]
    B: torch.Tensor         # [m, q, p]
    C: torch.Tensor         # [m, q]
    mu: float = 0.5
    lam: float = 0.1
    batch: int = 16
    target_noise: float = 0.5

    @classmethod
    def random(cls, m=8, p=5, q=8, n=64, seed=0, heterogeneity=1.0, dtype=torch.float64, **kw) -> "QuadraticNodes":
        gen = torch.Generator().manual_seed(int(seed))
        scales = 1 + 0.5 * heterogeneity * torch.rand(m, 1, 1, generator=gen, dtype=dtype)  # curvature differs per node
        rows = torch.randn(m, n, q, generator=gen, dtype=dtype) * scales
        B = torch.randn(q, p, generator=gen, dtype=dtype) + heterogeneity * torch.randn(m, q, p, generator=gen, dtype=dtype)
        C = heterogeneity * torch.randn(m, q, generator=gen, dtype=dtype)
        return cls(rows, B / q ** 0.5, C, **kw)

    @property
    def data(self):
        return (self.rows, self.B, self.C)

    def A(self):
        a = self.rows.transpose(-1, -2) @ self.rows / self.rows.shape[-2]
        return a + self.mu * torch.eye(self.rows.shape[-1], dtype=a.dtype)

    def g(self, x, y, data, batch):
        rows, B, _ = data
        zb = torch.index_select(rows, 0, batch["rows"])
        return 0.5 * (zb @ y).pow(2).mean() + 0.5 * self.mu * y @ y - y @ (B @ x)

    def f(self, x, y, data, batch):
        _, _, c = data
        return 0.5 * (y - c - batch["noise"]).pow(2).sum() + 0.5 * self.lam * x @ x

    def sampler(self, deterministic: bool = False):
        """Mini-batches for every node at once; deterministic = full batches and exact targets."""
        m, n, q = self.rows.shape

        def sample(kind, gen):
            if kind == "g":
                idx = torch.randint(n, (m, self.batch), generator=gen)
                return {"rows": torch.arange(n).expand(m, n) if deterministic else idx}
            noise = self.target_noise * torch.randn(m, q, generator=gen, dtype=self.C.dtype)
            return {"noise": noise * (0.0 if deterministic else 1.0)}
        return sample

    def y_star(self, x):
        return torch.linalg.solve(self.A().mean(0), self.B.mean(0) @ x)

    def hypergradient(self, x):
        """∇F(x) = λx + B̄ᵀ Ā⁻¹ (y*(x) − c̄), exact (float64)."""
        a_bar, b_bar = self.A().mean(0), self.B.mean(0)
        return self.lam * x + b_bar.T @ torch.linalg.solve(a_bar, self.y_star(x) - self.C.mean(0))

    def x_star(self):
        """The unique stationary point: (λI + B̄ᵀĀ⁻²B̄) x = B̄ᵀĀ⁻¹c̄ (F is a strongly convex quadratic in x)."""
        a_bar, b_bar = self.A().mean(0), self.B.mean(0)
        ainv_b = torch.linalg.solve(a_bar, b_bar)
        lhs = self.lam * torch.eye(b_bar.shape[1], dtype=b_bar.dtype) + ainv_b.T @ ainv_b
        return torch.linalg.solve(lhs, ainv_b.T @ self.C.mean(0))


@register("dsbo", claims="dsbo", kind="module")
def run_quadratic(problem: QuadraticNodes, w, config: DSBOConfig = DSBOConfig(), seed: int = 0,
                  deterministic: bool = False, every: int = 10) -> dict:
    """DSBO on a QuadraticNodes problem, logging ‖∇F(x̄)‖, ‖x̄ − x*‖ and the consensus errors every `every` steps."""
    p, q = problem.B.shape[2], problem.B.shape[1]
    x_star = problem.x_star()

    def monitor(k, X, Y):
        if k % every and k != config.outer_steps:
            return {}
        x_bar = X.mean(0)
        return {"grad_norm": float(problem.hypergradient(x_bar).norm()), "x_err": float((x_bar - x_star).norm()),
                "consensus_y": consensus_error(Y), "y_err": float((Y.mean(0) - problem.y_star(x_bar)).norm())}

    x0, y0 = torch.zeros(p, dtype=problem.B.dtype), torch.zeros(q, dtype=problem.B.dtype)
    return dsbo(problem.f, problem.g, problem.data, problem.sampler(deterministic), w, x0, y0, config, seed, monitor)
