"""Bilevel test problems with closed-form answers (float64): the references every hypergradient is checked on.

- `RidgeHPO`: ridge regression with one L2 weight per feature, λ_j = exp(x_j), as the upper variable;
  inner g(x, W) = ‖X W − Y‖² / (2n) + ½ Σ_j e^{x_j} ‖W_j‖², outer f(W) = ‖X_v W − Y_v‖² / (2n_v).
- `QuadraticBilevel`: g(x, y) = ½ yᵀA y − yᵀB x, f(x, y) = ½‖y − c‖² + ½ρ‖x‖²: y*(x) = A⁻¹Bx, and the
  hypergradient of T unrolled GD steps and of K-step truncation are matrix powers (no autodiff).
- `penalty_toy`: g = (y₁ + y₂ − x)², f = (x − 1)² + ‖y‖², whose lower level has a line of solutions.

Inner variables are flat vectors (W flattened row-major), the package convention."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data import load_dataset

DTYPE = torch.float64


@dataclass
class RidgeHPO:
    """Per-feature ridge HPO on (X, Y) train and (Xv, Yv) validation; Y one-hot or real, n × m."""
    X: torch.Tensor
    Y: torch.Tensor
    Xv: torch.Tensor
    Yv: torch.Tensor

    def __post_init__(self):
        for name in ("X", "Y", "Xv", "Yv"):
            t = getattr(self, name)
            if t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D matrix (rows = samples), got shape {tuple(t.shape)}")
        if self.X.shape[0] != self.Y.shape[0] or self.Xv.shape[0] != self.Yv.shape[0]:
            raise ValueError("X and Y (and Xv and Yv) must have the same number of rows")
        if self.X.shape[1] != self.Xv.shape[1] or self.Y.shape[1] != self.Yv.shape[1]:
            raise ValueError("train and validation must have the same feature and output sizes")

    @property
    def p(self) -> int:
        return self.X.shape[1]

    @property
    def m(self) -> int:
        return self.Y.shape[1]

    def weights(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.p, self.m)

    def inner(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """g(x, y): the training loss plus the per-feature L2 penalty."""
        W = self.weights(y)
        fit = ((self.X @ W - self.Y) ** 2).sum() / (2 * self.X.shape[0])
        return fit + 0.5 * (torch.exp(x) * (W ** 2).sum(1)).sum()

    def outer(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """f(x, y): the validation loss (does not depend on x directly)."""
        W = self.weights(y)
        return ((self.Xv @ W - self.Yv) ** 2).sum() / (2 * self.Xv.shape[0])

    def hessian(self, x: torch.Tensor) -> torch.Tensor:
        """The p × p block H = XᵀX / n + diag(e^x); ∇²_yy g is H ⊗ I_m."""
        return self.X.T @ self.X / self.X.shape[0] + torch.diag(torch.exp(x))

    def solve(self, x: torch.Tensor) -> torch.Tensor:
        """y*(x) by a direct solve (flat)."""
        return torch.linalg.solve(self.hessian(x), self.X.T @ self.Y / self.X.shape[0]).reshape(-1)

    def hypergradient(self, x: torch.Tensor) -> torch.Tensor:
        """Closed form: ∇F(x)_j = −e^{x_j} Σ_k W*_jk V_jk with V = H⁻¹ ∇_W f (direct solves)."""
        W = self.weights(self.solve(x))
        grad_f = self.Xv.T @ (self.Xv @ W - self.Yv) / self.Xv.shape[0]
        V = torch.linalg.solve(self.hessian(x), grad_f)
        return -torch.exp(x) * (W * V).sum(1)

    def smoothness(self, x: torch.Tensor) -> tuple[float, float]:
        """(μ, L): the smallest and largest eigenvalues of ∇²_yy g, for step sizes and contraction factors."""
        ev = torch.linalg.eigvalsh(self.hessian(x))
        return float(ev[0]), float(ev[-1])


def digits_ridge(n_train: int = 300, n_val: int = 300, seed: int = 0) -> RidgeHPO:
    """RidgeHPO on sklearn digits (8×8 pixels standardised, one-hot targets), train/validation from the train split."""

    data = load_dataset("digits")
    if n_train + n_val > len(data.y_train):
        raise ValueError(f"n_train + n_val must be <= {len(data.y_train)}, got {n_train + n_val}")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data.y_train), generator=g)
    x = data.x_train.to(DTYPE)
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)  # constant border pixels stay 0
    y = torch.nn.functional.one_hot(data.y_train, data.num_classes).to(DTYPE)
    tr, va = order[:n_train], order[n_train:n_train + n_val]
    return RidgeHPO(x[tr], y[tr], x[va], y[va])


@dataclass
class QuadraticBilevel:
    """g(x, y) = ½ yᵀAy − yᵀBx, f(x, y) = ½‖y − c‖² + ½ρ‖x‖² with A symmetric positive definite."""
    A: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    rho: float = 0.0

    def inner(self, x, y):
        return 0.5 * y @ (self.A @ y) - y @ (self.B @ x)

    def outer(self, x, y):
        return 0.5 * ((y - self.c) ** 2).sum() + 0.5 * self.rho * (x ** 2).sum()

    def solve(self, x):
        return torch.linalg.solve(self.A, self.B @ x)

    def hypergradient(self, x):
        """∇F(x) = (A⁻¹B)ᵀ(y*(x) − c) + ρx."""
        M = torch.linalg.solve(self.A, self.B)
        return M.T @ (M @ x - self.c) + self.rho * x

    def minimiser(self):
        """The bilevel solution x* = (MᵀM + ρI)⁻¹ Mᵀc, M = A⁻¹B."""
        M = torch.linalg.solve(self.A, self.B)
        return torch.linalg.solve(M.T @ M + self.rho * torch.eye(M.shape[1], dtype=M.dtype), M.T @ self.c)

    def iterate(self, x, y0, lr, steps):
        """y_T of GD from y0: y_T = P^T y0 + (I − P^T) A⁻¹Bx with P = I − lr·A."""
        P_T = torch.linalg.matrix_power(torch.eye(len(y0), dtype=y0.dtype) - lr * self.A, steps)
        return P_T @ y0 + (torch.eye(len(y0), dtype=y0.dtype) - P_T) @ self.solve(x)

    def truncated_hypergradient(self, x, y0, lr, steps, keep):
        """Closed form of K-RMD: only the last K steps carry x's influence, dy_T/dx = (I − P^K) A⁻¹B."""
        eye = torch.eye(len(y0), dtype=y0.dtype)
        P_K = torch.linalg.matrix_power(eye - lr * self.A, keep)
        jac = (eye - P_K) @ torch.linalg.solve(self.A, self.B)
        return jac.T @ (self.iterate(x, y0, lr, steps) - self.c) + self.rho * x


def random_quadratic(dim_y: int = 6, dim_x: int = 4, cond: float = 10.0, rho: float = 0.1,
                     seed: int = 0) -> QuadraticBilevel:
    """A random QuadraticBilevel with eigenvalues of A spread in [1, cond]."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(dim_y, dim_y, generator=g, dtype=DTYPE))
    A = Q @ torch.diag(torch.linspace(1.0, cond, dim_y, dtype=DTYPE)) @ Q.T
    B = torch.randn(dim_y, dim_x, generator=g, dtype=DTYPE)
    c = torch.randn(dim_y, generator=g, dtype=DTYPE)
    return QuadraticBilevel(A, B, c, rho)


def penalty_toy_inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """g(x, y) = (y₁ + y₂ − x)²: every y on the line y₁ + y₂ = x is a lower-level solution (v(x) = 0)."""
    return (y.sum() - x.sum()) ** 2


def penalty_toy_outer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f(x, y) = (x − 1)² + ‖y‖²."""
    return ((x - 1) ** 2).sum() + (y ** 2).sum()


def penalty_toy_solution() -> tuple[float, tuple[float, float]]:
    """The optimistic bilevel solution: y = (x/2, x/2) on the line, min (x−1)² + x²/2 → x = 2/3."""
    return 2 / 3, (1 / 3, 1 / 3)


def penalty_toy_penalised_solution(gamma: float) -> tuple[float, float]:
    """Minimiser of f + γ(g − v): by symmetry y₁ = y₂ = γx/(1+2γ), and x_γ = (1+2γ)/(1+3γ) (so x_γ − 2/3 =
    1/(3(1+3γ)) = O(1/γ)). Returns (x_γ, y₁)."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    x = (1 + 2 * gamma) / (1 + 3 * gamma)
    return x, gamma * x / (1 + 2 * gamma)
