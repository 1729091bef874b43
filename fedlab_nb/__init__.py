"""fedlab_nb — a notebook-first federated learning package for learning, teaching and reproducing papers.

    import fedlab_nb as fl
    fed = fl.federate("mnist5k", "dirichlet", n_clients=20, alpha=0.3, seed=0)
    hist = fl.simulate("fedavg", fed, model="mlp", rounds=20, clients_per_round=10)
    print(hist.final("test_acc"))

Layers, bottom up: `core` (the contract) → `data`, `models` → `engine` → `methods` (each registers itself)
→ this package's name-resolving API. The names that need the methods are loaded on first use, so
`import fedlab_nb.engine` imports no method."""
from __future__ import annotations

__version__ = "0.1.0"

from . import data, models
from .core.history import History
from .data import FederatedDataset, federate, list_datasets, load_dataset
from .utils import resolve_device

_SUBMODULES = {"api", "cli", "core", "engine", "flower", "repro", "studies", "utils", "viz", "widgets"}
_LAZY = {"simulate": "api", "methods": None, "Method": "methods", "get_method": "methods", "run": "api",
         "NonFiniteUpdateError": "engine"}


def __getattr__(name):
    """Load the method layer (and the engine) on first use of a name that needs it."""
    import importlib
    if name in _SUBMODULES:  # fl.engine, fl.viz ...: a submodule on first use
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'fedlab_nb' has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return module if _LAZY[name] is None else getattr(module, name)


__all__ = ["data", "methods", "models", "FederatedDataset", "federate", "list_datasets", "load_dataset", "History",
           "NonFiniteUpdateError", "simulate", "Method", "get_method", "resolve_device", "run", "__version__"]
