"""FedLabel (fedlab_nb.methods.labels.fedlabel): selection rule, exact FedAvg reduction, loop = vmap, what is uploaded."""
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.registry import REGISTRY
from fedlab_nb.data.semisup import semi_supervised
from fedlab_nb.methods.basics.fedavg import fedavg
from fedlab_nb.methods.labels.fedlabel import _pair_loss, fedlabel, pseudo_label_accuracy, select_pseudo_labels
from fedlab_nb.models import flatten_params, make_model, param_spec
from fedlab_nb.engine.client import make_loss

RUN = dict(rounds=2, local_steps=3, batch_size=8, lr=0.2, seed=0, progress=False, eval_every=2,
           model_kwargs={"hidden": (16,)})


@pytest.fixture(scope="module")
def semi():
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.3, seed=0)
    return semi_supervised(fed, 0.2, seed=0)


def test_selection_rule_by_hand():
    p_l = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5], [0.97, 0.03]])
    p_g = torch.tensor([[0.2, 0.8], [0.1, 0.9], [0.5, 0.5], [0.99, 0.01]])
    labels, accepted, local, agree = select_pseudo_labels(p_l, p_g, tau=0.95)
    assert local.tolist() == [True, False, False, False]  # ties go to the global model
    assert labels.tolist() == [0, 1, 0, 0]
    assert accepted.tolist() == [False, False, False, True]
    assert agree.tolist() == [False, True, True, True]
    assert select_pseudo_labels(p_l, p_g, 0.5, "local")[0].tolist() == [0, 1, 0, 0]
    assert select_pseudo_labels(p_l, p_g, 0.5, "global")[2].tolist() == [False] * 4


def test_consistency_term_is_the_kl_on_agreeing_rows():
    torch.manual_seed(0)
    model = make_model("mlp", (1, 8, 8), 10, hidden=(8,))
    w, spec = flatten_params(model), param_spec(model)
    loss = _pair_loss(model, spec, make_loss(model), lam_u=0.0, lam_c=2.0)
    x_l, y_l, x_u = torch.rand(4, 64), torch.randint(0, 10, (4,)), torch.rand(6, 64)
    p = torch.softmax(torch.randn(6, 10), -1)
    agree = torch.tensor([True, False, True, True, False, False])
    got = loss(w, x_l, y_l, None, x_u, x_u, torch.ones(6), torch.zeros(6, dtype=torch.long), agree, agree, p)
    q = torch.log_softmax(model(x_u), -1)
    kl = torch.nn.functional.kl_div(q, p, reduction="none").sum(-1)  # torch's KL(p || q)
    expected = torch.nn.functional.cross_entropy(model(x_l), y_l) + 2.0 * kl[agree].sum() / 6
    assert torch.allclose(got, expected, atol=1e-6)


def test_no_accepted_label_and_no_consistency_is_fedavg_bit_for_bit(semi):
    a = fl.simulate(fedavg(), semi, "mlp", backend="loop", **RUN)
    b = fl.simulate(fedlabel(tau=1.5, consistency=0.0), semi, "mlp", backend="loop", **RUN)
    assert torch.equal(a.theta, b.theta)
    assert (a.bytes_up == b.bytes_up).all()  # only the global model goes up
    c = fl.simulate(fedlabel(tau=0.01, consistency=1.0), semi, "mlp", backend="loop", **RUN)
    assert not torch.equal(a.theta, c.theta)


def test_vectorised_clients_match_the_loop(semi):
    probe_loop, probe_vmap = {}, {}
    a = fl.simulate(fedlabel(tau=0.5, probe=probe_loop), semi, "mlp", backend="loop", **RUN)
    b = fl.simulate(fedlabel(tau=0.5, probe=probe_vmap), semi, "mlp", backend="vmap", **RUN)
    assert torch.allclose(a.theta, b.theta, atol=1e-5)
    assert all(torch.allclose(probe_loop[k], probe_vmap[k], atol=1e-5) for k in probe_loop)
    assert sorted(probe_loop) == list(range(semi.num_clients))
    assert "personal_acc_mean" in a.columns  # the local models are scored as personal models


def test_pseudo_label_accuracy_same_models(semi):
    torch.manual_seed(0)
    model = make_model("mlp", semi.input_shape, 10, hidden=(8,))
    theta = flatten_params(model)
    x_u, y_u = semi.client_unlabelled[0]
    d = pseudo_label_accuracy(model, theta, theta, x_u, y_u, tau=0.0)
    assert d["local"] == d["global"] == d["selected"] and d["routed_local"] == 0.0 and d["accepted"] == 1.0


def test_errors_and_registry(semi):
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.3, seed=0)
    with pytest.raises(ValueError, match="semi_supervised"):
        fl.simulate(fedlabel(), fed, "mlp", **RUN)
    for kwargs, word in (({"tau": 0}, "tau"), ({"consistency": -1}, "consistency"), ({"unsup_weight": "1"}, "unsup_weight"),
                         ({"mu": 0}, "mu"), ({"selection": "oracle"}, "selection")):
        with pytest.raises(ValueError, match=word):
            fedlabel(**kwargs)
    entry = REGISTRY["fedlabel"]
    assert entry.claims == "fedlabel" and entry.notebook == "fedlabel"
