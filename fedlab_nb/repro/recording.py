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
    """A JSON-safe copy of a scalar: numpy / torch scalars become Python ones, NaN and ±inf become None."""
    if hasattr(value, "item") and callable(value.item):  # numpy scalar, 0-d array, one-element tensor
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise TypeError(f"record({name!r}, ...) needs a single number, got an array of shape "
                            f"{tuple(getattr(value, 'shape', ()))}; reduce it first (e.g. .mean())") from None
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"record({name!r}, ...) takes a number, bool or str, got {type(value).__name__}")


def write_json_atomic(path: Path, data) -> None:
    """Write JSON through a temporary file and os.replace, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def record(name: str, value) -> None:
    """Store one metric of this run under `name` (a claim's `metric`); NaN / inf are stored as null."""
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


def save_figure(fig, name: str = "main") -> None:
    """Save a matplotlib figure (or anything with `.figure`, e.g. a seaborn grid or an Axes) for the report.

    The figure is not closed, so Jupyter still shows it inline. Without a run folder (interactive use,
    nbval) nothing is written. Returns None, so the cell shows no path."""
    if not isinstance(name, str) or not re.match(r"^[\w.-]+$", name):
        raise ValueError(f"save_figure(name=...) must be a simple file name such as 'main', got {name!r}")
    figure = fig if hasattr(fig, "savefig") else getattr(fig, "figure", None)
    if figure is None or not hasattr(figure, "savefig"):
        raise TypeError(f"save_figure needs a matplotlib Figure (or an object with .figure), got {type(fig).__name__}")
    folder = run_dir()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        figure.savefig(folder / f"{name}.png", dpi=100, bbox_inches="tight")
