"""The bilevel toolkit against closed forms (float64, < 1e-8 relative) and against torchopt's implicit diff."""
import warnings

import pytest
import torch

from fedlab_nb.methods.bilevel import derivatives as D
from fedlab_nb.methods.bilevel import implicit as I
from fedlab_nb.methods.bilevel import pbgd as P
from fedlab_nb.methods.bilevel import problems as Q
from fedlab_nb.methods.bilevel import hypergradients as U
from fedlab_nb.methods.bilevel import warm_cold_start as W

torch.set_num_threads(1)
DT = torch.float64
# torchopt (the reference) warns about functorch / torch.jit deprecations on current torch
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")


def rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.fixture(scope="module")
def ridge():
    return Q.digits_ridge(n_train=150, n_val=150, seed=0)


@pytest.fixture(scope="module")
def quad():
    return Q.random_quadratic(dim_y=6, dim_x=4, cond=10.0, rho=0.1, seed=0)


def x_ridge(p):
    return torch.linspace(-1.0, 1.0, p, dtype=DT)


# ------------------------------------------------------------------------------------------ derivatives
def test_hvp_and_cross_term_match_explicit_matrices(quad):
    x, y, v = torch.randn(4, dtype=DT), torch.randn(6, dtype=DT), torch.randn(6, dtype=DT)
    assert rel(D.hvp_yy(quad.inner, x, y, v), quad.A @ v) < 1e-12
    assert rel(D.cross_vjp(quad.inner, x, y, v), -quad.B.T @ v) < 1e-12   # ∇²_xy g = −Bᵀ
    full = torch.autograd.functional.hessian(lambda w: quad.inner(w[:4], w[4:]), torch.cat([x, y]))
    assert rel(D.hvp(lambda w: quad.inner(w[:4], w[4:]), torch.cat([x, y]), torch.cat([x, v])),
               full @ torch.cat([x, v])) < 1e-12
    assert rel(D.hvp_forward(lambda w: quad.inner(w[:4], w[4:]), torch.cat([x, y]), torch.cat([x, v])),
               full @ torch.cat([x, v])) < 1e-12


def test_ridge_hessian_vector_product(ridge):
    x = x_ridge(ridge.p)
    y, v = torch.randn(ridge.p * ridge.m, dtype=DT), torch.randn(ridge.p * ridge.m, dtype=DT)
    expect = (ridge.hessian(x) @ v.reshape(ridge.p, ridge.m)).reshape(-1)
    assert rel(D.hvp_yy(ridge.inner, x, y, v), expect) < 1e-12


# ------------------------------------------------------------------------------------------ implicit
@pytest.mark.parametrize("solver", ["cg", "neumann"])
def test_implicit_hypergradient_equals_closed_form_on_ridge(ridge, solver):
    x = x_ridge(ridge.p)
    y = ridge.solve(x)
    mu, L = ridge.smoothness(x)
    kw = {"tol": 1e-14} if solver == "cg" else {"alpha": 1 / L, "steps": int(40 * L / mu)}
    h = I.implicit_hypergradient(ridge.outer, ridge.inner, x, y, solver=solver, **kw)
    assert rel(h, ridge.hypergradient(x)) < 1e-8


def test_implicit_hypergradient_equals_closed_form_on_quadratic(quad):
    x = torch.randn(4, dtype=DT)
    assert rel(I.implicit_hypergradient(quad.outer, quad.inner, x, quad.solve(x)), quad.hypergradient(x)) < 1e-10


def test_cg_and_neumann_converge_to_the_solve(quad):
    b = torch.randn(6, dtype=DT)
    exact = torch.linalg.solve(quad.A, b)
    mv = lambda v: quad.A @ v
    assert rel(I.conjugate_gradient(mv, b, tol=1e-14), exact) < 1e-10
    errs = [rel(I.neumann_series(mv, b, alpha=0.1, steps=k), exact) for k in (10, 100, 400)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-12   # rate 1 − 0.1·λ_min = 0.9


def test_implicit_matches_torchopt_custom_root(ridge):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchopt

    x = x_ridge(ridge.p)

    def stationary(y, x_):
        return torch.func.grad(ridge.inner, argnums=1)(x_, y)

    @torchopt.diff.implicit.custom_root(stationary, argnums=1, solve=torchopt.linear_solve.solve_cg(rtol=1e-14, atol=0.0, maxiter=2000))
    def solve(y_init, x_):
        return ridge.solve(x_.detach())

    xr = x.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = solve(torch.zeros(ridge.p * ridge.m, dtype=DT), xr)
        (ref,) = torch.autograd.grad(ridge.outer(xr, y), xr)
    ours = I.implicit_hypergradient(ridge.outer, ridge.inner, x, ridge.solve(x), tol=1e-14)
    assert rel(ours, ref) < 1e-8


# ------------------------------------------------------------------------------------------ unrolled / truncated
def test_truncated_matches_matrix_power_closed_form(quad):
    x, y0 = torch.randn(4, dtype=DT), torch.zeros(6, dtype=DT)
    for keep in (0, 1, 5, 30):
        h = U.truncated_hypergradient(quad.outer, quad.inner, x, y0, lr=0.05, steps=30, keep=keep)
        assert rel(h, quad.truncated_hypergradient(x, y0, 0.05, 30, keep)) < 1e-10


def test_truncated_with_K_equal_T_is_full_unrolling(ridge):
    x, y0 = x_ridge(ridge.p), torch.zeros(ridge.p * ridge.m, dtype=DT)
    lr = 1 / ridge.smoothness(x)[1]
    full = U.autograd_unrolled_hypergradient(ridge.outer, ridge.inner, x, y0, lr=lr, steps=40)
    assert rel(U.truncated_hypergradient(ridge.outer, ridge.inner, x, y0, lr=lr, steps=40, keep=40), full) < 1e-12
    part = U.autograd_unrolled_hypergradient(ridge.outer, ridge.inner, x, y0, lr=lr, steps=40, keep=7)
    assert rel(U.truncated_hypergradient(ridge.outer, ridge.inner, x, y0, lr=lr, steps=40, keep=7), part) < 1e-12


def test_unrolled_tends_to_implicit_as_T_grows(quad):
    x, y0 = torch.randn(4, dtype=DT), torch.zeros(6, dtype=DT)
    lr = 1 / 10.0
    h = U.unrolled_hypergradient(quad.outer, quad.inner, x, y0, lr=lr, steps=600)
    assert rel(h, quad.hypergradient(x)) < 1e-8


def test_saved_tensor_meter_grows_with_unrolled_steps(quad):
    x, y0 = torch.randn(4, dtype=DT), torch.zeros(6, dtype=DT)
    peaks = []
    for T in (10, 20):
        with U.SavedTensorMeter() as m:
            U.autograd_unrolled_hypergradient(quad.outer, quad.inner, x, y0, lr=0.1, steps=T)
        peaks.append(m.peak)
        assert m.live == 0
    assert peaks[1] > 1.8 * peaks[0]


# ------------------------------------------------------------------------------------------ PBGD
def test_pbgd_reaches_the_penalised_solution_and_its_gap():
    gamma = 3.0
    res = P.pbgd(Q.penalty_toy_outer, Q.penalty_toy_inner, torch.zeros(1, dtype=DT), torch.zeros(2, dtype=DT),
                 gamma=gamma, lr=1 / (2 + 6 * gamma), steps=400, inner_lr=0.25, inner_steps=1)
    x_g, y_g = Q.penalty_toy_penalised_solution(gamma)
    assert abs(float(res.x) - x_g) < 1e-10 and float((res.y - y_g).abs().max()) < 1e-10
    assert abs((x_g - 2 / 3) - 1 / (3 * (1 + 3 * gamma))) < 1e-14     # the O(1/γ) gap, exactly


# ------------------------------------------------------------------------------------------ warm / cold start
def test_cold_start_is_min_norm_and_warm_start_is_not():
    g = torch.Generator().manual_seed(0)
    Z0, E = torch.randn(5, 12, generator=g, dtype=DT), torch.randn(5, 12, generator=g, dtype=DT)
    t, v = torch.randn(5, generator=g, dtype=DT), torch.randn(12, generator=g, dtype=DT)
    inner = lambda x, w: 0.5 * (((Z0 + x[0] * E) @ w - t) ** 2).sum()
    outer = lambda x, w: 0.5 * (w @ v - 1.0) ** 2
    lr = 0.5 / float(torch.linalg.matrix_norm(Z0, 2)) ** 2
    kw = dict(outer_steps=3, outer_lr=0.05, inner_steps=250, inner_lr=lr)
    cold = W.bilevel_descent(outer, inner, torch.zeros(1, dtype=DT), torch.zeros(12, dtype=DT), warm=False, **kw)
    warm = W.bilevel_descent(outer, inner, torch.zeros(1, dtype=DT), torch.zeros(12, dtype=DT), warm=True, **kw)
    pinv = torch.linalg.pinv(Z0 + cold.x[0] * E) @ t
    assert rel(cold.y, pinv) < 1e-8
    assert rel(warm.y, torch.linalg.pinv(Z0 + warm.x[0] * E) @ t) > 1e-3


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_name_the_parameter(quad):
    x, y = torch.zeros(4, dtype=DT), torch.zeros(6, dtype=DT)
    with pytest.raises(ValueError, match="solver"):
        I.implicit_hypergradient(quad.outer, quad.inner, x, y, solver="lu")
    with pytest.raises(ValueError, match="alpha"):
        I.implicit_hypergradient(quad.outer, quad.inner, x, y, solver="neumann")
    with pytest.raises(ValueError, match="keep"):
        U.truncated_hypergradient(quad.outer, quad.inner, x, y, lr=0.1, steps=5, keep=6)
    with pytest.raises(ValueError, match="lr"):
        U.truncated_hypergradient(quad.outer, quad.inner, x, y, lr=0.0, steps=5, keep=5)
    with pytest.raises(ValueError, match="x must be a 1-D"):
        U.truncated_hypergradient(quad.outer, quad.inner, x.reshape(2, 2), y, lr=0.1, steps=5, keep=5)
    with pytest.raises(ValueError, match="gamma"):
        P.pbgd(quad.outer, quad.inner, x, y, gamma=0, lr=0.1, steps=1, inner_lr=0.1, inner_steps=1)
    with pytest.raises(ValueError, match="warm"):
        W.bilevel_descent(quad.outer, quad.inner, x, y, warm="yes", outer_steps=1, outer_lr=0.1, inner_steps=1,
                          inner_lr=0.1)
    with pytest.raises(ValueError, match="tol"):
        I.conjugate_gradient(lambda v: v, y + 1, tol=0)
