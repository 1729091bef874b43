"""FedFTG (Zhang et al., CVPR 2022): class-level ensemble weights, label sampler, diversity loss, the plug-in's
exact reduction to its host with no distillation, and argument checks."""
import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.methods.basics.fedavg import fedavg
from fedlab_nb.methods.heterogeneity.fedftg import (FedFTGRule, class_ensemble_weights, diversity_loss, fedftg, label_histograms,
                                      sample_labels)
from fedlab_nb.methods.heterogeneity.fedprox import fedprox
from fedlab_nb.models import flatten_params, make_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=4, alpha=0.1, seed=0)


def test_ensemble_weights_sum_to_one_per_class():
    counts = torch.tensor([[5, 0, 3, 0], [1, 0, 0, 0], [0, 0, 7, 2]], dtype=torch.float64)
    alpha = class_ensemble_weights(counts)                       # [C, m]
    assert alpha.shape == (4, 3)
    assert torch.allclose(alpha.sum(1), torch.ones(4, dtype=torch.float64), atol=0, rtol=1e-15)
    assert torch.equal(alpha[0], torch.tensor([5 / 6, 1 / 6, 0], dtype=torch.float64))
    assert torch.equal(alpha[1], torch.full((3,), 1 / 3, dtype=torch.float64))   # nobody holds class 1
    assert torch.equal(alpha[3], torch.tensor([0, 0, 1], dtype=torch.float64))


def test_single_client_ensemble_is_its_softmax(fed):
    model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))
    theta = flatten_params(model)[None]
    x = torch.rand(8, 64)
    a = class_ensemble_weights(torch.tensor([[3.0, 0, 2, 1, 0, 0, 0, 0, 0, 9]])).float()[torch.arange(8) % 10]
    rule = FedFTGRule(model=model, counts=torch.ones(4, 10), input_shape=(64,))
    forward = lambda flat, x: torch.func.functional_call(model, fl.models.unflatten(flat, rule.spec), (x,))
    target = rule.ensemble_target(theta, x, a, forward)
    assert torch.equal(target, F.softmax(model(x), 1).detach())


def test_label_sampler_matches_global_counts_chi_squared():
    counts = torch.tensor([120.0, 3, 0, 57, 200, 9, 31, 1, 80, 14])
    n = 10_000
    labels = sample_labels(counts, n, torch.Generator().manual_seed(0))
    observed = torch.bincount(labels, minlength=10).double()
    expected = counts.double() / counts.sum() * n
    keep = expected > 0
    assert observed[~keep].sum() == 0
    stat, p = scipy.stats.chisquare(observed[keep].numpy(), expected[keep].numpy())
    assert p > 0.01
    assert float((observed / n - expected / n).abs().max()) <= 1 / n + 1e-12
    again = sample_labels(counts, n, torch.Generator().manual_seed(0))
    assert torch.equal(labels, again) and not torch.equal(labels, labels.sort().values)   # keyed and shuffled


def test_diversity_loss_matches_broadcast_formula():
    g = torch.Generator().manual_seed(1)
    z, x = torch.randn(16, 10, generator=g, dtype=torch.float64), torch.rand(16, 12, generator=g, dtype=torch.float64)
    naive = torch.exp(-((z[None] - z[:, None]).pow(2).mean(-1) * (x[None] - x[:, None]).abs().mean(-1)).mean())
    assert torch.allclose(diversity_loss(z, x), naive, rtol=1e-12, atol=0)


@pytest.mark.parametrize("host", ["fedavg", "fedprox"])
def test_zero_iterations_equals_host_bit_for_bit(fed, host):
    runs = []
    for method in ("host", "ftg"):
        torch.manual_seed(0)
        model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))
        m = {"fedavg": fedavg, "fedprox": fedprox}[host]() if method == "host" else \
            fedftg(host, model=model, fed=fed, iterations=0)
        runs.append(fl.simulate(m, fed, model, rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=3, progress=False))
    assert torch.equal(runs[0].theta, runs[1].theta)
    assert runs[0].test_acc.tolist() == runs[1].test_acc.tolist()


def test_distillation_runs_keyed_and_logs_fidelity(fed):
    torch.manual_seed(0)
    model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))
    out = []
    for _ in range(2):
        m = fedftg("fedavg", model=model, fed=fed, iterations=2, student_steps=2, batch_size=16, hidden=32)
        out.append(fl.simulate(m, fed, model, rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=1, progress=False))
    assert torch.equal(out[0].theta, out[1].theta)                        # server draws are keyed by the run seed
    assert out[0]["ftg_teacher_acc"].between(0, 1).all()
    host = fl.simulate(fedavg(), fed, model, rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=1, progress=False)
    assert not torch.equal(host.theta, out[0].theta)


def test_label_histograms(fed):
    counts = label_histograms(fed)
    assert counts.shape == (4, 10)
    assert counts.sum().item() == sum(len(y) for _, y in fed.client_train)


def test_bad_inputs_raise_clear_errors(fed):
    model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))
    with pytest.raises(ValueError, match="counts"):
        class_ensemble_weights(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="server optimiser"):
        fedftg(fedavg(server_lr=0.5), model=model, fed=fed)
    with pytest.raises(ValueError, match="host"):
        fedftg("scaffold", model=model, fed=fed)
    with pytest.raises(ValueError, match="label_sampling"):
        fedftg("fedavg", model=model, fed=fed, label_sampling="balanced")
    with pytest.raises(ValueError, match="iterations"):
        fedftg("fedavg", model=model, fed=fed, iterations=-1)
    with pytest.raises(ValueError, match="fed="):
        fedftg("fedavg", model=model)
    with pytest.raises(ValueError, match="class_counts"):
        sample_labels(torch.zeros(3), 10)
    with pytest.raises(ValueError, match="buffers"):
        fedftg("fedavg", model=make_model("mlp_bn", fed.input_shape, fed.num_classes), fed=fed)
