"""Client samplers: `sampler(round, num_clients, g) -> sorted client ids` (g: a keyed numpy generator)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UniformSampler:
    """m clients uniformly without replacement each round (m = all when None)."""
    clients_per_round: int | None = None

    def __call__(self, round: int, num_clients: int, g: np.random.Generator) -> np.ndarray:
        m = self.clients_per_round or num_clients
        if not 1 <= m <= num_clients:
            raise ValueError(f"clients_per_round={m} must be between 1 and the {num_clients} clients")
        return np.sort(g.choice(num_clients, m, replace=False))


@dataclass
class BernoulliSampler:
    """Client k takes part in a round with its own probability p_k, independently (may be zero clients);
    the heterogeneous, unknown participation of FedAU (Wang & Ji)."""
    probabilities: np.ndarray

    def __call__(self, round: int, num_clients: int, g: np.random.Generator) -> np.ndarray:
        p = np.asarray(self.probabilities, dtype=float)
        if p.shape != (num_clients,) or (p < 0).any() or (p > 1).any():
            raise ValueError(f"probabilities must be {num_clients} values in [0, 1], got shape {p.shape}")
        return np.flatnonzero(g.random(num_clients) < p)


def make_sampler(clients_per_round, num_clients: int):
    """An int m, a fraction in (0, 1], None (all clients) or a sampler callable."""
    if callable(clients_per_round):
        return clients_per_round
    if clients_per_round is None:
        return UniformSampler(None)
    if isinstance(clients_per_round, float):
        if not 0 < clients_per_round <= 1:
            raise ValueError(f"a fractional clients_per_round must be in (0, 1], got {clients_per_round}")
        return UniformSampler(max(1, int(round(clients_per_round * num_clients))))
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(f"clients_per_round={clients_per_round} must be between 1 and num_clients={num_clients}")
    return UniformSampler(int(clients_per_round))


def check_sampled(ids, num_clients: int, round: int) -> np.ndarray:
    """A sampler's answer once checked: a 1-D array of distinct client ids in 0 … K-1 (empty is fine), as int64
    (torch reads a uint8 index as a mask, an int8 one not at all). A custom sampler that repeats a client (it would
    count twice) or names one that does not exist is refused."""
    arr = np.asarray(ids)
    if arr.size == 0 and arr.ndim >= 1 and len(arr) == 0:  # no client (of any shape (0, …)): an empty round
        return np.empty(0, np.int64)
    if arr.ndim != 1 or arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"round {round + 1}: the sampler must return a 1-D array of client ids (ints), got "
                         f"{arr.dtype} of shape {arr.shape}; return e.g. np.sort(g.choice(K, m, replace=False))")
    bad = arr[(arr < 0) | (arr >= num_clients)]
    if len(bad):
        raise ValueError(f"round {round + 1}: the sampler returned client id(s) {bad[:5].tolist()} outside 0 … "
                         f"{num_clients - 1} (K = {num_clients} clients)")
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"round {round + 1}: the sampler returned client id(s) {uniq[counts > 1][:5].tolist()} more "
                         "than once; sample without replacement (g.choice(K, m, replace=False))")
    return arr.astype(np.int64, copy=False)
