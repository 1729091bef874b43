"""GGEUR (fedlab_nb/methods/personalisation/ggeur.py): the pooled covariance is the union's covariance exactly, generated
embeddings have the global class covariance, the fill-up and the prototype mode behave as the official code,
bad input errors."""
import math

import pytest
import torch

from fedlab_nb.methods.personalisation.ggeur import (augment_client, class_statistics, centralised_statistics, generate,
                                     geometric_shape, ggeur, other_prototypes, pool_statistics)

D, C = 6, 3


def _clients(seed=0, k=4):
    """k clients with skewed class counts (one lacks class 2) and shifted means (domain-like)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(k):
        y = torch.cat([torch.full((n,), c) for c, n in enumerate([5 + 7 * j, 11, 0 if j == 1 else 3 + j])])
        x = torch.randn(len(y), D, generator=g, dtype=torch.float64) * (1 + j) + 2.0 * j + y[:, None]
        out.append((x, y))
    return out


def test_pooled_statistics_equal_the_centralised_ones_exactly():
    clients = _clients()
    pooled = pool_statistics([class_statistics(x, y, C) for x, y in clients])
    x_all, y_all = torch.cat([x for x, _ in clients]), torch.cat([y for _, y in clients])
    ref = centralised_statistics(x_all, y_all, C)
    assert torch.equal(pooled.counts, ref.counts)
    assert (pooled.means - ref.means).abs().max() < 1e-12
    assert (pooled.covs - ref.covs).abs().max() < 1e-10
    # against numpy's biased covariance of class 0 (a second implementation)
    import numpy as np
    x0 = x_all[y_all == 0].numpy()
    assert np.abs(pooled.covs[0].numpy() - np.cov(x0, rowvar=False, bias=True)).max() < 1e-10


def test_pooled_covariance_is_not_the_average_of_local_ones():
    """The between-client term matters: averaging local covariances misses the spread of the means."""
    stats = [class_statistics(x, y, C) for x, y in _clients()]
    pooled = pool_statistics(stats)
    n = torch.stack([s.counts for s in stats])[:, 0]
    naive = sum(w * s.covs[0] for w, s in zip(n / n.sum(), stats))
    assert (pooled.covs[0] - naive).abs().max() > 0.5


def test_generated_offsets_have_the_target_covariance():
    """Monte Carlo: the sample covariance of x' − a matches Σ within 5 standard errors per entry,
    se_ij = sqrt((Σ_ii Σ_jj + Σ_ij²) / n) for Gaussian offsets."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(D, D, generator=g, dtype=torch.float64)
    cov = a @ a.T / D + 0.1 * torch.eye(D, dtype=torch.float64)
    vals, vecs = geometric_shape(cov)
    n = 20_000
    anchors = torch.randn(1, D, generator=g, dtype=torch.float64).expand(n, D)
    off = generate(anchors, vals, vecs, g) - anchors
    sample = off.T @ off / n                                        # the mean offset is 0 by construction
    se = ((cov.diag()[:, None] * cov.diag()[None, :] + cov ** 2) / n).sqrt()
    assert ((sample - cov).abs() / se).max() < 5
    assert off.mean(0).abs().max() < 5 * math.sqrt(float(cov.diag().max()) / n)


def test_geometric_shape_clamps_and_amplifies():
    cov = torch.diag(torch.tensor([4.0, 1.0, -1e-9], dtype=torch.float64))
    vals, vecs = geometric_shape(cov)
    assert torch.allclose(vals, torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(vecs @ torch.diag(vals) @ vecs.T, cov.clamp(min=0), atol=1e-12)
    amp, _ = geometric_shape(cov, amplify_top=2, amplify_max=5.0)
    assert torch.allclose(amp, torch.tensor([20.0, 1.0, 0.0], dtype=torch.float64))


def test_fill_up_keeps_originals_and_skips_absent_classes():
    clients = _clients()
    aug, pooled = ggeur(clients, C, target_per_class=40, seed=3)
    for (x, y), (xa, ya) in zip(clients, aug):
        assert torch.equal(xa[:len(x)], x) and torch.equal(ya[:len(y)], y)       # originals first, unchanged
        counts = torch.bincount(ya, minlength=C)
        for c in range(C):
            have = int((y == c).sum())
            assert int(counts[c]) == (0 if have == 0 else max(have, 40))
    again, _ = ggeur(clients, C, target_per_class=40, seed=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(aug, again))             # seeded
    other, _ = ggeur(clients, C, target_per_class=40, seed=4)
    assert not torch.equal(aug[0][0], other[0][0])


def test_prototype_mode_generates_around_other_clients_means():
    """With a zero covariance, every generated embedding is an anchor: an own sample or another client's prototype."""
    clients = _clients()
    stats = [class_statistics(x, y, C) for x, y in clients]
    zero = [(torch.zeros(D, dtype=torch.float64), torch.eye(D, dtype=torch.float64))] * C
    protos = other_prototypes(stats, 0)
    assert protos[2].shape == (2, D)                                            # client 1 lacks class 2
    x, y = clients[0]
    xa, ya = augment_client(x, y, zero, 400, torch.Generator().manual_seed(0), protos)
    new = xa[len(x):][ya[len(y):] == 0]
    is_proto = (new[:, None, :] == protos[0][None]).all(-1).any(1)
    is_own = (new[:, None, :] == x[y == 0][None]).all(-1).any(1)
    assert bool((is_proto | is_own).all())
    assert 0.6 < float(is_proto.float().mean()) < 0.9                            # 3 of 4 equal shares


def test_bad_input_errors():
    x, y = _clients()[0]
    with pytest.raises(ValueError, match="2-D"):
        class_statistics(x[0], y, C)
    with pytest.raises(ValueError, match="one label per row"):
        class_statistics(x, y[:-1], C)
    with pytest.raises(ValueError, match="num_classes"):
        class_statistics(x, y, 2)
    with pytest.raises(ValueError, match="at least one client"):
        pool_statistics([])
    with pytest.raises(ValueError, match="same backbone"):
        pool_statistics([class_statistics(x, y, C), class_statistics(x[:, :3], y, C)])
    with pytest.raises(ValueError, match="symmetric"):
        geometric_shape(torch.triu(torch.ones(3, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="amplify_top"):
        geometric_shape(torch.eye(3, dtype=torch.float64), amplify_top=5)
    with pytest.raises(ValueError, match="eigvals must be >= 0"):
        generate(torch.zeros(2, 3), -torch.ones(3), torch.eye(3), torch.Generator())
    with pytest.raises(ValueError, match="target_per_class"):
        ggeur([(x, y)], C, target_per_class=0)
    with pytest.raises(ValueError, match="at least one client"):
        ggeur([], C)
