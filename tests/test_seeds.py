"""Seeds as a batch dimension (engine/seeds.py): S runs trained together equal S separate runs."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.engine.seeds import seed_batchable, simulate_seeds

COLUMNS = ["train_loss", "test_loss", "test_acc", "client_acc_mean"]


def _same(a, b):
    for col in COLUMNS:
        np.testing.assert_allclose(a[col].to_numpy(), b[col].to_numpy(), atol=1e-4, rtol=0, err_msg=col)
    torch.testing.assert_close(a.theta, b.theta, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method,backend", [("fedavg", "vmap"), ("fedavgm", "fused"), ("fedadam", "loop")])
def test_seed_batched_runs_equal_separate_runs(method, backend):
    fed = lambda s: fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=s)  # the partition follows the seed
    kw = dict(rounds=3, clients_per_round=4, lr=0.1, local_epochs=1, batch_size=16, model_kwargs={"hidden": (16,)},
              backend=backend)
    m = fl.get_method(method)
    together = simulate_seeds(m, fed, "mlp", seeds=[0, 3, 7], **kw)
    for s, h in zip([0, 3, 7], together):
        _same(h, fl.simulate(m, fed(s), "mlp", seed=s, progress=False, **kw))
    assert not torch.equal(together[0].theta, together[1].theta)


def test_seed_batched_refuses_methods_it_cannot_batch():
    assert seed_batchable(fl.get_method("fedprox", mu=0.1)) is not None
    assert seed_batchable(fl.get_method("scaffold")) is not None
    assert seed_batchable(fl.get_method("fedavg")) is None
    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    with pytest.raises(ValueError, match="run simulate once per seed"):
        simulate_seeds(fl.get_method("fedprox", mu=0.1), fed, seeds=[0, 1], rounds=1)
    with pytest.raises(ValueError, match="distinct"):
        simulate_seeds(fl.get_method("fedavg"), fed, seeds=[1, 1], rounds=1)
