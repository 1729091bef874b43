"""PGD (fedlab_nb.methods.more.adversarial): ball and box constraints, eps = 0, ascent, and the closed-form worst case
of a linear logistic model under an ℓ∞ ball (Goodfellow et al. 2015; Madry et al. 2018)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer

from fedlab_nb.methods.more.adversarial import pgd, robust_accuracy

torch.set_num_threads(1)


def _mlp(seed=0, d=16, c=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, c))


def _data(seed=0, n=64, d=16, c=4):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g), torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_outputs_in_ball_and_box(norm):
    model, (x, y) = _mlp(), _data()
    eps = 0.1 if norm == "linf" else 0.5
    x_adv = pgd(model, x, y, eps, eps / 4, 10, norm, generator=torch.Generator().manual_seed(1))
    dist = (x_adv - x).abs().amax(1) if norm == "linf" else (x_adv - x).norm(dim=1)
    assert (dist <= eps + 1e-6).all()
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert not x_adv.requires_grad


def test_eps_zero_returns_the_input_exactly():
    model, (x, y) = _mlp(), _data()
    assert torch.equal(pgd(model, x, y, 0.0, 0.01, 5, generator=torch.Generator().manual_seed(0)), x)


def test_pgd_loss_at_least_clean_loss():
    model, (x, y) = _mlp(), _data()
    x_adv = pgd(model, x, y, 0.1, 0.025, 10, rand_init=False)
    with torch.no_grad():
        assert F.cross_entropy(model(x_adv), y) >= F.cross_entropy(model(x), y)


def test_generator_keys_the_random_start():
    model, (x, y) = _mlp(), _data()
    a = pgd(model, x, y, 0.1, 0.0, 0, generator=torch.Generator().manual_seed(3))
    b = pgd(model, x, y, 0.1, 0.0, 0, generator=torch.Generator().manual_seed(3))
    c = pgd(model, x, y, 0.1, 0.0, 0, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_linear_logistic_closed_form_worst_case():
    """For logits (0, wᵀx + b) the ℓ∞ worst case is softplus(−(y(wᵀx + b) − ε‖w‖₁)) with y ∈ {±1}."""
    X, t = load_breast_cancer(return_X_y=True)
    X = torch.tensor((X - X.mean(0)) / X.std(0))
    torch.manual_seed(0)
    w, b = torch.randn(X.shape[1], dtype=torch.float64) * 0.3, torch.tensor(0.1, dtype=torch.float64)
    model = lambda z: torch.stack([torch.zeros(len(z), dtype=z.dtype), z @ w + b], 1)  # noqa: E731
    y, eps = torch.tensor(t), 0.05
    x_adv = pgd(model, X, y, eps, eps / 4, 50, generator=torch.Generator().manual_seed(0), clip=None)
    got = F.cross_entropy(model(x_adv), y)
    s = 2.0 * y.double() - 1
    closed = F.softplus(-(s * (X @ w + b) - eps * w.abs().sum())).mean()
    assert abs(float(got - closed)) < 1e-4
    assert float(got - closed) <= 1e-12  # PGD never beats the true maximum


def test_robust_accuracy_eps_zero_is_clean_accuracy():
    model, (x, y) = _mlp(), _data()
    with torch.no_grad():
        clean = float((model(x).argmax(1) == y).float().mean())
    assert robust_accuracy(model, x, y, 0.0, 0.0, 3, restarts=2) == clean
    assert robust_accuracy(model, x, y, 0.2, 0.05, 10, restarts=2, generator=torch.Generator().manual_seed(0)) <= clean


@pytest.mark.parametrize("kw, word", [({"eps": -0.1}, "eps"), ({"alpha": -1.0}, "alpha"), ({"steps": 1.5}, "steps"),
                                      ({"norm": "l1"}, "norm")])
def test_bad_arguments_name_the_parameter(kw, word):
    model, (x, y) = _mlp(), _data()
    args = {"eps": 0.1, "alpha": 0.01, "steps": 2, "norm": "linf", **kw}
    with pytest.raises(ValueError, match=word):
        pgd(model, x, y, **args)
