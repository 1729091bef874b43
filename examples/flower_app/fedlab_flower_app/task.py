"""What both apps share: the federation and the run, read from the run config (pyproject.toml)."""
from functools import lru_cache

import fedlab_nb as fl
from fedlab_nb.flower import to_flower


def apps(run_config):
    """(ServerApp, ClientApp) for this run config; built once per process."""
    return _apps(tuple(sorted(run_config.items())))


@lru_cache(maxsize=4)
def _apps(items):
    c = dict(items)
    fed = fl.federate(str(c["dataset"]), "dirichlet", n_clients=int(c["num-clients"]), alpha=float(c["alpha"]),
                      seed=int(c["seed"]), min_size=20)
    return to_flower(str(c["method"]), fed, str(c["model"]), rounds=int(c["num-server-rounds"]),
                     clients_per_round=int(c["clients-per-round"]), local_epochs=int(c["local-epochs"]),
                     batch_size=int(c["batch-size"]), lr=float(c["lr"]), seed=int(c["seed"]))
