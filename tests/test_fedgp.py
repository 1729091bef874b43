"""FedGP (Jiang, Zhang, Koyejo, ICLR 2024): the positive projection, the target-centred rule, the auto-weights."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.data.partition import FeatureTransform, Partition
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.basics.fedavg import fedavg
from fedlab_nb.methods.weights.fedgp import (GradientProjectionRule, auto_betas, batch_gradient_probe, cosine_scaled, fedgp,
                                     positive_projection)

torch.set_num_threads(1)


def _info(ids, steps=None, lr=0.1, theta=None):
    m = len(ids)
    return RoundInfo(round=0, client_ids=np.asarray(ids), sizes=torch.ones(m), num_clients=max(ids) + 1, lr=lr,
                     steps=torch.ones(m) if steps is None else torch.as_tensor(steps, dtype=torch.float32), theta=theta)


def test_positive_projection_hand_case():
    g_t = torch.tensor([2.0, 0.0])
    g = torch.tensor([[3.0, 4.0], [-1.0, 5.0], [0.0, 1.0]])
    # <g, g_t>/|g_t|^2 = 6/4, -2/4 -> 0 (negative alignment), 0/4
    assert torch.equal(positive_projection(g, g_t), torch.tensor([[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(positive_projection(torch.tensor([-1.0, 5.0]), g_t), torch.zeros(2))
    assert torch.equal(positive_projection(g, torch.zeros(2)), torch.zeros(3, 2))
    # the official code's variant: cos · g_k where aligned (cos = 3/5 for the first row)
    assert torch.allclose(cosine_scaled(g, g_t), torch.tensor([[1.8, 2.4], [0.0, 0.0], [0.0, 0.0]]))


def test_rule_mixes_target_and_projected_sources():
    rule = GradientProjectionRule(target=1, beta=0.25)
    state = rule.init_state(torch.zeros(2), 3)
    updates = torch.tensor([[3.0, 4.0], [2.0, 0.0], [-1.0, 5.0]])  # client 0, target 1, client 2
    out, state = rule.aggregate(state, updates, torch.tensor([1.0, 1.0, 3.0]), _info([0, 1, 2]))
    # w = (1/4, 3/4) over the sources; (1 − β) g_T + β Σ w_k Proj₊ = 0.75·[2,0] + 0.25·(0.25·[3,0] + 0.75·0)
    assert torch.allclose(out, torch.tensor([1.5 + 0.1875, 0.0]))
    assert np.isnan(float(state["beta"][1])) and float(state["beta"][0]) == 0.25
    assert torch.isclose(state["cos"][2].float(), torch.tensor(-1 / 26 ** 0.5))


def test_per_layer_projects_each_tensor():
    rule = GradientProjectionRule(target=0, beta=1.0, per_layer=True, spec=(("a", (1,)), ("b", (1,))))
    out, _ = rule.aggregate(rule.init_state(torch.zeros(2), 2), torch.tensor([[1.0, 1.0], [2.0, -3.0]]), None,
                            _info([0, 1]))
    # layer a: aligned, projection 2·1 = [2]; layer b: opposite, 0 (whole-model: <g, g_T> < 0 gives [0, 0])
    assert torch.allclose(out, torch.tensor([2.0, 0.0]))


def test_beta_zero_equals_target_only_training():
    ds = fl.load_dataset("digits")
    parts = Partition([np.arange(60), np.arange(60, 400), np.arange(400, 740)],
                      transforms=[FeatureTransform("rotation", a, k) for k, a in enumerate([0.0, 30.0, 30.0])])
    fed = FederatedDataset(ds, parts, seed=0)
    kw = dict(model="logreg", rounds=3, local_steps=4, batch_size=16, lr=0.1, seed=0, progress=False)
    h_gp = fl.simulate(fedgp(target=0, beta=0.0), fed, clients_per_round=3, **kw)
    target_only = FederatedDataset(ds, Partition([np.arange(60)], transforms=parts.transforms[:1]), seed=0)
    h_t = fl.simulate(fedavg(), target_only, clients_per_round=1, **kw)
    assert np.array_equal(h_gp.test_acc.to_numpy(), h_t.test_acc.to_numpy())


def test_auto_betas_hand_case():
    G = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # N = 2 target batches, d = 2, mean [2, 0]
    S = torch.tensor([[0.0, 2.0], [2.0, 0.0]])
    # sample var = (1 + 1)/(1·2) = 1, σ² = 1/2
    # FedDA: mean_b |g_b − s|²/d − 1: source 0: (1+4 + 9+4)/(2·2) − 1 = 3.5; source 1: (1 + 1)/4 − 1 → 0
    assert torch.allclose(auto_betas(G, S, "fedda"), torch.tensor([0.5 / 4.0, 1.0], dtype=torch.float64))
    # FedGP, source 0 ⟂ G: perp = G, s_⊥ = 1, p = (1 + 9)/2/2 − 1 = 1.5; q = 0 -> δ = 1 − 1/2 = 0.5;
    #   |ĝ|²/d = 2 -> β = 0.5 / (0.5 + 0.75 + 1) = 2/9.   source 1 ∥ G: p = 0, q = 1, δ = 1 -> β = 1.
    assert torch.allclose(auto_betas(G, S, "fedgp"), torch.tensor([2 / 9, 1.0], dtype=torch.float64))


def test_probe_returns_batch_gradients():
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.tensor([0, 1] * 4)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    G = batch_gradient_probe(model, x, y, batch_size=4)(theta)
    loss = torch.nn.functional.cross_entropy(model(x[:4]), y[:4])
    ref = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    assert G.shape == (2, 8) and torch.allclose(G[0], ref, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="beta"):
        fedgp(target=0, beta=1.5)
    with pytest.raises(ValueError, match="target"):
        fedgp(target=-1)
    with pytest.raises(ValueError, match="probe"):
        fedgp(target=0, auto=True)
    with pytest.raises(ValueError, match="projection"):
        fedgp(target=0, projection="orthogonal")
    with pytest.raises(ValueError, match="spec"):
        fedgp(target=0, per_layer=True)
    with pytest.raises(ValueError, match="N >= 2"):
        auto_betas(torch.zeros(1, 3), torch.zeros(2, 3))
    rule = GradientProjectionRule(target=2)
    with pytest.raises(ValueError, match="every round"):
        rule.aggregate(rule.init_state(torch.zeros(2), 3), torch.zeros(2, 2), None, _info([0, 1]))
    with pytest.raises(ValueError, match="federation has 2"):
        GradientProjectionRule(target=5).init_state(torch.zeros(2), 2)
