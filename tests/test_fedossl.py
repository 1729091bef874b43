"""FedoSSL (fedlab_nb/methods/labels/fedossl.py): Hungarian matching, suppression weights and loss, the open-world
split, the server's seen-class alignment, and a tiny federated run."""
import itertools

import numpy as np
import pytest
import torch

from fedlab_nb.core.registry import REGISTRY
from fedlab_nb.methods.labels import fedossl as fo


def brute_force_accuracy(y_pred, y_true, D):
    return max(np.mean(np.array(p)[y_pred] == y_true) for p in itertools.permutations(range(D)))


def test_hungarian_against_brute_force_and_hand_cases():
    g = np.random.default_rng(0)
    for _ in range(50):
        yt, yp = g.integers(0, 4, 25), g.integers(0, 4, 25)
        assert fo.cluster_accuracy(yp, yt) == pytest.approx(brute_force_accuracy(yp, yt, 4), abs=1e-12)
    y = np.repeat(np.arange(3), 4)
    assert fo.cluster_accuracy(np.array([2, 0, 1])[y], y) == 1.0
    assert fo.cluster_accuracy(np.array([0, 0, 0, 0, 1, 1]), np.array([0, 0, 1, 1, 2, 2])) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="same length"):
        fo.cluster_accuracy(np.array([0, 1]), np.array([0]))


def test_per_class_accuracy_seen_plain_unseen_matched():
    y_true = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    y_pred = np.array([0, 1, 1, 1, 3, 3, 2, 2])  # unseen 2, 3 swapped: matched accuracy 1
    acc = fo.per_class_matched_accuracy(y_pred, y_true, num_seen=2, num_classes=4)
    np.testing.assert_allclose(acc, [0.5, 1.0, 1.0, 1.0])


def test_suppression_weights():
    p = fo.suppression_weights([10, 5, 0, 10], beta=0.2)
    np.testing.assert_allclose(p, [1.0, 0.2 ** 0.5, 0.2, 1.0])
    np.testing.assert_allclose(fo.suppression_weights(np.zeros(4)), 0.2)  # first round: beta everywhere
    with pytest.raises(ValueError, match="beta"):
        fo.suppression_weights([1, 2], beta=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        fo.suppression_weights([1, -2])


def test_suppressed_loss_is_weighted_top_uncertainty():
    q = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], requires_grad=True)
    w = torch.tensor([1.0, 0.5, 0.2])
    loss = fo.suppressed_loss(q, w)
    expected = (1.0 * 0.3 / 3 + 0.2 * 0.4 / 3) / 2  # p_top (1 - max q) / C, averaged
    assert float(loss.detach()) == pytest.approx(expected)
    loss.backward()  # the gradient only touches the top entries
    assert q.grad[0, 1] == 0 and q.grad[0, 0] < 0


def test_open_world_split_follows_the_layout():
    y = torch.arange(10).repeat_interleave(20)
    x = torch.randn(200, 3)
    clients = fo.open_world_split(x, y, labeled_ratio=0.5, seed=1)
    assert len(clients) == 5
    for k, c in enumerate(clients):
        held = set(torch.cat([c.y_lab, c.y_unl]).tolist())
        assert held == set(fo.REPO_LAYOUT[k])
        assert set(c.y_lab.tolist()) <= set(range(6))  # only seen classes are labelled
    nine = [sum(int((c.y_unl == 9).sum()) for c in clients[:4]), int((clients[4].y_unl == 9).sum())]
    assert nine == [0, 20]  # the globally unseen class lives at one client, all unlabelled
    total = sum(len(c.y_lab) + len(c.y_unl) for c in clients)
    assert total == 200 and sum(len(c.y_lab) for c in clients) == 60  # half of the 120 seen rows
    with pytest.raises(ValueError, match="labeled_ratio"):
        fo.open_world_split(x, y, labeled_ratio=1.0)


def test_role_relabelling_is_a_bijection():
    perm = fo.role_permutation(10, 3)
    y = torch.arange(10)
    roles = fo.relabel_by_role(y, perm)
    assert sorted(roles.tolist()) == list(range(10))
    assert all(int(roles[perm[j]]) == j for j in range(10))


def test_align_seen_puts_nearest_centroid_at_each_seen_index():
    cent = torch.eye(4)
    means = torch.tensor([[0.0, 0.0, 1.0, 0.1], [0.9, 0.1, 0.0, 0.0]])
    out = fo.align_seen(cent, means)
    assert torch.equal(out[0], cent[2]) and torch.equal(out[1], cent[0])
    assert {tuple(r.tolist()) for r in out[2:]} == {tuple(cent[1].tolist()), tuple(cent[3].tolist())}


def test_sinkhorn_balances_columns():
    scores = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    P = fo.sinkhorn(scores, iters=200)
    np.testing.assert_allclose(P.sum(1).numpy(), 1.0, atol=1e-3)            # rows: one unit each
    np.testing.assert_allclose(P.sum(0).numpy(), 40 / 4, rtol=2e-2)         # balanced columns


def test_param_sgd_matches_torch_sgd():
    w1 = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)))
    w2 = torch.nn.Parameter(w1.detach().clone())
    mine, ref = fo.ParamSGD([w1], lr=0.1, momentum=0.9, weight_decay=5e-4), torch.optim.SGD([w2], lr=0.1, momentum=0.9, weight_decay=5e-4)
    for t in range(4):
        for w, opt in ((w1, mine), (w2, ref)):
            opt.zero_grad()
            ((w - t) ** 2).sum().backward()
            opt.step()
    torch.testing.assert_close(w1.detach(), w2.detach())


def test_tiny_run_and_variants_and_registry():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(10).repeat_interleave(30)
    x = torch.randn(10, 8, generator=g)[y] + 0.3 * torch.randn(300, 8, generator=g)
    clients = fo.open_world_split(x, y, seed=0)
    cfg = fo.fedossl("fedossl", batch_size=16, global_steps=3, cluster_after=0, pseudo_after=0)
    out = fo.run_fedossl(clients, x, y, cfg, rounds=2, seed=0, hidden=(16, 8))
    assert 0 <= out["seen_acc"] <= 1 and out["per_class"].shape == (10,)
    again = fo.run_fedossl(clients, x, y, cfg, rounds=2, seed=0, hidden=(16, 8))
    assert out["seen_acc"] == again["seen_acc"]  # keyed randomness: repeatable
    assert not fo.fedossl("baseline").suppress and not fo.fedossl("baseline").calibrate
    with pytest.raises(ValueError, match="variant"):
        fo.fedossl("orca")
    with pytest.raises(ValueError, match="unknown FedoSSL option"):
        fo.fedossl(lrr=0.1)
    e = REGISTRY["fedossl"]
    assert (e.claims, e.notebook) == ("fedossl", "fedossl")
