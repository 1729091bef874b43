"""FAL (fedlab_nb.methods.more.fal): eps = 0 is FedAvg bit for bit, eps > 0 trains on PGD examples, keyed and
repeatable, registered, and bad arguments are named."""
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.registry import lookup
from fedlab_nb.core.streams import STREAMS
from fedlab_nb.methods.more.fal import fal
from fedlab_nb.methods.basics.fedavg import fedavg
from fedlab_nb.models import make_model

torch.set_num_threads(1)
KW = dict(rounds=2, clients_per_round=4, local_epochs=1, batch_size=32, lr=0.1, seed=0, progress=False, backend="loop")


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=4, alpha=0.3, seed=0)


def _run(method, fed, **kw):
    torch.manual_seed(0)
    model = make_model("mlp", fed.input_shape, 10)
    return fl.simulate(method, fed, model, **{**KW, **kw})


def test_eps_zero_is_fedavg_bit_for_bit(fed):
    a, b = _run(fal(eps=0.0), fed), _run(fedavg(), fed)
    assert torch.equal(a.theta, b.theta)
    assert a.test_acc.tolist() == b.test_acc.tolist()


def test_adversarial_training_changes_the_model_and_repeats(fed):
    a, b, c = _run(fal(eps=0.1), fed), _run(fal(eps=0.1), fed), _run(fedavg(), fed)
    assert torch.equal(a.theta, b.theta)
    assert not torch.equal(a.theta, c.theta)


def test_registered_with_stream():
    assert STREAMS["fal_pgd"] == 75
    entry = lookup("fal")
    assert (entry.claims, entry.notebook, entry.kind) == ("fal", "fal", "module")
    assert entry.factory(eps=0.05).client.alpha == pytest.approx(0.0125)


@pytest.mark.parametrize("kw, word", [({"eps": -1.0}, "eps"), ({"alpha": -0.1}, "alpha"), ({"steps": -2}, "steps"),
                                      ({"norm": "l0"}, "norm")])
def test_bad_arguments_name_the_parameter(kw, word):
    with pytest.raises(ValueError, match=word):
        fal(**kw)
