"""FedKA (fedlab_nb.methods.labels.fedka): the vote, the ramp, Group Effect, the ablation that is FedAvg, the
official code's restart of the clients from the plain average, and argument checks."""
import math

import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import Method, UniformWeighting
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.methods.labels.fedka import adoption_rate, federated_vote, fedka, group_effect, vote_quality
from fedlab_nb.models import make_model


def test_adoption_rate():
    assert adoption_rate(0.0) == 0.0
    assert adoption_rate(1.0) == pytest.approx(2 / (1 + math.exp(-5)) - 1)
    with pytest.raises(ValueError, match="progress"):
        adoption_rate(1.5)


def test_vote_unanimity_ties_and_threshold():
    pred = torch.tensor([[0, 1, 2, 3]]).repeat(4, 1)
    labels, keep, agree = federated_vote(pred, 5, threshold=1.0)
    assert torch.equal(labels, pred[0]) and keep.all() and (agree == 1).all()
    pred = torch.tensor([[3, 1, 2], [2, 1, 2], [3, 0, 4], [2, 0, 4]])   # columns: tie 3/2, tie 1/0, tie 2/4
    labels, keep, agree = federated_vote(pred, 5, threshold=0.75)
    assert labels.tolist() == [2, 0, 2] and not keep.any() and (agree == 0.5).all()


def test_coverage_nested_in_threshold():
    g = torch.Generator().manual_seed(0)
    pred, y = torch.randint(0, 3, (5, 200), generator=g), torch.randint(0, 3, (200,), generator=g)
    cov = [vote_quality(*federated_vote(pred, 3, t)[:2], y)[1] for t in (0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    assert cov == sorted(cov, reverse=True) and cov[0] == 1.0


def test_group_effect_and_vote_checks():
    assert group_effect(0.6, [0.5, 0.4]) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="integer class ids"):
        federated_vote(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="threshold"):
        federated_vote(torch.zeros(2, 3, dtype=torch.long), 3, threshold=2)
    with pytest.raises(ValueError, match="lie in"):
        federated_vote(torch.full((2, 3), 3), 3)


def tiny():
    g = torch.Generator().manual_seed(0)
    clients = [(torch.rand(24, 6, generator=g) + k / 4, torch.randint(0, 3, (24,), generator=g)) for k in range(3)]
    test = (torch.rand(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g))
    return FederatedDataset.from_clients(clients, test, num_classes=3), torch.rand(40, 6, generator=g) + 0.3


def run(method, fed, model, rounds=3):
    return fl.simulate(method, fed, model, rounds=rounds, batch_size=8, lr=0.1, seed=0, progress=False, backend="loop")


def model_for(fed):
    torch.manual_seed(0)
    return make_model("mlp", fed.input_shape, 3, hidden=(8, 4))


def test_both_parts_off_is_fedavg_with_uniform_weights():
    fed, xt = tiny()
    a = run(fedka(model_for(fed), xt, 3, mmd=False, voting=False), fed, model_for(fed))
    b = run(Method("fedavg", weighting=UniformWeighting()), fed, model_for(fed))
    assert torch.allclose(a.theta, b.theta, atol=1e-6)


def test_voting_only_clients_restart_from_average_and_fedka_runs():
    fed, xt = tiny()
    avg = run(fedka(model_for(fed), xt, 3, mmd=False, voting=False, rounds=3), fed, model_for(fed))
    vot = run(fedka(model_for(fed), xt, 3, mmd=False, voting=True, rounds=3, y_target=torch.zeros(40, dtype=torch.long)),
              fed, model_for(fed))
    assert torch.equal(vot.state["rule"]["clients"], avg.state["rule"]["clients"])  # bit for bit
    assert not torch.allclose(vot.theta, avg.theta)  # the server's fine-tuned model differs
    assert {"vote_precision", "vote_coverage"} <= set(vot.columns)
    full = run(fedka(model_for(fed), xt, 3, rounds=3, n_embed=16), fed, model_for(fed))
    assert torch.isfinite(full.theta).all() and full.bytes_down.iloc[-1] > avg.bytes_down.iloc[-1]


def test_factory_checks():
    fed, xt = tiny()
    with pytest.raises(ValueError, match="x_target"):
        fedka(model_for(fed), xt[0], 3)
    with pytest.raises(ValueError, match="threshold"):
        fedka(model_for(fed), xt, 3, threshold=1.5)
    with pytest.raises(ValueError, match="rounds"):
        fedka(model_for(fed), xt, 3, rounds=0)
    with pytest.raises(ValueError, match="representation"):
        fedka(torch.nn.Linear(6, 3), xt, 3)
