"""The contract layer: what the engine and the methods agree on. It imports nothing above it.

round info and jobs (`round`), the parts and the `Method` composition (`method`), parameter groups
(`groups`), client optimisers (`optim`), messages and transforms (`messages`), random-stream ids
(`streams`), the method registry (`registry`) and the `History`."""
from .groups import ParamGroups, ResolvedGroups
from .history import History
from .messages import Messages, Transform, TransformContext, dense_bytes, encode
from .method import (ActsInEmptyRounds, Broadcasts, ClientUpdate, DataSizeWeighting, LocalContext, LocalObjective,
                     Method, OwnTraining, Reports, RoundInfo, ServerAssign, ServerKeep, ServerSGD, StatefulRule, Track,
                     UniformWeighting, UsesContext, weighted_mean)
from .optim import SGD, Adam, client_lr, make_optimizer
from .registry import REGISTRY, register
from .round import DataPoison, LocalJob, ScoredPoison, batch_schedule
from .streams import STREAMS, register_stream

__all__ = ["ParamGroups", "ResolvedGroups", "History", "Messages", "Transform", "TransformContext", "dense_bytes",
           "encode", "ClientUpdate", "DataSizeWeighting", "LocalContext", "LocalObjective", "Method", "OwnTraining",
           "RoundInfo", "ServerAssign", "ServerKeep", "ServerSGD", "Track", "StatefulRule", "UsesContext", "Broadcasts",
           "Reports", "ActsInEmptyRounds",
           "UniformWeighting", "weighted_mean", "SGD", "Adam", "client_lr", "make_optimizer", "REGISTRY", "register", "LocalJob", "DataPoison", "ScoredPoison",
           "batch_schedule", "STREAMS", "register_stream"]
