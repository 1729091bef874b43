"""The round loop, local training backends, samplers and the History."""
from .client import LocalJob, batch_schedule, make_loss, train_clients_loop
from .history import History
from .sampling import BernoulliSampler, UniformSampler, make_sampler
from .server import NonFiniteUpdateError, RunConfig, evaluate, simulate

__all__ = ["LocalJob", "batch_schedule", "make_loss", "train_clients_loop", "History", "BernoulliSampler",
           "UniformSampler", "make_sampler", "NonFiniteUpdateError", "RunConfig", "evaluate", "simulate"]
