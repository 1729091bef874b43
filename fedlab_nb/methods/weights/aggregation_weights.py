"""The aggregation-weights chapter side by side: one factory for every weighting the chapter compares.

FedAvg (McMahan et al. 2017), FedAU (Wang & Ji 2024, `fedau.py`), FedDisco (Ye et al. 2023, `feddisco.py`),
IDA (Yeganeh et al. 2020, `ida.py`), L-DAWA (Rehman et al. 2023, `ldawa.py`) and FedLAW (Li et al. 2023,
`fedlaw.py`), each with its own defaults, so the chapter notebook compares them on one task with one call.
"""
from __future__ import annotations

from torch import nn

from ...core.method import Method
from ...core.registry import get_method, register
from .fedau import fedau
from .feddisco import feddisco
from .fedlaw import fedlaw
from .ida import ida
from .ldawa import ldawa

CHAPTER = ("FedAvg", "FedAU", "FedDisco", "IDA", "L-DAWA", "FedLAW")


@register("aggregation_weights", claims="aggregation_weights", kind="module")
def chapter_method(name: str, fed, proxy, model: nn.Module) -> Method:
    """The chapter's method `name` (one of CHAPTER) for federation `fed`; FedLAW learns on the server's proxy set
    `(x, y)`; L-DAWA and FedLAW need the run's `model` (pass the same module to `simulate`)."""
    builders = {"FedAvg": lambda: get_method("fedavg"), "FedAU": fedau, "FedDisco": lambda: feddisco(fed),
                "IDA": ida, "L-DAWA": lambda: ldawa(model), "FedLAW": lambda: fedlaw(proxy, model)}
    if name not in builders:
        raise ValueError(f"name must be one of {CHAPTER}, got {name!r}")
    return builders[name]()
