"""fedlab_nb — a notebook-first federated learning package for learning, teaching and reproducing papers.

    import fedlab_nb as fl
    fed = fl.federate("mnist5k", "dirichlet", n_clients=20, alpha=0.3, seed=0)
    hist = fl.simulate("fedavg", fed, model="mlp", rounds=20, clients_per_round=10)
    print(hist.final("test_acc"))
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import data, methods, models
from .data import FederatedDataset, federate, list_datasets, load_dataset
from .engine import History, NonFiniteUpdateError, simulate
from .methods import Method, get_method
from .utils import resolve_device


def run(method: str = "fedavg", dataset: str = "mnist5k", partition: str = "dirichlet", clients: int = 20,
        rounds: int = 20, seed: int = 0, method_kwargs: dict | None = None, dataset_kwargs: dict | None = None,
        partition_kwargs: dict | None = None, **simulate_kwargs) -> History:
    """One call from names to a History: `fedlab_nb.run("fedavg", "mnist5k", "dirichlet", clients=20,
    rounds=20, partition_kwargs={"alpha": 0.3})`. Other keywords go to `simulate`."""
    fed = federate(dataset, partition, n_clients=clients, seed=seed, dataset_kwargs=dataset_kwargs,
                   device=simulate_kwargs.pop("device", "cpu"), **(partition_kwargs or {}))
    return simulate(get_method(method, **(method_kwargs or {})), fed, rounds=rounds, seed=seed, **simulate_kwargs)


__all__ = ["data", "methods", "models", "FederatedDataset", "federate", "list_datasets", "load_dataset", "History",
           "NonFiniteUpdateError", "simulate", "Method", "get_method", "resolve_device", "run", "__version__"]
