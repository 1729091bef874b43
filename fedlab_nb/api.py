"""Names → objects, above the engine: `simulate("fedprox", ...)` resolves the method from the registry,
then runs the engine's `simulate` (which takes a `Method` only)."""
from __future__ import annotations

from .data import federate
from .engine import History, server
from .methods import Method, get_method


def simulate(method: Method | str, fed, model="mlp", **kwargs):
    """`fedlab_nb.engine.simulate` with the method given by name (its factory's defaults) or as a `Method`.
    See `fedlab_nb.engine.server.simulate` for every keyword."""
    return server.simulate(get_method(method), fed, model, **kwargs)


simulate.__doc__ += "\n\n" + (server.simulate.__doc__ or "")


def run(method: str = "fedavg", dataset: str = "mnist5k", partition: str = "dirichlet", clients: int = 20,
        rounds: int = 20, seed: int = 0, method_kwargs: dict | None = None, dataset_kwargs: dict | None = None,
        partition_kwargs: dict | None = None, **simulate_kwargs) -> History:
    """One call from names to a History: `fedlab_nb.run("fedavg", "mnist5k", "dirichlet", clients=20,
    rounds=20, partition_kwargs={"alpha": 0.3})`. Other keywords go to `simulate`."""
    fed = federate(dataset, partition, n_clients=clients, seed=seed, dataset_kwargs=dataset_kwargs,
                   device=simulate_kwargs.pop("device", "cpu"), **(partition_kwargs or {}))
    return simulate(get_method(method, **(method_kwargs or {})), fed, rounds=rounds, seed=seed, **simulate_kwargs)
