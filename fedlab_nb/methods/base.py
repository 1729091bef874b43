"""The parts a method is composed of live in the contract layer (`fedlab_nb.core.method`); re-exported here
so method files and notebooks can keep `from fedlab_nb.methods.base import ...`."""
from ..core.method import (ClientUpdate, DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerSGD, Track,
                           UniformWeighting, weighted_mean)

__all__ = ["ClientUpdate", "DataSizeWeighting", "LocalObjective", "Method", "RoundInfo", "ServerSGD", "Track",
           "UniformWeighting", "weighted_mean"]
