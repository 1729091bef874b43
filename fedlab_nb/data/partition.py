"""Partitioners: seeded pure functions from labels (or group keys) to one index array per client.

All return a `Partition` (a list of sorted int64 numpy arrays). Impossible requests raise `ValueError`
naming the parameter and the fix; nothing is silently truncated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class Partition(list):
    """A list of per-client index arrays; `transforms` (optional) holds one feature transform per client."""

    def __init__(self, parts, transforms=None, name: str = ""):
        super().__init__(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
        self.transforms = transforms
        self.name = name

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(p) for p in self])


def _count(name: str, value, example: str) -> int:
    """An integer parameter >= 1; floats, strings and bools are refused rather than rounded or compared."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__}); "
                         f"pass a whole number such as {name}={example}")
    return int(value)


def _number(name: str, value, low: float, example: str, strict: bool = True) -> float:
    """A finite real parameter > low (>= low when not `strict`); strings, NaN and inf are refused."""
    bound = f"> {low:g}" if strict else f">= {low:g}"
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and math.isfinite(value) and (value > low if strict else value >= low))
    if not ok:
        raise ValueError(f"{name} must be {bound}, a finite number, got {value!r} ({type(value).__name__}); "
                         f"e.g. {name}={example}")
    return float(value)


def _keys(values, what: str) -> np.ndarray:
    """A 1-D array of labels / group keys without NaN or inf (a NaN row would silently belong to no client)."""
    values = np.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of class ids, got shape {values.shape}")
    if values.dtype.kind in "fc" and not np.isfinite(values).all():
        rows = np.flatnonzero(~np.isfinite(values))
        raise ValueError(f"{what} contain NaN or inf in {len(rows)} rows (first: {rows[:5].tolist()}); "
                         "drop or impute those rows before partitioning")
    return values


def _check(labels, n_clients: int, min_size: int = 1) -> np.ndarray:
    labels = _keys(labels, "labels")
    _count("n_clients", n_clients, "10")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size must be >= 0 (a whole number such as 10), got {min_size!r}")
    if n_clients * max(min_size, 1) > len(labels):
        raise ValueError(f"n_clients={n_clients} × min_size={max(min_size, 1)} exceeds the {len(labels)} samples; "
                         f"use at most {len(labels) // max(min_size, 1)} clients or a smaller min_size")
    return labels


def iid(labels, n_clients: int, seed: int = 0) -> Partition:
    """Uniformly random, (almost) equal-sized shards: the IID baseline."""
    labels = _check(labels, n_clients)
    perm = np.random.default_rng(seed).permutation(len(labels))
    return Partition(np.array_split(perm, n_clients), name="iid")


def dirichlet(labels, n_clients: int, alpha: float, seed: int = 0, min_size: int = 10, max_tries: int = 100) -> Partition:
    """Label skew of Hsu et al. (2019): for every class c, split its samples among clients with
    proportions q_c ~ Dir(α·1). Small α → each client sees few classes. Redraws until every client has
    `min_size` samples (the common recipe) and says so when that is impossible."""
    _number("alpha", alpha, 0, "0.1 (smaller = more skewed; large = near IID)")
    labels = _check(labels, n_clients, min_size)
    g = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts = [[] for _ in range(n_clients)]
        for c in classes:
            rows = g.permutation(np.flatnonzero(labels == c))
            q = g.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(rows)).astype(int)
            for k, chunk in enumerate(np.split(rows, cuts)):
                parts[k].extend(chunk)
        if min(len(p) for p in parts) >= min_size:
            return Partition(parts, name=f"dirichlet({alpha})")
    raise ValueError(f"dirichlet: after {max_tries} draws some client still had < min_size={min_size} samples "
                     f"(alpha={alpha}, n_clients={n_clients}, {len(labels)} samples); lower min_size, raise alpha "
                     f"or use fewer clients")


def shards(labels, n_clients: int, shards_per_client: int = 2, seed: int = 0) -> Partition:
    """McMahan et al. (2017)'s pathological non-IID split: sort by label, cut into
    n_clients × shards_per_client equal shards, give each client `shards_per_client` random shards."""
    labels = _check(labels, n_clients)
    _count("shards_per_client", shards_per_client, "2")
    n_shards = n_clients * shards_per_client
    if n_shards > len(labels):
        raise ValueError(f"shards: {n_shards} shards for {len(labels)} samples; lower n_clients or shards_per_client")
    g = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n_shards)
    owner = g.permutation(n_shards).reshape(n_clients, shards_per_client)
    return Partition([np.concatenate([pieces[s] for s in row]) for row in owner], name=f"shards({shards_per_client})")


def pathological(labels, n_clients: int, classes_per_client: int = 2, seed: int = 0) -> Partition:
    """Each client holds exactly `classes_per_client` classes (assigned round-robin over a random class
    order so every class is used); a class's samples are split evenly among the clients holding it."""
    labels = _check(labels, n_clients)
    classes = np.unique(labels)
    k = _count("classes_per_client", classes_per_client, "2")
    if not 1 <= k <= len(classes):
        raise ValueError(f"classes_per_client={k} must be between 1 and the number of classes ({len(classes)})")
    g = np.random.default_rng(seed)
    order = g.permutation(classes)
    held = [[order[(i * k + j) % len(classes)] for j in range(k)] for i in range(n_clients)]
    holders = {c: [i for i in range(n_clients) if c in held[i]] for c in classes}
    parts = [[] for _ in range(n_clients)]
    for c, who in holders.items():
        if not who:  # fewer client slots than classes: this class is unused, as in the original recipe
            continue
        rows = g.permutation(np.flatnonzero(labels == c))
        if len(rows) < len(who):
            raise ValueError(f"pathological: class {c} has {len(rows)} samples for {len(who)} clients; use fewer clients")
        for i, chunk in zip(who, np.array_split(rows, len(who))):
            parts[i].extend(chunk)
    return Partition(parts, name=f"pathological({k})")


def quantity_skew(labels, n_clients: int, kind: str = "lognormal", sigma: float = 1.0, alpha: float = 0.5,
                  seed: int = 0, min_size: int = 10) -> Partition:
    """Labels IID, sizes skewed: sizes ∝ LogNormal(0, σ) (`kind="lognormal"`) or ∝ Dir(α) (`kind="dirichlet"`),
    with every client given at least `min_size` samples first."""
    labels = _check(labels, n_clients, min_size)
    g = np.random.default_rng(seed)
    if kind == "lognormal":
        share = g.lognormal(0.0, _number("sigma", sigma, 0, "1.0 (0 = equal sizes)", strict=False), n_clients)
    elif kind == "dirichlet":
        share = g.dirichlet(np.full(n_clients, _number("alpha", alpha, 0, "0.5 (for kind='dirichlet')")))
    else:
        raise ValueError(f"kind must be 'lognormal' or 'dirichlet', got {kind!r}")
    spare = len(labels) - n_clients * min_size
    sizes = min_size + np.floor(share / share.sum() * spare).astype(int)
    sizes[: len(labels) - sizes.sum()] += 1  # hand out the rounding remainder
    perm = g.permutation(len(labels))
    return Partition(np.split(perm, np.cumsum(sizes)[:-1]), name=f"quantity_skew({kind})")


@dataclass(frozen=True)
class FeatureTransform:
    """A per-client change of the inputs: `kind` in {"noise", "rotation", "scale"}."""
    kind: str
    strength: float
    seed: int

    def __call__(self, x, input_shape):
        import torch
        g = torch.Generator().manual_seed(self.seed)
        if self.kind == "noise":  # additive Gaussian noise, σ = strength (FedBN-style feature shift)
            return x + self.strength * torch.randn(x.shape, generator=g)
        if self.kind == "scale":  # contrast change: x · s, with s this client's factor
            return x * self.strength
        if self.kind == "rotation":  # images rotated by a client angle (degrees), like Rotated-MNIST
            return _rotate(x, input_shape, self.strength)
        raise ValueError(f"unknown feature transform {self.kind!r}")


def _rotate(x, input_shape, degrees):
    import torch
    import torch.nn.functional as F
    if len(input_shape) != 3:
        raise ValueError("feature_skew(kind='rotation') needs image data (input_shape C×H×W)")
    theta = torch.deg2rad(torch.tensor(float(degrees)))
    c, s = torch.cos(theta), torch.sin(theta)
    grid = F.affine_grid(torch.tensor([[c, -s, 0.0], [s, c, 0.0]]).unsqueeze(0).expand(len(x), 2, 3),
                         (len(x), *input_shape), align_corners=False)
    img = x.reshape(len(x), *input_shape)
    return F.grid_sample(img, grid, align_corners=False).reshape(len(x), -1)


def feature_skew(labels, n_clients: int, kind: str = "noise", strength: float = 0.5, seed: int = 0) -> Partition:
    """IID labels and sizes, but client k's inputs are transformed: Gaussian noise with σ = strength·k/(K−1),
    a scale factor spread over [1 − strength, 1 + strength], or a rotation spread over [0, strength] degrees."""
    if kind not in ("noise", "rotation", "scale"):
        raise ValueError(f"kind must be 'noise', 'rotation' or 'scale', got {kind!r}")
    strength = _number("strength", strength, 0, "0.5", strict=False)
    parts = iid(labels, n_clients, seed)
    pos = np.linspace(0, 1, n_clients) if n_clients > 1 else np.zeros(1)
    amount = {"noise": strength * pos, "rotation": strength * pos, "scale": 1 + strength * (2 * pos - 1)}[kind]
    transforms = [FeatureTransform(kind, float(a), seed * 100_003 + k) for k, a in enumerate(amount)]
    return Partition(parts, transforms=transforms, name=f"feature_skew({kind})")


def natural(groups, n_clients: int | None = None, min_size: int = 1) -> Partition:
    """One client per value of a group key (writer, speaker, country, Synthetic's client id ...).
    `n_clients` keeps the first n groups in sorted order of the key."""
    groups = _keys(groups, "groups")
    keys = np.unique(groups)
    if n_clients is not None:
        _count("n_clients", n_clients, f"{len(keys)} (one client per group) or None")
        if n_clients > len(keys):
            raise ValueError(f"n_clients={n_clients} exceeds the {len(keys)} natural groups; use at most {len(keys)}")
        keys = keys[:n_clients]
    parts = [np.flatnonzero(groups == key) for key in keys]
    small = [str(k) for k, p in zip(keys, parts) if len(p) < min_size]
    if small:
        raise ValueError(f"natural: groups {', '.join(small[:5])} have < min_size={min_size} samples; lower min_size")
    return Partition(parts, name="natural")


def long_tail(labels, n_clients: int, imbalance_ratio: float = 100.0, alpha: float = 0.5, seed: int = 0,
              min_size: int = 10, n_max: int | None = None) -> Partition:
    """Federated long-tailed data (Fed-LT): the pooled data are first made long-tailed, then split with
    Dirichlet(α) label skew. Class c (the c-th label in sorted order) keeps
        n_c = floor(n_max · ρ^(−c/(C−1))),   ρ = imbalance_ratio = n_max / n_min,
    random samples (the exponential profile of Cao et al. 2019's CIFAR-LT; FedLoGe's "IF" is 1/ρ); the
    rest of the data set is left out. `n_max` defaults to the smallest class count, so every class can
    supply its share; ρ = 1 keeps the classes balanced."""
    rho = _number("imbalance_ratio", imbalance_ratio, 1, "100 (n_max / n_min; 1 = balanced)", strict=False)
    _number("alpha", alpha, 0, "0.5 (smaller = more skewed; large = near IID)")
    labels = _keys(labels, "labels")
    classes = np.unique(labels)
    if len(classes) < 2:
        raise ValueError(f"long_tail needs at least 2 classes, got {len(classes)}; use iid or dirichlet instead")
    available = np.array([(labels == c).sum() for c in classes])
    n_max = int(available.min()) if n_max is None else _count("n_max", n_max, str(int(available.min())))
    counts = np.floor(n_max * rho ** (-np.arange(len(classes)) / (len(classes) - 1)) + 1e-9).astype(int)
    short = np.flatnonzero(counts > available)
    if len(short):
        raise ValueError(f"n_max={n_max} asks class {classes[short[0]]} for {counts[short[0]]} samples but it has "
                         f"{available[short[0]]}; use n_max <= {int(available.min())}")
    if counts[-1] < 1:
        raise ValueError(f"imbalance_ratio={imbalance_ratio} leaves the tail class with 0 of n_max={n_max} samples; "
                         f"use imbalance_ratio <= {n_max}")
    g = np.random.default_rng([seed, 46])  # its own stream: the subsample does not shift the Dirichlet draws
    kept = np.sort(np.concatenate([g.choice(np.flatnonzero(labels == c), n, replace=False)
                                   for c, n in zip(classes, counts)]))
    parts = dirichlet(labels[kept], n_clients, alpha, seed=seed, min_size=min_size)
    return Partition([kept[p] for p in parts], name=f"long_tail({rho:g}, {alpha})")


def niid2(labels, n_clients: int = 6, n_iid: int = 1, seed: int = 0) -> Partition:
    """FedDisco's NIID-2 split (Ye et al., ICML 2023; official `partition_data`, "noniid-2", 10 classes): each
    class is cut into n_clients shards; each of the n_clients − n_iid skewed clients takes 5 shards of two
    classes (client i: classes 2i and 2i+1 mod 10), each of the n_iid IID clients one shard of every class. With
    the defaults (5 skewed + 1 IID) the six clients have equal sizes, so FedAvg weighs the IID client like any
    skewed one."""
    labels = _keys(labels, "labels")
    n_clients = _count("n_clients", n_clients, "6")
    if isinstance(n_iid, bool) or not isinstance(n_iid, (int, np.integer)) or not 0 <= n_iid < n_clients:
        raise ValueError(f"n_iid must be an integer in [0, n_clients), got {n_iid!r}; e.g. n_clients=6, n_iid=1")
    n_skewed = n_clients - n_iid
    classes = np.unique(labels)
    if len(classes) != 10 or n_skewed % 5:
        raise ValueError("niid2 needs 10 classes and n_clients − n_iid a positive multiple of 5 (the official "
                         f"recipe), got {len(classes)} classes and {n_skewed} skewed clients; e.g. n_clients=6, n_iid=1")
    g = np.random.default_rng(seed)
    pieces = {c: np.array_split(g.permutation(np.flatnonzero(labels == c)), n_clients) for c in classes}
    parts = []
    for i in range(n_skewed):
        block = slice(5 * (i // 5), 5 * (i // 5 + 1))   # skewed clients 0-4 share shards 0-4, 5-9 shards 5-9 ...
        parts.append(np.concatenate([s for c in (classes[(2 * i) % 10], classes[(2 * i + 1) % 10])
                                     for s in pieces[c][block]]))
    for j in range(n_iid):
        parts.append(np.concatenate([pieces[c][n_skewed + j] for c in classes]))
    return Partition(parts, name=f"niid2({n_skewed}+{n_iid})")


PARTITIONERS = {"iid": iid, "dirichlet": dirichlet, "shards": shards, "pathological": pathological,
                "quantity_skew": quantity_skew, "feature_skew": feature_skew, "natural": natural,
                "long_tail": long_tail, "niid2": niid2}


def make_partition(name: str, labels, n_clients: int, **kwargs) -> Partition:
    """Dispatch by name: `make_partition("dirichlet", y, 20, alpha=0.3, seed=0)`; `natural` takes the groups as labels."""
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partition {name!r}; choose one of {', '.join(PARTITIONERS)}")
    return PARTITIONERS[name](labels, n_clients, **kwargs)
