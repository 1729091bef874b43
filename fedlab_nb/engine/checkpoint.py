"""Checkpoints: atomic writes, loading that cannot run code, and a run fingerprint that is the same in
every process (so `resume=True` works after a crash or a kernel restart)."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch


def describe(obj, depth: int = 0):
    """A canonical, address-free description of a configuration object: dataclasses by type and fields,
    functions by module and qualified name, tensors and arrays by a hash of their bytes."""
    if depth > 20:
        return "…"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return {"tensor": hashlib.sha256(obj.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16],
                "shape": list(obj.shape)}
    if isinstance(obj, np.ndarray):
        return {"array": hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()[:16], "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {str(k): describe(v, depth + 1) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [describe(v, depth + 1) for v in items]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: describe(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
        return {"type": f"{type(obj).__module__}.{type(obj).__qualname__}", **fields}
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    if isinstance(obj, torch.nn.Module):
        return repr(obj)
    attrs = {k: describe(v, depth + 1) for k, v in sorted(vars(obj).items())} if hasattr(obj, "__dict__") else str(obj)
    return {"type": f"{type(obj).__module__}.{type(obj).__qualname__}", "attrs": attrs}


def fingerprint(cfg, method, fed, model, sampler=None, attack=None, loss=None, poison=None) -> str:
    poisoned = {} if poison is None else {"poison": poison}  # runs without a poison keep their fingerprints
    text = json.dumps(describe({"cfg": dataclasses.asdict(cfg), "method": method, "dataset": fed.dataset.name,
                                "partition": fed.partition.name, "sizes": fed.sizes.tolist(), "model": repr(model),
                                "sampler": sampler, "attack": attack, "loss": loss, **poisoned}), sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_fingerprint(fed) -> str:
    """16 hex digits of the rows a run trains and evaluates on (each client's train and test x, y and the global
    test set): `fingerprint` names a data set by name and client sizes, so data given to `from_clients` or another
    partition seed of the same sizes would otherwise resume a checkpoint written on other rows."""
    h = hashlib.sha256()
    for x, y in [*fed.client_train, *fed.client_test, (fed.x_test, fed.y_test)]:
        for t in (x, y):
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def checkpoint_path(checkpoint) -> Path:
    """checkpoint= as a Path, refused when something other than a regular file is there: os.replace would put
    the checkpoint in place of a FIFO, a device (checkpoint='/dev/null' run as root) or fail on a folder."""
    path = Path(checkpoint)
    if path.exists() and not path.is_file():
        raise ValueError(f"checkpoint={str(checkpoint)!r} is not a regular file (a folder, a FIFO or a device such "
                         "as /dev/null); give the path of a file to write, or checkpoint=None for no checkpoint")
    return path


def save_checkpoint(path: Path, obj: dict) -> None:
    path = checkpoint_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a fresh temporary file (O_EXCL, random name): a link planted at a predictable name is never written through
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint intact
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CheckpointError(ValueError):
    """The checkpoint file is empty, truncated, not a checkpoint, or holds objects that could run code."""


def load_checkpoint(path: Path, device) -> dict:
    """Load with `weights_only=True` (tensors, numbers, strings, lists and dicts only: nothing is unpickled
    that could run code) and check the layout."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty; delete it (or pass resume=False) to start over")
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, OSError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read safely ({type(e).__name__}: {str(e)[:200]}); it is "
                              "truncated, foreign or holds code objects. Delete it or pass resume=False") from None
    need = {"round", "theta", "state", "rows", "fingerprint", "store"}
    if not isinstance(saved, dict) or not need <= set(saved):
        raise CheckpointError(f"checkpoint {path} is not a fedlab_nb run checkpoint (needs keys {sorted(need)}); "
                              "delete it or point checkpoint= elsewhere")
    return saved
