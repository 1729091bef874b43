"""The contract layer: what the engine and the methods agree on. It imports nothing above it.

round info and jobs (`round`), the parts and the `Method` composition (`method`), parameter groups
(`groups`), client optimisers (`optim`), messages and transforms (`messages`), random-stream ids
(`streams`), the method registry (`registry`) and the `History`."""
from .groups import ParamGroups, ResolvedGroups
from .history import History
from .messages import Messages, Transform, TransformContext, dense_bytes, encode
from .method import (ClientUpdate, DataSizeWeighting, LocalObjective, Method, RoundInfo, ServerAssign, ServerKeep,
                     ServerSGD, Track, UniformWeighting, weighted_mean)
from .optim import SGD, Adam, make_optimizer
from .registry import REGISTRY, register
from .round import LocalJob, batch_schedule
from .streams import STREAMS, register_stream

__all__ = ["ParamGroups", "ResolvedGroups", "History", "Messages", "Transform", "TransformContext", "dense_bytes",
           "encode", "ClientUpdate", "DataSizeWeighting", "LocalObjective", "Method", "RoundInfo", "ServerAssign", "ServerKeep", "ServerSGD", "Track",
           "UniformWeighting", "weighted_mean", "SGD", "Adam", "make_optimizer", "REGISTRY", "register", "LocalJob",
           "batch_schedule", "STREAMS", "register_stream"]
