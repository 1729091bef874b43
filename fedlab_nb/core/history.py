"""`History`: one row per round, a pandas DataFrame that saves and loads."""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ["round", "n_sampled", "train_loss", "test_loss", "test_acc", "client_acc_mean", "client_acc_std",
           "client_acc_p10", "bytes_up", "bytes_down"]
# personal-model columns (personal_acc_mean/std/p10) appear for methods whose clients keep their own model


def per_client_columns(**series) -> dict:
    """History columns `<name><k>` for per-client vectors, e.g. per_client_columns(ida_w=w) -> {"ida_w0": ...}:
    what a rule's `metrics(state)` returns to log one value per client each round (NaN where absent)."""
    return {f"{name}{k}": float(v) for name, values in series.items() for k, v in enumerate(values)}


class History(pd.DataFrame):
    """A DataFrame with columns `METRICS` (NaN where a round was not evaluated) and `.meta` (the run's
    configuration). `final("test_acc")` is the last evaluated value."""
    _metadata = ["meta", "theta", "model", "store", "client_acc", "state"]  # theta/model: final flat parameters and module of a run

    @property
    def _constructor(self):
        return History

    @classmethod
    def from_rows(cls, rows: list[dict], meta: dict | None = None) -> "History":
        frame = pd.DataFrame(rows, columns=METRICS if not rows else None)
        known = [c for c in METRICS if c in frame.columns]
        h = cls(frame[known + [c for c in frame.columns if c not in known]])  # a stable column order
        h.meta = dict(meta or {})
        return h

    def final(self, metric: str = "test_acc") -> float:
        vals = self[metric].dropna()
        if vals.empty:
            raise ValueError(f"no evaluated value of {metric!r} in this History")
        return float(vals.iloc[-1])

    def privacy(self) -> tuple[float, float] | None:
        """The final (ε, δ) of a differentially private run (columns `epsilon`, `dp_delta`), else None: the last
        row's ε (an earlier round's ε does not bound the rounds after it)."""
        if "epsilon" not in self.columns or self["epsilon"].dropna().empty:
            return None
        text = [c for c in ("round", "epsilon", "dp_delta") if c in self.columns and not _numeric(self[c])]
        if text:  # '1', 'x' would be ordered as text and the last row read as the guarantee
            raise ValueError(f"the {', '.join(text)} column holds values that are not numbers: not rows that "
                             "History.save wrote, so they state no guarantee")
        if "round" in self.columns and not self["round"].is_monotonic_increasing:
            raise ValueError("the rows are not in round order: the last row's epsilon need not be the final one; "
                             "sort the rows by round (or save the History again)")
        spent = self["epsilon"].dropna()
        if not spent.is_monotonic_increasing:  # an accountant's running total never falls
            raise ValueError("epsilon falls from one round to a later one: not an accountant's running total, so "
                             "the last value is no guarantee for the whole run")
        epsilon = float(self["epsilon"].iloc[-1])
        if math.isnan(epsilon):
            raise ValueError(f"the last round's epsilon is missing (round {len(self)}): an earlier round's epsilon does "
                             "not bound the rounds after it, so this History states no guarantee")
        delta = self.final("dp_delta") if "dp_delta" in self.columns and not self["dp_delta"].dropna().empty else float("nan")
        if epsilon < 0 or not (math.isnan(delta) or 0 <= delta < 1):  # no privacy level: not an accountant's output
            raise ValueError(f"(epsilon, delta) = ({epsilon:g}, {delta:g}) is no privacy level (epsilon >= 0, "
                             "0 <= delta < 1): these rows state no guarantee")
        return epsilon, delta

    def summary(self) -> str:
        """A few lines: what ran, the final accuracy, the bytes sent, and (ε, δ) for a private run."""
        meta = getattr(self, "meta", {}) or {}
        lines = [f"{meta.get('method', '?')} on {meta.get('dataset', '?')} ({meta.get('partition', '?')}, "
                 f"{meta.get('clients', '?')} clients): {len(self)} rounds, seed {meta.get('seed', '?')}"]
        for col in ("test_acc", "client_acc_mean", "personal_acc_mean"):
            if col in self.columns and not self[col].dropna().empty:
                lines.append(f"  final {col} = {self.final(col):.4f}")
        if "bytes_up" in self.columns:
            up, down = (_byte_total(self, col) for col in ("bytes_up", "bytes_down"))
            lines.append(f"  bytes up {up:,}, down {down:,}")
        priv = self.privacy()
        if priv is not None:
            lines.append(_privacy_line(*priv, len(self)))
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """CSV of the rows plus a `.json` beside it holding `meta` (run.csv → run.json; run_lr0.1 → run_lr0.1.json)."""
        path = Path(path)
        if path.suffix.lower() == ".json":  # a .json name reads as the metadata's, not the rows'
            raise ValueError(f"History.save({str(path)!r}): the rows are a CSV and the metadata goes beside them as "
                             f"{path.stem}.json; save to {path.with_suffix('.csv').name!r}")
        _refuse_shared_metadata(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = json.dumps(getattr(self, "meta", {}), indent=1, default=str)
        for target in (path, meta_path(path)):  # refuse a link at either before writing anything
            _refuse_link(target)
        before = path.read_bytes() if path.is_file() else None  # the rows the old metadata describes
        _write_atomic(path, pd.DataFrame(self).to_csv(index=False))
        try:
            _write_atomic(meta_path(path), meta)
        except BaseException:  # stopped between the two files: put the old rows back beside the old metadata
            with contextlib.suppress(OSError, ValueError):  # best effort: the first error is the one to report
                path.unlink() if before is None else _write_atomic(path, before)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> "History":
        path = Path(path)
        h = cls(pd.read_csv(path))
        meta_file = meta_path(path)
        h.meta = _read_meta(meta_file) if meta_file.exists() else {}
        return h


def _byte_total(h: "History", col: str) -> int:
    """The sum of a byte column as an integer; inf, NaN or a sum past a float's range is a ValueError naming it."""
    total = h[col].sum()
    if isinstance(total, (float, np.floating)) and not math.isfinite(total):
        raise ValueError(f"column {col!r} sums to {total}: byte counts must be finite numbers")
    return int(total)


def _privacy_line(epsilon: float, delta: float, rounds: int) -> str:
    """The summary's (ε, δ) line; ε = inf is no guarantee and is said so, a negative or NaN ε is not a privacy level."""
    if not epsilon >= 0:
        raise ValueError(f"the last epsilon is {epsilon}: not a privacy level (ε >= 0)")
    if epsilon == math.inf:
        return f"  privacy: no finite guarantee (epsilon is infinite) after {rounds} rounds"
    if not (0 <= delta < 1 or math.isnan(delta)):  # δ >= 1 allows anything; a negative δ is no probability
        raise ValueError(f"the last dp_delta is {delta}: not a privacy level (0 <= δ < 1)")
    return f"  privacy: (epsilon = {epsilon:.3g}, delta = {delta:.3g}) after {rounds} rounds"


def _numeric(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column) \
        and not pd.api.types.is_complex_dtype(column)


def meta_path(path: Path) -> Path:
    """The metadata file of a saved History: run.csv → run.json, run → run.json; a name whose last dot is not an
    extension keeps it (run_lr0.1 → run_lr0.1.json, so run_lr0.05's metadata is another file)."""
    return path.with_suffix(".json") if path.suffix.lower() in ("", ".csv") else path.with_name(path.name + ".json")


def _refuse_shared_metadata(path: Path) -> None:
    """run and run.csv both keep their metadata in run.json: saving one while the other is there would replace
    the other's metadata."""
    meta = meta_path(path)
    stem = meta.name[: -len(".json")]  # every name whose metadata is this file: stem, stem.csv in any case
    names = {stem.lower(), f"{stem}.csv".lower()}
    twins = [t for t in path.parent.iterdir() if t.name.lower() in names] if path.parent.is_dir() else []
    for twin in (t for t in twins if t != path and meta_path(t) == meta and t.is_file() and meta.exists()):
        raise ValueError(f"{meta_path(path)} holds the metadata of {twin} already; saving {path.name} would "
                         f"replace it: save to another name, or to {twin.name} to replace that run")


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); History.save does not write through "
                         "links: remove it or save to another path")
    if path.exists() and not path.is_file():  # os.replace would put the file in place of a FIFO or a device
        raise ValueError(f"{path} is not a regular file (a folder, a FIFO or a device such as /dev/null); "
                         "History.save replaces the file at its path: save to another path")


def _write_atomic(path: Path, text: str | bytes) -> None:
    """Write `text` (UTF-8) or bytes as they are (an old file put back) to a temporary file beside `path`, then
    os.replace it: a symbolic or hard link at `path` is replaced, never written through (core's twin of
    repro.files.write_atomic; the layers keep them apart)."""
    _refuse_link(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode("utf-8"))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a saved History is an ordinary user file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


MAX_META_BYTES = 16 << 20  # History.save writes a few kB of run settings


def _read_bounded(path: Path, limit: int, fix: str) -> bytes:
    """path's bytes when it is a regular file of at most `limit` bytes: opened without blocking and checked on
    the open descriptor, so a FIFO (st_size 0) or a link to /dev/zero is refused, not read; else a ValueError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked before fdopen, which refuses a folder's descriptor
        os.close(fd)
        raise ValueError(f"{path} is not a regular file (a folder, a FIFO or a device), not History metadata; {fix}")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path} is over {limit >> 20} MB, not History metadata; {fix}")
    return raw


def _read_meta(meta_file: Path) -> dict:
    """The run settings History.save wrote beside the CSV: a JSON object, else a ValueError naming the file."""
    fix = "delete it (the rows load without it) or write it again with History.save"
    raw = _read_bounded(meta_file, MAX_META_BYTES, fix)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{meta_file} is not valid UTF-8 JSON ({str(e).splitlines()[0][:120]}); {fix}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file} holds a JSON {type(meta).__name__}, not an object of run settings; {fix}")
    return meta
