"""Offline data sets, partitioners and the federated view of a data set."""
from .datasets import (DATASETS, Dataset, DatasetNotAvailable, list_datasets, load_dataset)
from .federated import FederatedDataset, federate
from .partition import (PARTITIONERS, Partition, dirichlet, feature_skew, iid, long_tail, make_partition, niid2,
                        natural, pathological, quantity_skew, shards)

__all__ = ["DATASETS", "Dataset", "DatasetNotAvailable", "list_datasets", "load_dataset", "FederatedDataset",
           "federate", "PARTITIONERS", "Partition", "dirichlet", "feature_skew", "iid", "long_tail", "make_partition", "niid2",
           "natural", "pathological", "quantity_skew", "shards"]

from ..core.registry import register as _register

_register("partitions", claims="partitions", kind="module")(make_partition)
