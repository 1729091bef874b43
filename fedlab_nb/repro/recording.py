"""Recording metrics and figures from inside a notebook.

The runner sets `FEDLAB_NB_RUN_DIR` before starting the kernel (the kernel inherits the environment);
`record` then keeps `<dir>/metrics.json` up to date and `save_figure` writes `<dir>/<name>.png`.
Without that variable (plain Jupyter, nbval) values stay in memory and nothing is written.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

RUN_DIR_ENV = "FEDLAB_NB_RUN_DIR"
METRICS_FILE = "metrics.json"
_NAME = re.compile(r"^[A-Za-z_]\w*$")

_metrics: dict[str, object] = {}  # this kernel's recorded metrics


def run_dir() -> Path | None:
    """The folder the runner asked us to write into, or None in an interactive session."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def to_json_value(value, name: str = "value"):
    """A JSON-safe copy of a scalar or of a 1-D sequence of numbers (one per seed): numpy / torch values
    become Python ones, NaN and ±inf become None."""
    if _is_sequence(value):
        return per_seed_values(value, name)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar, 0-d array, one-element tensor
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise TypeError(f"record({name!r}, ...) needs a single number or a 1-D sequence (one value per "
                            f"seed), got an array of shape {tuple(getattr(value, 'shape', ()))}; "
                            "reduce it first (e.g. .mean(axis=1))") from None
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"record({name!r}, ...) takes a number, bool, str or a 1-D sequence of numbers, "
                    f"got {type(value).__name__}")


def _is_sequence(value) -> bool:
    """A list / tuple, or an array / tensor of more than one element (one-element ones stay scalars, as
    before per-seed lists existed; a per-seed list has at least 5 values anyway)."""
    if isinstance(value, (list, tuple)):
        return True
    shape = getattr(value, "shape", None)
    size = math.prod(tuple(shape)) if shape is not None else 0
    return shape is not None and len(tuple(shape)) >= 1 and size != 1 and hasattr(value, "tolist")


def per_seed_values(value, name: str = "value") -> list:
    """A 1-D sequence of numbers as a list of floats / ints (NaN, ±inf -> None), one entry per seed."""
    shape = tuple(getattr(value, "shape", (len(value),)))
    if len(shape) != 1:
        raise TypeError(f"record({name!r}, ...) takes a 1-D sequence (one value per seed), got shape {shape}; "
                        "record each curve's final value, or reduce the extra axis first")
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if not items:
        raise ValueError(f"record({name!r}, ...) got an empty sequence; record one value per seed")
    out = []
    for i, item in enumerate(items):
        item = item.item() if hasattr(item, "item") and callable(item.item) else item
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise TypeError(f"record({name!r}, [...]) needs numbers, got {item!r} at index {i}")
        out.append(item if isinstance(item, int) or math.isfinite(item) else None)
    return out


def write_json_atomic(path: Path, data) -> None:
    """Write JSON through a temporary file and os.replace, so readers never see half a file."""
    import tempfile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    # a fresh temporary file (O_EXCL, random name): a link planted at a predictable name is never written through
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        Path(tmp).write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; metrics, results and references are ordinary files
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def record(name: str, value) -> None:
    """Store one metric of this run under `name` (a claim's `metric`); NaN / inf are stored as null.

    `value` is a number, bool or str, or a 1-D sequence of numbers (list, numpy array, 1-D tensor) holding
    one value per seed, for claims with `seeds: N` in the claims file."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"record(name=...) must be an identifier such as 'final_acc', got {name!r}")
    _metrics[name] = to_json_value(value, name)
    folder = run_dir()
    if folder is not None:
        path = folder / METRICS_FILE
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored[name] = _metrics[name]
        write_json_atomic(path, stored)


def recorded() -> dict:
    """A copy of the metrics recorded in this session."""
    return dict(_metrics)
