"""Gossip (fedlab_nb/gossip.py): graphs, mixing matrices, the spectral gap and consensus."""
import numpy as np
import pytest
import torch

from fedlab_nb import gossip as G


@pytest.mark.parametrize("adj", [G.ring(8), G.torus(3, 4), G.random_graph(12, 0.3, seed=1)])
def test_metropolis_weights_are_doubly_stochastic_and_local(adj):
    w = G.metropolis_weights(adj)
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.all(w >= 0)
    assert np.all(w[~adj & ~np.eye(len(adj), dtype=bool)] == 0)  # only neighbours talk
    assert 0 < G.spectral_gap(w) < 1


def test_ring_spectral_gap_matches_its_closed_form():
    # uniform weights 1/3 on a ring: eigenvalues (1 + 2cos(2πk/m))/3, so ρ = (1 + 2cos(2π/m))/3 for m ≥ 5
    m = 8
    w = G.uniform_weights(G.ring(m))
    assert G.spectral_gap(w) == pytest.approx(1 - (1 + 2 * np.cos(2 * np.pi / m)) / 3, abs=1e-12)


def test_gossip_keeps_the_average_and_contracts_disagreement_by_rho():
    w = G.metropolis_weights(G.ring(6))
    rho = 1 - G.spectral_gap(w)
    x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = G.mix(torch.from_numpy(w), x)
    assert torch.allclose(y.mean(0), x.mean(0), atol=1e-14)
    assert G.consensus_error(y) <= rho ** 2 * G.consensus_error(x) + 1e-14
    for _ in range(200):
        y = G.mix(torch.from_numpy(w), y)
    assert G.consensus_error(y) < 1e-12


def test_graphs_and_counts():
    assert G.ring(5).sum() == 10 and G.torus(3, 3).sum(1).tolist() == [4] * 9
    assert G.communication_floats(G.ring(5), d=7) == 70
    assert G.is_connected(G.ring(4)) and not G.is_connected(np.zeros((3, 3), dtype=bool))


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="doubly stochastic"):
        G.check_mixing(np.array([[0.9, 0.1], [0.9, 0.1]]))
    with pytest.raises(ValueError, match="metropolis_weights"):
        G.uniform_weights(np.array([[0, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=bool))
    with pytest.raises(ValueError, match="symmetric"):
        G.metropolis_weights(np.array([[0, 1], [0, 0]], dtype=bool))
    with pytest.raises(ValueError, match="edge probability"):
        G.random_graph(5, 0)
    with pytest.raises(ValueError, match="nodes"):
        G.mix(torch.eye(3), torch.zeros(4, 2))
