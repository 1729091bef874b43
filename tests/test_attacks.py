"""Byzantine attacks: honest rows untouched, Byzantine rows as the papers define them, error paths."""
import numpy as np
import pytest
import torch
from scipy import stats

from fedlab_nb.methods.robustness.attacks import (ATTACKS, alie, alie_z, choose_byzantine, flip_labels, gaussian_noise,
                                      get_attack, ipm, scaled, sign_flip)
from fedlab_nb.methods.robustness.rules import coordinate_median, gas, mean


def setup(n=10, d=6, f=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + 1.0
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=g)[:f]] = True
    return x, mask


HYPER = {"none": {}, "sign_flip": {"scale": 2.0}, "scaled": {"scale": 5.0}, "gaussian_noise": {"std": 3.0},
         "alie": {}, "ipm": {"epsilon": 0.5}}


@pytest.mark.parametrize("name", ATTACKS)
def test_honest_rows_are_untouched_and_input_not_modified(name):
    x, mask = setup()
    before = x.clone()
    out = get_attack(name, **HYPER[name])(x, mask, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, before)
    assert torch.equal(out[~mask], x[~mask])
    assert out.shape == x.shape and out.dtype == x.dtype
    if name != "none":
        assert not torch.equal(out[mask], x[mask])


def test_sign_flip_and_scaled():
    x, mask = setup()
    torch.testing.assert_close(sign_flip(x, mask, scale=2.0)[mask], -2.0 * x[mask])
    torch.testing.assert_close(scaled(x, mask, scale=5.0)[mask], 5.0 * x[mask])


def test_gaussian_noise_has_the_requested_std_and_is_reproducible():
    x, mask = setup(d=20000)
    a = gaussian_noise(x, mask, std=3.0, generator=torch.Generator().manual_seed(1))
    b = gaussian_noise(x, mask, std=3.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    rows = a[mask]
    assert abs(float(rows.std()) - 3.0) < 0.05 and abs(float(rows.mean())) < 0.05


def test_alie_is_honest_mean_minus_z_std():
    x, mask = setup(n=20, f=4)
    honest = x[~mask].numpy()
    expected = honest.mean(0) - 1.5 * honest.std(0, ddof=0)
    out = alie(x, mask, z=1.5)
    np.testing.assert_allclose(out[mask].numpy(), np.tile(expected, (4, 1)), atol=1e-12)


@pytest.mark.parametrize("n,f", [(20, 4), (50, 10), (50, 24), (10, 1)])
def test_alie_default_z_is_the_papers_z_max(n, f):
    s = n // 2 + 1 - f
    assert alie_z(n, f) == pytest.approx(stats.norm.ppf((n - s) / n), abs=1e-9)
    x, mask = setup(n=n, f=f)
    torch.testing.assert_close(alie(x, mask), alie(x, mask, z=alie_z(n, f)))


def test_ipm_is_minus_epsilon_honest_mean():
    x, mask = setup()
    out = ipm(x, mask, epsilon=0.5)
    torch.testing.assert_close(out[mask], (-0.5 * x[~mask].mean(0)).expand(3, -1))


def test_large_ipm_flips_the_mean_but_not_gas_median():
    x, mask = setup(n=20, f=8, d=50)
    out = ipm(x, mask, epsilon=5.0)
    honest = x[~mask].mean(0)
    assert float(mean(out) @ honest) < 0
    assert float(gas(out, base_rule=coordinate_median, p=5, f=8, generator=torch.Generator().manual_seed(0))
                 @ honest) > 0


def test_flip_labels():
    y = torch.tensor([0, 1, 2, 9, 5])
    assert flip_labels(y, 10).tolist() == [9, 8, 7, 0, 4]
    assert torch.equal(flip_labels(flip_labels(y, 10), 10), y)
    with pytest.raises(ValueError, match=r"labels in \[0, 4\]"):
        flip_labels(y, 5)
    with pytest.raises(ValueError, match="num_classes"):
        flip_labels(y, 1)


def test_choose_byzantine_counts_and_fractions():
    m = choose_byzantine(10, 3, torch.Generator().manual_seed(0))
    assert m.dtype == torch.bool and m.shape == (10,) and int(m.sum()) == 3
    assert int(choose_byzantine(10, 0.25).sum()) == 2  # floor(2.5)
    assert int(choose_byzantine(10, 0).sum()) == 0
    a = choose_byzantine(20, 5, torch.Generator().manual_seed(3))
    b = choose_byzantine(20, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize("call,match", [
    (lambda: choose_byzantine(5, 5), "0 <= f < n"),
    (lambda: choose_byzantine(5, -1), "0 <= f < n"),
    (lambda: choose_byzantine(5, 1.0), r"\[0, 1\)"),
    (lambda: choose_byzantine(0, 0), "positive int"),
    (lambda: alie(*setup()[:1], torch.ones(10, dtype=torch.bool)), "honest client"),
    (lambda: ipm(*setup()[:1], torch.ones(10, dtype=torch.bool)), "honest client"),
    (lambda: sign_flip(setup()[0], torch.ones(10)), "bool mask"),
    (lambda: sign_flip(setup()[0], torch.ones(3, dtype=torch.bool)), "bool mask"),
    (lambda: gaussian_noise(*setup(), std=-1), "std >= 0"),
    (lambda: alie_z(10, 6), "pass z explicitly"),
    (lambda: get_attack("alei"), "alie"),
    (lambda: get_attack("ipm", scale=2), "no hyperparameter"),
])
def test_error_paths(call, match):
    with pytest.raises(ValueError, match=match):
        call()
