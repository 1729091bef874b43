"""Federated methods, one file per paper, each a composition of the parts in `fedlab_nb.core.method`.

Every module of this package is imported here, and each registers its methods itself
(`@register("key", claims=..., notebook=...)` from `fedlab_nb.core.registry`), so adding a method is
adding a file. `get_method("fedprox", mu=0.1)` builds one by name; `METHODS` maps names to factories."""
from __future__ import annotations

import importlib
import pkgutil

from ..core.method import (ClientUpdate, DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD, Track,
                           UniformWeighting, weighted_mean)
from ..core.registry import REGISTRY, lookup

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

METHODS = {key: e.factory for key, e in sorted(REGISTRY.items()) if e.kind == "method"}
globals().update(METHODS)  # `from fedlab_nb.methods import fedprox` gives the factory, as before


def get_method(name: str | Method, **kwargs) -> Method:
    """A `Method` by registered name (kwargs go to its factory); a `Method` passes through unchanged."""
    if isinstance(name, Method):
        return name
    if not isinstance(name, str):
        raise TypeError(f"method must be a name or a Method, got {type(name).__name__}")
    entry = lookup(name)
    if entry.kind != "method":
        raise ValueError(f"{name!r} is registered as a module ({entry.module}), not a round-based method: call "
                         f"{entry.module}.{entry.factory.__name__} directly")
    return entry.factory(**kwargs)


__all__ = ["ClientUpdate", "DataSizeWeighting", "LocalObjective", "Method", "RoundInfo", "ServerSGD", "Track",
           "UniformWeighting", "weighted_mean", "METHODS", "get_method"]
