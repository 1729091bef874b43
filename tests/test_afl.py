"""AFL (fedlab_nb.methods.weights.afl): the AA law is the ridge solution on the union of the clients' data, the
removal step gives back least squares, and both hold for any split of the rows, including 1,000 clients."""
import numpy as np
import pytest
import torch

from fedlab_nb.methods.weights import afl as A

D, C = 12, 3


def data(n=400, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (n,), generator=g)
    return x, y


def split(n, k, seed=0, allow_empty=True):
    """k random client index sets of very different sizes (some empty when allow_empty)."""
    g = np.random.default_rng(seed)
    owner = g.choice(k, n, p=g.dirichlet(np.full(k, 0.3)))
    if not allow_empty:
        owner[:k] = np.arange(k)
    return [np.flatnonzero(owner == i) for i in range(k)]


def ridge(x, y, lam):
    """Textbook ridge head on one-hot labels, written independently of the module."""
    yy = torch.nn.functional.one_hot(y, C).double()
    return torch.linalg.inv(x.T @ x + lam * torch.eye(x.shape[1], dtype=x.dtype)) @ x.T @ yy


def test_aa_law_is_ridge_on_the_union():
    x, y = data()
    u, v = np.arange(150), np.arange(150, 400)
    w, c = A.aa_law(*A.local_solution(x[u], y[u], C, 0.5), *A.local_solution(x[v], y[v], C, 0.5))
    assert torch.allclose(w, ridge(x, y, 1.0), atol=1e-10)       # two clients → penalty 2γ
    assert torch.allclose(c, x.T @ x + torch.eye(D, dtype=x.dtype), atol=1e-10)


def test_paper_form_equals_one_solve_form():
    x, y = data(n=60)
    a = A.local_solution(x[:7], y[:7], C, 0.3)                   # fewer rows than features: needs γ
    b = A.local_solution(x[7:], y[7:], C, 0.3)
    w1, c1 = A.aa_law(*a, *b)
    w2, c2 = A.aa_law_paper_form(*a, *b)
    assert torch.allclose(w1, w2, atol=1e-9) and torch.equal(c1, c2)


@pytest.mark.parametrize("k", [2, 10, 100, 1000])
def test_weight_invariance_any_split(k):
    x, y = data(n=1500 if k == 1000 else 400)
    w_star = A.centralised_solution(x, y, C)
    clients = [(x[i], y[i]) for i in split(len(y), k, seed=k)]
    assert any(len(cy) == 0 for _, cy in clients) or k < 100     # empty clients do occur for large k
    w = A.afl(clients, C, gamma=1.0)
    assert (w - w_star).abs().max() < 1e-8
    assert (A.afl_from_statistics(clients, C) - w_star).abs().max() < 1e-8


def test_removal_step_is_needed_and_gamma_free():
    x, y = data()
    clients = [(x[i], y[i]) for i in split(len(y), 20, seed=3)]
    w_star = A.centralised_solution(x, y, C)
    for gamma in (1e-2, 1.0, 10.0):
        sols = [A.local_solution(cx, cy, C, gamma) for cx, cy in clients]
        w_ridge, c = A.aggregate(sols)
        assert torch.allclose(w_ridge, ridge(x, y, 20 * gamma), atol=1e-9)   # before removal: Kγ-ridge
        assert (w_ridge - w_star).abs().max() > 1e-6                         # ... which is not W*
        assert (A.remove_regularisation(w_ridge, c, 20 * gamma) - w_star).abs().max() < 1e-9


def test_merge_order_does_not_matter():
    x, y = data()
    sols = [A.local_solution(x[i], y[i], C, 1.0) for i in split(len(y), 8, seed=1)]
    w1, _ = A.aggregate(sols)
    w2, _ = A.aggregate(sols[::-1])
    assert torch.allclose(w1, w2, atol=1e-10)


def test_one_shot_average_is_not_invariant():
    x, y = data()
    order = torch.argsort(y).numpy()                             # label-sorted split: each client ≈ one class
    parts = np.array_split(order, 3)
    sols = [A.local_solution(x[p], y[p], C, 1.0) for p in parts]
    w_avg = A.one_shot_average(sols, [len(p) for p in parts])
    assert (w_avg - A.centralised_solution(x, y, C)).abs().max() > 1e-2


def test_random_features_are_frozen_and_full_rank():
    x = torch.rand(300, 8)
    f1, f2 = A.random_fourier_features(x, 64, seed=5), A.random_fourier_features(x, 64, seed=5)
    assert torch.equal(f1, f2) and f1.dtype == torch.float64
    assert torch.linalg.matrix_rank(f1) == 64
    assert not torch.equal(f1, A.random_fourier_features(x, 64, seed=6))


def test_bad_inputs_raise():
    x, y = data(n=20)
    with pytest.raises(ValueError, match="gamma"):
        A.local_solution(x, y, C, gamma=0.0)
    with pytest.raises(ValueError, match="labels y"):
        A.local_statistics(x, y[:5], C)
    with pytest.raises(ValueError, match="features x"):
        A.local_statistics(x[0], y, C)
    with pytest.raises(ValueError, match="at least one"):
        A.aggregate([])
    with pytest.raises(ValueError, match="shapes differ"):
        A.aa_law(*A.local_solution(x, y, C), *A.local_solution(x[:, :5], y, C))
    with pytest.raises(ValueError, match="num_features"):
        A.random_fourier_features(x, 0)
    with pytest.raises(ValueError, match="sizes"):
        A.one_shot_average([A.local_solution(x, y, C)], [0])
    with pytest.raises(ValueError, match="positive definite"):    # fewer pooled rows than features
        A.remove_regularisation(*A.aggregate([A.local_solution(x[:5], y[:5], C)]), 1.0)
