"""`FederatedDataset`: one data set cut into clients, each with a local train and test split, on a device."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..utils import check_seed, resolve_device
from .datasets import Dataset, load_dataset
from .partition import Partition, make_partition


def _check_dataset(dataset: Dataset, parts: Partition) -> None:
    """Labels in [0, num_classes), finite inputs and partition rows that exist: later these would be a deep
    torch IndexError, or silently NaN losses."""
    k = dataset.num_classes
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"{dataset.name}: num_classes must be a positive integer, got {k!r}")
    for split in ("train", "test"):
        x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
        if not _integer(y.dtype):
            raise ValueError(f"{dataset.name}: y_{split} must hold integer class ids (e.g. torch.int64), "
                             f"got {y.dtype}; convert with .long() after removing NaN labels")
        if y.dtype != torch.int64:  # cross-entropy takes int64 targets; vmap's gather takes no uint8 index
            raise ValueError(f"{dataset.name}: y_{split} holds {y.dtype} class ids; the losses need torch.int64: "
                             f"convert with y_{split}.long()")
        bad = (y < 0) | (y >= k)
        if bad.any():
            rows = bad.nonzero().flatten()
            fix = (f"remap the labels to 0 … {k - 1} (class ids are never negative)" if int(y.min()) < 0 else
                   f"set num_classes to at least {int(y.max()) + 1} or remap the labels to 0 … {k - 1}")
            raise ValueError(f"{dataset.name}: y_{split} has labels outside [0, num_classes={k}) in {len(rows)} rows "
                             f"(first: row {int(rows[0])}, label {int(y[rows[0]])}); {fix}")
        nonfinite = ~torch.isfinite(x).reshape(len(x), -1).all(dim=1) if len(x) else torch.zeros(0, dtype=torch.bool)
        if nonfinite.any():
            rows = nonfinite.nonzero().flatten()
            raise ValueError(f"{dataset.name}: x_{split} has NaN or inf in {len(rows)} rows (first: "
                             f"{rows[:5].tolist()}); drop or impute those rows before federating")
    n, used = len(dataset.y_train), [p for p in parts if len(p)]
    low, high = min((int(p.min()) for p in used), default=0), max((int(p.max()) for p in used), default=0)
    if low < 0 or high >= n:
        raise ValueError(f"the partition refers to training rows {low} … {high} but {dataset.name} has rows "
                         f"0 … {n - 1}; build the partition from this data set's labels (dataset.y_train.numpy())")


def _numeric(values, what: str) -> torch.Tensor:
    """`values` (an array, a list, a tensor) as a numeric tensor, or a ValueError naming it."""
    if isinstance(values, torch.Tensor):  # data, not a graph: one that requires grad (or on a GPU) is taken as is
        values = values.detach().cpu()
    try:
        out = torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not a numeric array ({str(e)[:80]}); pass numbers, one row per sample") from None
    if out.dim() == 0:
        raise ValueError(f"{what} is a single number, not one row per sample")
    return out


def _integer(dtype: torch.dtype) -> bool:
    """An integer dtype (class ids), not float, complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _class_ids(y: torch.Tensor, what: str) -> torch.Tensor:
    """Integer labels of any width (np.int32, uint8 ...) as the int64 class ids the losses take; others as given."""
    if y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"{what} has dtype {y.dtype}: y must be integer class ids (bool labels: y.astype(int)) or "
                         "float regression targets")
    if y.dtype == torch.uint64 and len(y) and int(y.numpy().max()) > torch.iinfo(torch.int64).max:
        raise ValueError(f"{what} holds class id {int(y.numpy().max()):,} (uint64, beyond int64): class ids must be "
                         "0 … K-1; remap the labels (np.unique(y, return_inverse=True)[1])")
    return y.long() if _integer(y.dtype) else y


MAX_INFERRED_CLASSES = 1 << 20  # a larger largest label is an id column (10**12 would be a model of that many outputs)


class FederatedDataset:
    """Clients' train/test rows of one `Dataset`.

    Each client's partition is split (seeded) into local train rows and local test rows
    (`test_fraction`); the global test set is the data set's own test split. Client tensors are
    materialised once, on `device`, with any per-client feature transform of the partition applied.
    """

    def __init__(self, dataset: Dataset, parts: Partition, test_fraction: float = 0.2, seed: int = 0,
                 device: str | torch.device = "cpu"):
        if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 <= test_fraction < 1:
            raise ValueError(f"test_fraction must be a number in [0, 1), e.g. 0.2, got {test_fraction!r}")
        if len(parts) == 0:
            raise ValueError("the partition has no clients")
        _check_dataset(dataset, parts)
        self.dataset, self.partition, self.device = dataset, parts, resolve_device(device)
        g = np.random.default_rng([seed, 7])
        self.train_idx, self.test_idx = [], []
        for rows in parts:
            rows = g.permutation(rows)
            n_test = int(round(test_fraction * len(rows))) if len(rows) > 1 else 0
            self.test_idx.append(np.sort(rows[:n_test]))
            self.train_idx.append(np.sort(rows[n_test:]))
        if min(len(t) for t in self.train_idx) == 0:
            raise ValueError("some client has no training rows left after the local test split; "
                             "lower test_fraction or use a partition with a larger min_size")
        self._materialise()

    def _client_rows(self, k, idx):
        x = self.dataset.x_train[idx]
        if self.partition.transforms is not None:
            x = self.partition.transforms[k](x, self.dataset.input_shape)
        return x.to(self.device), self.dataset.y_train[idx].to(self.device)

    def _materialise(self):
        self.client_train = [self._client_rows(k, idx) for k, idx in enumerate(self.train_idx)]
        self.client_test = [self._client_rows(k, idx) for k, idx in enumerate(self.test_idx)]
        self.x_test = self.dataset.x_test.to(self.device)
        self.y_test = self.dataset.y_test.to(self.device)

    def to(self, device) -> "FederatedDataset":
        """Move every tensor to `device` (returns self)."""
        self.device = resolve_device(device)
        self._materialise()
        return self

    @classmethod
    def from_clients(cls, clients, test=None, *, name: str = "custom", num_classes: int | None = None,
                     device="cpu") -> "FederatedDataset":
        """A federation from per-client training arrays `clients = [(x_k, y_k), ...]`, kept as given (no
        local test split; dtypes kept, e.g. float64). `test`: the global (x, y), default all clients' rows.
        Integer y are class ids and checked like any data set; float y are regression targets (e.g.
        FedAU's quadratic clients: y_k = c_k), for `simulate(..., loss=...)`; `num_classes` is then the
        target width."""
        pairs = isinstance(clients, (list, tuple)) and all(isinstance(c, (list, tuple)) and len(c) == 2
                                                            for c in clients)
        if not pairs or not clients:
            raise ValueError("clients must be a non-empty list of (x, y) pairs, one per client, got "
                             f"{type(clients).__name__}")
        xs = [_numeric(x, f"clients[{k}]'s x") for k, (x, _) in enumerate(clients)]
        ys = [_class_ids(_numeric(y, f"clients[{k}]'s y"), f"clients[{k}]'s y") for k, (_, y) in enumerate(clients)]
        if any(len(x) != len(y) or len(y) == 0 or x.shape[1:] != xs[0].shape[1:] for x, y in zip(xs, ys)):
            raise ValueError("clients must be a non-empty list of (x, y) with len(x) == len(y) >= 1 per client and "
                             "rows of one shape")
        if xs[0][0].numel() == 0:  # x of shape [n, 0] (a column selection that kept nothing) trains a bias only
            raise ValueError(f"clients' x has rows with no features (shape {tuple(xs[0].shape)}); give at least one "
                             "feature per row")
        x, y = torch.cat(xs), torch.cat(ys)
        if test is not None and not (isinstance(test, (list, tuple)) and len(test) == 2):
            raise ValueError(f"test must be one (x, y) pair, got {type(test).__name__}")
        x_test, y_test = (x, y) if test is None else (_numeric(test[0], "test's x"), _numeric(test[1], "test's y"))
        y_test = _class_ids(y_test, "test's y")
        if len(y_test) == 0:
            raise ValueError("test is an empty (x, y) pair; give at least one test row, or test=None to test on the "
                             "clients' rows")
        if x_test.shape[1:] != x.shape[1:] or len(x_test) != len(y_test) or y_test.shape[1:] != y.shape[1:]:
            raise ValueError(f"test's (x, y) of shapes {tuple(x_test.shape)}, {tuple(y_test.shape)} do not match the "
                             f"clients' rows {tuple(x.shape[1:])}, {tuple(y.shape[1:])}")
        regression = y.dtype.is_floating_point
        if not regression and y.dim() != 1:
            raise ValueError(f"integer y must be class ids of shape [n], got shape {tuple(y.shape)}; one-hot labels: "
                             "pass y.argmax(1) (float y are regression targets)")
        if regression and not (torch.isfinite(y).all() and torch.isfinite(y_test).all()):
            raise ValueError("clients' y (regression targets) hold NaN or inf; drop or impute those rows")
        if num_classes is None:
            num_classes = (int(y[0].numel()) if regression else int(max(y.max(), y_test.max())) + 1)
            if num_classes > MAX_INFERRED_CLASSES:
                raise ValueError(f"the largest class id is {num_classes - 1:,}: class ids must be 0 … K-1; remap the "
                                 "labels (np.unique(y, return_inverse=True)[1]) or pass num_classes=")
        elif isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
            raise ValueError(f"num_classes must be a whole number (the class count, or the regression target's "
                             f"width), got {type(num_classes).__name__} {num_classes!r}")
        elif num_classes > MAX_INFERRED_CLASSES:  # the models' output layer: 10**12 classes is 20 TB of weights
            raise ValueError(f"num_classes={num_classes:,} is more outputs than a model here can hold (at most "
                             f"{MAX_INFERRED_CLASSES:,}); pass the number of classes (or the target's width)")
        ds = Dataset(name, x, y, x_test, y_test, int(num_classes), tuple(x.shape[1:]))
        ends = np.cumsum([len(t) for t in ys])
        parts = Partition([np.arange(e - len(t), e) for e, t in zip(ends, ys)], name="given")
        if not regression:
            return cls(ds, parts, test_fraction=0.0, device=device)
        fed = cls.__new__(cls)
        fed.dataset, fed.partition, fed.device = ds, parts, resolve_device(device)
        fed.train_idx, fed.test_idx = list(parts), [np.zeros(0, np.int64) for _ in parts]
        fed._materialise()
        return fed

    # --- what a model and the engine need ----------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def input_shape(self) -> tuple:
        return self.dataset.input_shape

    @property
    def num_features(self) -> int:
        return self.dataset.num_features

    @property
    def sizes(self) -> np.ndarray:
        """Local training-set size n_k of every client."""
        return np.array([len(i) for i in self.train_idx])

    # --- statistics ----------------------------------------------------------------------------
    def label_histogram(self, split: str = "train") -> np.ndarray:
        """[clients, classes] counts of each label per client."""
        idx = self.train_idx if split == "train" else self.test_idx
        y = self.dataset.y_train.numpy()
        return np.stack([np.bincount(y[i], minlength=self.num_classes) for i in idx])

    def heterogeneity(self, metric: str = "emd") -> float:
        """Size-weighted mean distance between each client's label distribution and the pooled one:
        `emd` = Σ_c |p_k(c) − p(c)| (Zhao et al. 2018), `js` = Jensen–Shannon divergence (base 2, in [0, 1])."""
        h = self.label_histogram().astype(float)
        w = h.sum(1) / h.sum()
        p_k, p = h / h.sum(1, keepdims=True), h.sum(0) / h.sum()
        if metric == "emd":
            d = np.abs(p_k - p).sum(1)
        elif metric == "js":
            m = (p_k + p) / 2
            kl = lambda a, b: np.where(a > 0, a * np.log2(np.where(a > 0, a, 1) / np.where(b > 0, b, 1)), 0).sum(-1)
            d = 0.5 * kl(p_k, m) + 0.5 * kl(np.broadcast_to(p, p_k.shape), m)
        else:
            raise ValueError(f"metric must be 'emd' or 'js', got {metric!r}")
        return float((w * d).sum())

    def summary(self) -> pd.DataFrame:
        """One row per client: train/test sizes, number of classes present, dominant class share."""
        h = self.label_histogram()
        return pd.DataFrame({"client": np.arange(self.num_clients), "n_train": h.sum(1),
                             "n_test": [len(t) for t in self.test_idx], "classes": (h > 0).sum(1),
                             "top_class_share": h.max(1) / h.sum(1)})

    def plot_label_distribution(self, ax=None, max_clients: int = 50, title: str | None = None):
        """Seaborn heatmap of label counts per client (the standard non-IID picture)."""
        from ..viz import label_heatmap
        return label_heatmap(self.label_histogram()[:max_clients], ax=ax,
                             title=title or f"{self.dataset.name} · {self.partition.name} · "
                                            f"EMD {self.heterogeneity():.2f}")

    def __repr__(self) -> str:
        s = self.sizes
        return (f"FederatedDataset({self.dataset.name}, {self.partition.name}, clients={self.num_clients}, "
                f"n_k in [{s.min()}, {s.max()}], "
                + ("" if self.dataset.y_train.dtype.is_floating_point else f"EMD={self.heterogeneity():.3f}, ")
                + f"device={self.device})")


def federate(dataset: str | Dataset = "mnist5k", partition: str = "dirichlet", n_clients: int = 10, seed: int = 0,
             test_fraction: float = 0.2, device="cpu", dataset_kwargs: dict | None = None, **partition_kwargs) -> FederatedDataset:
    """Load (if a name), partition and wrap in one call:
    `federate("mnist5k", "dirichlet", n_clients=20, alpha=0.3, seed=0)`. `natural` uses the data set's groups."""
    check_seed(seed)
    ds = load_dataset(dataset, **(dataset_kwargs or {})) if isinstance(dataset, str) else dataset
    if partition == "natural":
        if ds.groups_train is None:
            raise ValueError(f"partition='natural' needs a data set with client groups (e.g. 'synthetic'); {ds.name} has none")
        parts = make_partition("natural", ds.groups_train, n_clients, **partition_kwargs)
    else:
        partition_kwargs.setdefault("seed", seed)
        parts = make_partition(partition, ds.y_train.numpy(), n_clients, **partition_kwargs)
    return FederatedDataset(ds, parts, test_fraction=test_fraction, seed=seed, device=device)
