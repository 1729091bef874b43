"""FedDisco — Rui Ye, Mingkai Xu, Jianyu Wang, Chenxin Xu, Siheng Chen, Yanfeng Wang, "FedDisco: Federated
Learning with Discrepancy-Aware Collaboration", ICML 2023 (arXiv:2305.19229).
Official code: https://github.com/MediaBrain-SJTU/FedDisco

FedAvg weights a client by its data share n_k / Σ_j n_j. FedDisco also looks at how far the client's label
distribution D_k is from the global one T (uniform for a balanced test set): with the discrepancy d_k = dist(D_k, T),

    p_k = ReLU(n_k / Σ_j n_j − a·d_k + b) / Σ_j ReLU(n_j / Σ_i n_i − a·d_j + b)

over the round's clients, so a client whose labels are far from T counts less than its size says. As in the
official `disco.py`: the data shares are over the round's participants; `metric` is "kl" (KL(D_k ‖ T),
divided by its sum over the round's clients: the default of the official `args.py` and of its run scripts),
"l2" (the Euclidean distance), "l1" or "cosine" (1 − cosine similarity); a = 0.5, b = 0.1 (`args.py`).
The official code has no path for "every weight clipped to zero" (it raises a NameError); here that round
falls back to the data-size weights with a RuntimeWarning. The weights only replace FedAvg's, so FedDisco
plugs into any host method (`feddisco(base="fedprox")`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from ...core.registry import register
from ...core.method import Method, RoundInfo
from ...data.partition import niid2
from ..basics.fedavg import fedavg
from ..heterogeneity.fedprox import fedprox

METRICS = ("l2", "l1", "cosine", "kl")


def discrepancy(counts, target=None, metric: str = "kl") -> np.ndarray:
    """d_k between each row's label distribution (counts normalised) and `target` (default uniform)."""
    counts = np.asarray(counts, dtype=float)
    if counts.ndim != 2 or (counts < 0).any() or (counts.sum(1) <= 0).any():
        raise ValueError(f"counts must be a [clients, classes] array of non-negative label counts with no empty row, "
                         f"got shape {counts.shape}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    local = counts / counts.sum(1, keepdims=True)
    t = np.full(counts.shape[1], 1.0 / counts.shape[1]) if target is None else np.asarray(target, dtype=float)
    if t.shape != (counts.shape[1],) or (t <= 0).any() or not np.isclose(t.sum(), 1.0):
        raise ValueError(f"target must be a positive distribution over the {counts.shape[1]} classes summing to 1")
    if metric == "l2":
        return np.linalg.norm(local - t, axis=1)
    if metric == "l1":
        return np.abs(local - t).sum(1)
    if metric == "cosine":
        return 1.0 - local @ t / (np.linalg.norm(local, axis=1) * np.linalg.norm(t))
    kl = np.where(local > 0, local * np.log(np.where(local > 0, local, 1.0) / t), 0.0).sum(1)
    return kl / kl.sum() if kl.sum() > 0 else np.zeros_like(kl)  # normalised over the given clients (official)


def disco_weights(sizes, d, a: float = 0.5, b: float = 0.1) -> np.ndarray:
    """ReLU(n_k/Σn − a·d_k + b), normalised; the data shares n_k/Σn if every entry is clipped to zero."""
    sizes, d = np.asarray(sizes, dtype=float), np.asarray(d, dtype=float)
    if sizes.ndim != 1 or sizes.shape != d.shape or (sizes <= 0).any():
        raise ValueError(f"sizes must be positive and match d in shape, got {sizes.shape} and {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("d (the discrepancies) must be finite")
    share = sizes / sizes.sum()
    raw = np.maximum(share - a * d + b, 0.0)
    if raw.sum() <= 0:
        warnings.warn(f"FedDisco: every weight n_k/N - a*d_k + b is <= 0 (a={a}, b={b}); using the data-size weights "
                      "this round. Lower a or raise b.", RuntimeWarning, stacklevel=2)
        return share
    return raw / raw.sum()


@dataclass
class FedDiscoWeighting:
    """FedDisco's aggregation weights from each client's training-label histogram (`counts`, [K, C])."""
    counts: np.ndarray
    a: float = 0.5
    b: float = 0.1
    metric: str = "kl"
    target: np.ndarray | None = None   # the global label distribution T; None = uniform

    def __post_init__(self):
        for name in ("a", "b"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                raise ValueError(f"FedDisco {name} must be a finite number (paper code: a=0.5, b=0.1), got {v!r}")
        discrepancy(self.counts, self.target, self.metric)  # validates counts, target and metric now

    @classmethod
    def from_federated(cls, fed, **kwargs) -> "FedDiscoWeighting":
        """The histograms of `fed`'s local training sets (what each client reports once)."""
        return cls(fed.label_histogram("train"), **kwargs)

    def round_weights(self, client_ids, sizes) -> np.ndarray:
        """The normalised weights of these clients (the discrepancy taken over them, as the official code)."""
        ids = np.asarray(client_ids, dtype=int)
        return disco_weights(sizes, discrepancy(np.asarray(self.counts)[ids], self.target, self.metric), self.a, self.b)

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if len(self.counts) != num_clients:
            raise ValueError(f"FedDiscoWeighting has histograms for {len(self.counts)} clients, the run has "
                             f"{num_clients}; build it with FedDiscoWeighting.from_federated(fed)")
        return {}

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        w = self.round_weights(info.client_ids, info.sizes.cpu().numpy())
        return torch.as_tensor(w).to(info.sizes), state


@register("feddisco", claims="feddisco")
def feddisco(fed=None, base: str | Method = "fedavg", a: float = 0.5, b: float = 0.1, metric: str = "kl",
             counts=None, target=None, **base_kwargs) -> Method:
    """A host method (FedAvg, FedProx, ... or a Method) with its weighting replaced by FedDisco's.
    The label histograms come from `fed` (a FederatedDataset) or `counts` ([K, C])."""
    if (fed is None) == (counts is None):
        raise ValueError("feddisco needs exactly one of fed= (a FederatedDataset) or counts= (label histograms [K, C])")
    if isinstance(base, str):
        if base not in ("fedavg", "fedprox"):
            raise ValueError(f"base must be 'fedavg', 'fedprox' or a Method, got {base!r}")
        host = (fedavg if base == "fedavg" else fedprox)(**base_kwargs)
    elif isinstance(base, Method):
        host = base
    else:
        raise ValueError(f"base must be 'fedavg', 'fedprox' or a Method, got {type(base).__name__}")
    counts = fed.label_histogram("train") if fed is not None else counts
    weighting = FedDiscoWeighting(np.asarray(counts), a=a, b=b, metric=metric, target=target)
    return replace(host, name=f"{host.name}+disco", weighting=weighting)


def niid2_partition(labels, n_skewed: int = 5, n_iid: int = 1, seed: int = 0):
    """The paper's NIID-2 split with n_skewed skewed and n_iid IID clients: `data.partition.niid2`, also
    reachable as `fl.federate(..., partition="niid2")`."""
    return niid2(labels, n_skewed + n_iid, n_iid=n_iid, seed=seed)
