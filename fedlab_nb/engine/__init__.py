"""The round loop, local training backends, the client store, samplers and the History.

Imports the contract layer (`fedlab_nb.core`), data and models only — never `fedlab_nb.methods`."""
from ..core.history import History
from .client import LocalJob, batch_schedule, make_loss, train_clients_loop
from .evaluate import Evaluator, evaluate
from .sampling import BernoulliSampler, UniformSampler, make_sampler
from .server import NonFiniteUpdateError, RunConfig, simulate
from .store import ClientStore

__all__ = ["LocalJob", "batch_schedule", "make_loss", "train_clients_loop", "History", "BernoulliSampler",
           "UniformSampler", "make_sampler", "NonFiniteUpdateError", "RunConfig", "evaluate", "Evaluator", "simulate",
           "ClientStore"]
