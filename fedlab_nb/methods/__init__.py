"""Federated methods, one file per paper, each a composition of the parts in `base.py`.

`get_method("fedprox", mu=0.1)` builds one by name; `METHODS` lists them.
"""
from .base import (DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD, UniformWeighting,
                   weighted_mean)
from .fedavg import fedavg
from .fedavgm import fedavgm
from .fednova import fednova, step_normalisation
from .fedopt import ServerAdaptive, fedadagrad, fedadam, fedyogi
from .fedprox import ProximalObjective, fedprox
from .scaffold import ControlVariateObjective, scaffold

METHODS = {"fedavg": fedavg, "fedprox": fedprox, "scaffold": scaffold, "fednova": fednova, "fedavgm": fedavgm,
           "fedadam": fedadam, "fedyogi": fedyogi, "fedadagrad": fedadagrad}
# Not training loops, so not in METHODS: `afl` (closed form, one shot) and `frl` (rank voting) are modules,
# imported at the end (with fedau) because they use the engine, which imports this package.


def get_method(name: str | Method, **kwargs) -> Method:
    """A `Method` by name (kwargs go to its factory); a `Method` passes through unchanged."""
    if isinstance(name, Method):
        return name
    if name not in METHODS:
        import difflib
        close = difflib.get_close_matches(name, METHODS, n=3)
        raise ValueError(f"unknown method {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; available: {', '.join(METHODS)}")
    return METHODS[name](**kwargs)

__all__ = ["DataSizeWeighting", "LocalObjective", "Method", "RoundInfo", "ServerSGD", "UniformWeighting", "weighted_mean",
           "fedavg", "fedavgm", "fednova", "step_normalisation", "ServerAdaptive", "fedadagrad", "fedadam", "fedyogi",
           "ProximalObjective", "fedprox", "ControlVariateObjective", "scaffold", "METHODS", "get_method", "afl", "frl",
           "FedAUWeighting", "KnownProbabilityWeighting", "fedau", "fedavg_participants", "known_probability",
           "weighted_sum"]

from . import afl, frl  # noqa: E402
from .fedau import (FedAUWeighting, KnownProbabilityWeighting, fedau, fedavg_participants,  # noqa: E402
                    known_probability, weighted_sum)

METHODS["fedau"] = fedau
