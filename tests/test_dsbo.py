"""DSBO (fedlab_nb/methods/bilevel/dsbo.py): matrix-free iterates equal explicit-Hessian ones, the closed-form
hypergradient of the test problem, convergence without heterogeneity, the memory probe, errors."""
import pytest
import torch
from torch.func import grad

from fedlab_nb import gossip as G
from fedlab_nb.methods.bilevel import dsbo as D

W = G.metropolis_weights(G.ring(4))


def _run(problem, cfg, deterministic, seed=0):
    p, q = problem.B.shape[2], problem.B.shape[1]
    x0, y0 = torch.zeros(p, dtype=torch.float64), torch.zeros(q, dtype=torch.float64)
    return D.dsbo(problem.f, problem.g, problem.data, problem.sampler(deterministic), W, x0, y0, cfg, seed)


@pytest.mark.parametrize("deterministic", [True, False])
def test_hvp_iterates_equal_explicit_hessian_iterates(deterministic):
    problem = D.QuadraticNodes.random(m=4, p=3, q=6, n=20, seed=1)
    cfg = dict(outer_steps=15, inner_y=2, inner_z=3, alpha=0.1)
    a = _run(problem, D.DSBOConfig(**cfg), deterministic)
    b = _run(problem, D.DSBOConfig(**cfg, explicit=True), deterministic)
    for key in ("x", "y", "z"):
        assert torch.allclose(a[key], b[key], rtol=1e-10, atol=1e-12), key


def test_closed_form_hypergradient_matches_autograd_through_the_exact_inner_solution():
    problem = D.QuadraticNodes.random(m=4, p=3, q=6, n=20, seed=2)
    a_bar, b_bar, c = problem.A().mean(0), problem.B.mean(0), problem.C

    def upper(x):
        y = torch.linalg.solve(a_bar, b_bar @ x)
        return 0.5 * (y - c).pow(2).sum(1).mean() + 0.5 * problem.lam * x @ x

    x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(problem.hypergradient(x), grad(upper)(x), rtol=1e-12, atol=1e-14)
    assert problem.hypergradient(problem.x_star()).norm() < 1e-12


def test_without_heterogeneity_dsbo_converges_to_the_bilevel_solution():
    problem = D.QuadraticNodes.random(m=4, p=3, q=6, n=20, seed=3, heterogeneity=0.0)
    problem.rows = problem.rows[:1].expand_as(problem.rows).clone()       # the same data on every node
    problem.C = problem.C + torch.linspace(-1, 1, 6, dtype=torch.float64)  # a non-trivial target, equal on all nodes
    out = _run(problem, D.DSBOConfig(outer_steps=300, inner_y=5, inner_z=5, alpha=0.5, beta=0.1, gamma=0.1), True)
    assert (out["x"].mean(0) - problem.x_star()).norm() < 1e-6 * problem.x_star().norm()


def test_largest_tensor_sees_the_explicit_hessian():
    problem = D.QuadraticNodes.random(m=4, p=3, q=40, n=20, seed=4)
    sizes = {}
    for explicit in (False, True):
        with D.LargestTensor() as probe:
            _run(problem, D.DSBOConfig(outer_steps=1, inner_y=1, inner_z=1, explicit=explicit), False)
        sizes[explicit] = probe.bytes
    assert sizes[True] >= 4 * 40 * 40 * 8 > sizes[False]


def test_bad_config_names_the_parameter():
    with pytest.raises(ValueError, match="alpha"):
        D.DSBOConfig(alpha=0).check()
    with pytest.raises(ValueError, match="inner_z"):
        D.DSBOConfig(inner_z=0).check()
    with pytest.raises(ValueError, match="doubly stochastic"):
        problem = D.QuadraticNodes.random(m=2, p=2, q=3, n=5)
        D.dsbo(problem.f, problem.g, problem.data, problem.sampler(), [[1.0, 0.5], [0.0, 0.5]],
               torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
