"""fedlab_nb.methods.labels.mmd: the unbiased multi-kernel MMD² against a direct double-sum, the null mean, the Gaussian closed
form, gradients and argument checks."""
import itertools
import math

import numpy as np
import pytest
import torch

from fedlab_nb.methods.labels.mmd import gaussian_mmd2_closed_form, median_distance, mk_mmd2


def direct_mmd2(x, y, sigmas):
    """MMD²_u written as the three double sums of Gretton et al. (2012), Eq. 3, in plain Python."""
    k = lambda a, b: np.mean([math.exp(-np.sum((a - b) ** 2) / (2 * s * s)) for s in sigmas])  # noqa: E731
    n, m = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    yy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(n) for j in range(m)) / (n * m)
    return xx + yy - 2 * xy


def test_matches_direct_double_sum():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(9, 3, generator=g, dtype=torch.float64) + 0.5
    med = float(median_distance(x, y))
    direct = direct_mmd2(x.numpy(), y.numpy(), [0.5 * med, med, 2 * med])
    assert float(mk_mmd2(x, y)) == pytest.approx(direct, abs=1e-12)
    assert float(mk_mmd2(x, y, sigmas=[1.0, 3.0])) == pytest.approx(direct_mmd2(x.numpy(), y.numpy(), [1.0, 3.0]), abs=1e-12)


def test_null_mean_is_zero_within_three_standard_errors():
    g = torch.Generator().manual_seed(1)
    vals = torch.stack([mk_mmd2(torch.randn(40, 4, generator=g), torch.randn(40, 4, generator=g)) for _ in range(150)])
    assert abs(float(vals.mean())) < 3 * float(vals.std()) / math.sqrt(len(vals))


def test_gaussian_closed_form():
    g = torch.Generator().manual_seed(2)
    sig, mu = [1.5, 3.0], torch.full((3,), 0.7)
    vals = torch.stack([mk_mmd2(torch.randn(80, 3, generator=g, dtype=torch.float64),
                                mu + 1.3 * torch.randn(80, 3, generator=g, dtype=torch.float64), sigmas=sig)
                        for _ in range(150)])
    exact = gaussian_mmd2_closed_form(torch.zeros(3), 1.0, mu, 1.3, sig)
    assert exact > 0
    assert abs(float(vals.mean()) - exact) < 3 * float(vals.std()) / math.sqrt(len(vals))
    assert gaussian_mmd2_closed_form(mu, 1.0, mu, 1.0, sig) == pytest.approx(0.0, abs=1e-15)


def test_symmetric_biased_nonnegative_and_differentiable():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(12, 2, generator=g, dtype=torch.float64) + 1
    assert float(mk_mmd2(x.detach(), y)) == pytest.approx(float(mk_mmd2(y, x.detach())), abs=1e-12)
    assert float(mk_mmd2(x.detach(), y, unbiased=False)) >= 0
    torch.autograd.gradcheck(lambda a: mk_mmd2(a, y, sigmas=[0.7, 2.0]), (x,))
    mk_mmd2(x, y).backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("x, y, kw, match", [
    (torch.zeros(5), torch.zeros(5, 2), {}, "2-d"),
    (torch.zeros(5, 3), torch.zeros(5, 2), {}, "feature width"),
    (torch.zeros(1, 2), torch.zeros(5, 2), {}, "at least 2 rows"),
    (torch.zeros(4, 2), torch.ones(4, 2), {"scales": (0.5, -1.0)}, "scales"),
    (torch.zeros(4, 2), torch.ones(4, 2), {"sigmas": [0.0]}, "sigmas"),
])
def test_argument_checks(x, y, kw, match):
    with pytest.raises(ValueError, match=match):
        mk_mmd2(x, y, **kw)
