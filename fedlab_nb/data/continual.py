"""Task sequences for continual federated learning: one `FederatedDataset` per task, built from the
project's loaders.

Two standard constructions (used e.g. by Bakman, Yaldiz, Ezzeldin, Avestimehr, "Federated Orthogonal
Training: Mitigating Global Catastrophic Forgetting in Continual Federated Learning", ICLR 2024, after the
centralised continual-learning literature):

- `split_tasks`: the classes of one data set cut into disjoint groups (split MNIST: 5 tasks × 2 classes);
  labels keep their original ids, so a single 10-way model sees every task.
- `permuted_tasks`: the same data set with a fixed random permutation of the input features per task
  (permuted MNIST; task 0 is the identity, the usual convention). Every task has all classes (one head).

`federate_tasks` partitions each task's training rows over the same number of clients with the project's
partitioners (a Dirichlet split within each task, a different partition seed per task), so client k of
task t and client k of task t+1 are the "same device" receiving new data.
"""
from __future__ import annotations

import numpy as np
import torch

from .datasets import Dataset, load_dataset
from .federated import FederatedDataset
from .partition import make_partition


def _dataset(dataset: str | Dataset, dataset_kwargs: dict | None) -> Dataset:
    return load_dataset(dataset, **(dataset_kwargs or {})) if isinstance(dataset, str) else dataset


def class_groups(num_classes: int, classes_per_task: int, order=None) -> list[list[int]]:
    """The class ids of each task: `order` (default 0 … C−1) cut into consecutive groups of
    `classes_per_task`; the class count must be a multiple of it."""
    if isinstance(classes_per_task, bool) or not isinstance(classes_per_task, (int, np.integer)) or classes_per_task < 1:
        raise ValueError(f"classes_per_task must be a positive int (e.g. 2 for split MNIST), got {classes_per_task!r}")
    order = list(range(num_classes)) if order is None else [int(c) for c in order]
    if sorted(order) != list(range(num_classes)):
        raise ValueError(f"order must list every class id 0 … {num_classes - 1} once, got {order}")
    if num_classes % classes_per_task:
        raise ValueError(f"{num_classes} classes do not split into tasks of {classes_per_task}; pick a divisor "
                         f"of {num_classes}")
    return [order[i:i + classes_per_task] for i in range(0, num_classes, classes_per_task)]


def split_tasks(dataset: str | Dataset = "digits", classes_per_task: int = 2, order=None,
                dataset_kwargs: dict | None = None) -> list[Dataset]:
    """One `Dataset` per class group (train and test rows of those classes only, original labels and
    class count kept). Task t's classes are in `task.meta["classes"]`."""
    ds = _dataset(dataset, dataset_kwargs)
    tasks = []
    for t, classes in enumerate(class_groups(ds.num_classes, classes_per_task, order)):
        keep = torch.tensor(classes)
        tr, te = torch.isin(ds.y_train, keep), torch.isin(ds.y_test, keep)
        tasks.append(Dataset(f"{ds.name}-split{t}", ds.x_train[tr], ds.y_train[tr], ds.x_test[te], ds.y_test[te],
                             ds.num_classes, ds.input_shape, meta={**ds.meta, "task": t, "classes": classes}))
    return tasks


def permuted_tasks(dataset: str | Dataset = "mnist5k", n_tasks: int = 5, seed: int = 0,
                   dataset_kwargs: dict | None = None) -> list[Dataset]:
    """`n_tasks` copies of the data set, task t's features permuted by a fixed permutation drawn from
    (seed, t); task 0 is the unpermuted data. The permutation is in `task.meta["permutation"]`."""
    if isinstance(n_tasks, bool) or not isinstance(n_tasks, (int, np.integer)) or n_tasks < 1:
        raise ValueError(f"n_tasks must be a positive int, got {n_tasks!r}")
    ds = _dataset(dataset, dataset_kwargs)
    d, tasks = ds.num_features, []
    for t in range(n_tasks):
        perm = np.arange(d) if t == 0 else np.random.default_rng([seed, 47, t]).permutation(d)
        p = torch.as_tensor(perm)
        tasks.append(Dataset(f"{ds.name}-perm{t}", ds.x_train[:, p], ds.y_train, ds.x_test[:, p], ds.y_test,
                             ds.num_classes, ds.input_shape, meta={**ds.meta, "task": t, "permutation": perm}))
    return tasks


def federate_tasks(tasks: list[Dataset], partition: str = "dirichlet", n_clients: int = 5, seed: int = 0,
                   test_fraction: float = 0.2, device="cpu", **partition_kwargs) -> list[FederatedDataset]:
    """Each task's training rows partitioned over `n_clients` clients (partition seed seed·1000 + t, so
    tasks differ but a run is repeatable); the global test set of task t is its own test split."""
    if not tasks:
        raise ValueError("tasks is empty; build it with split_tasks(...) or permuted_tasks(...)")
    feds = []
    for t, task in enumerate(tasks):
        kw = {"seed": 1000 * seed + t, **partition_kwargs}
        parts = make_partition(partition, task.y_train.numpy(), n_clients, **kw)
        feds.append(FederatedDataset(task, parts, test_fraction=test_fraction, seed=1000 * seed + t, device=device))
    return feds
