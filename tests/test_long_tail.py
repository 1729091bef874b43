"""The long-tailed Dirichlet partition: exact geometric class profile, balance at ρ = 1, clear errors, each kept
sample used once."""
import numpy as np
import pytest

import fedlab_nb as fl
from fedlab_nb.data import long_tail, make_partition

LABELS = np.repeat(np.arange(10), 400)  # 4,000 samples, 10 balanced classes of 400


def _class_counts(parts, labels=LABELS):
    return np.bincount(labels[np.concatenate(list(parts))], minlength=10)


@pytest.mark.parametrize("rho", [10, 100, 37.5])
def test_counts_follow_the_geometric_profile(rho):
    counts = _class_counts(long_tail(LABELS, 20, imbalance_ratio=rho, alpha=0.5, seed=1))
    expected = 400 * rho ** (-np.arange(10) / 9)
    assert np.all(np.abs(counts - expected) < 1)          # floor of the profile: within one sample
    assert counts[0] == 400 and counts[-1] == int(400 / rho + 1e-9)
    assert np.all(np.diff(counts) <= 0)


def test_rho_one_keeps_balance():
    assert _class_counts(long_tail(LABELS, 10, imbalance_ratio=1, alpha=0.5)).tolist() == [400] * 10


def test_every_kept_sample_used_once_and_seeded():
    a = long_tail(LABELS, 20, imbalance_ratio=50, alpha=0.3, seed=4)
    b = long_tail(LABELS, 20, imbalance_ratio=50, alpha=0.3, seed=4)
    rows = np.concatenate(list(a))
    assert len(rows) == len(np.unique(rows)) == _class_counts(a).sum()
    assert all((x == y).all() for x, y in zip(a, b))
    assert min(a.sizes) >= 10                              # Dirichlet's min_size holds on the subsample


def test_n_max_defaults_to_the_smallest_class():
    labels = np.concatenate([np.repeat(np.arange(10), 300), np.zeros(50, int)])   # class 0 has 350
    counts = _class_counts(long_tail(labels, 10, imbalance_ratio=10, alpha=1.0), labels)
    assert counts[0] == 300 and counts[-1] == 30


def test_registered_and_federate():
    assert "long_tail" in fl.data.PARTITIONERS
    fed = fl.federate("digits", "long_tail", n_clients=5, imbalance_ratio=10, alpha=1.0, seed=0)
    assert fed.label_histogram().sum() + sum(len(t) for t in fed.test_idx) < len(fed.dataset.y_train)
    assert make_partition("long_tail", LABELS, 5, imbalance_ratio=2).name == "long_tail(2, 0.5)"


@pytest.mark.parametrize("kw,match", [({"imbalance_ratio": 0.5}, "imbalance_ratio"),
                                      ({"imbalance_ratio": float("nan")}, "imbalance_ratio"),
                                      ({"imbalance_ratio": "10"}, "imbalance_ratio"),
                                      ({"imbalance_ratio": 1000}, "imbalance_ratio <= 400"),
                                      ({"alpha": 0}, "alpha"), ({"alpha": -1}, "alpha"),
                                      ({"n_max": 500}, "n_max <= 400")])
def test_bad_parameters_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        long_tail(LABELS, 10, **kw)


def test_one_class_is_refused():
    with pytest.raises(ValueError, match="at least 2 classes"):
        long_tail(np.zeros(100, int), 2)
