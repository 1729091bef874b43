"""Bilevel optimisation: hypergradients (unrolled, truncated, implicit), penalty methods, warm vs cold
start, and the federated (FedMBO) and decentralised (DSBO) algorithms built on them.

Everything here is plain `torch.func` on flat parameter vectors, so the same functions serve a
single-machine toy with a closed-form answer and a client's inner loop. Each module registers its own
entries; every module of this package is imported here, like `fedlab_nb.methods`."""
from __future__ import annotations

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
