"""Federated methods, one folder per chapter of the course and one file per paper, each a composition of the
parts in `fedlab_nb.core.method`.

The chapter folders are named after the lesson keys of `fedlab_nb.repro.course.LESSONS` (basics,
heterogeneity, weights, robustness, privacy, communication, personalisation, bilevel, more, labels, beyond;
a test holds the two equal). `heads.py` is the one module here that several chapters share. Every module of
every chapter is imported here, and each registers its methods itself (`@register("key", claims=...)` from `fedlab_nb.core.registry`), so adding a method is adding a file to its chapter.
`get_method("fedprox", mu=0.1)` builds one by name; `METHODS` maps names to factories."""
from __future__ import annotations

import importlib
import pkgutil

from ..core.method import (ClientUpdate, DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD, Track,
                           UniformWeighting, weighted_mean)
from ..core.registry import REGISTRY, get_method

for _info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_info.name)

METHODS = {key: e.factory for key, e in sorted(REGISTRY.items()) if e.kind == "method"}
globals().update(METHODS)  # `from fedlab_nb.methods import fedprox` gives the factory, as before

__all__ = ["ClientUpdate", "DataSizeWeighting", "LocalObjective", "Method", "RoundInfo", "ServerSGD", "Track",
           "UniformWeighting", "weighted_mean", "METHODS", "get_method"]
