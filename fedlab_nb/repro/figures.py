"""The numbers behind a saved figure, its smoke-scale reference, and the comparison CI makes.

`repro.save_figure(fig, name, data)` writes `<run dir>/<name>.data.json`: a list of series, each
`{"key", "kind", "values", ...}` taken from `data` when given, else from the matplotlib figure (lines, bars,
images / heatmaps, scatter offsets). `papers/figures/<paper id>.json` holds the smoke-scale reference;
`compare_figures` says which series moved beyond the tolerance of papers/SCHEMA.md ("Figures").
Pixel comparison is not the goal (it breaks across matplotlib versions): the plotted numbers are.

A reference is recorded on one CPU kind (torch's kernel dispatch level, e.g. AVX512 or AVX2: it fixes the
summation order, so a chaotic run can end elsewhere on another kind). `by_cpu` holds runs recorded on other
kinds; a run is compared with the reference of its own kind when there is one, else with the main one.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from .claims import ReproError
from .recording import run_dir, write_json_atomic
from .runner import reproduce

DATA_SUFFIX = ".data.json"
DEFAULT_TOLERANCE = {"rtol": 0.02, "atol": 1e-3}
SPREAD_FACTOR = 4.0  # standard errors of the difference of two n-seed means allowed per point


class FigureDataError(ReproError, ValueError):
    """A reference or run figure-data file cannot be read."""


# ---------------------------------------------------------------------------------------------- series
def _numbers(values) -> list:
    """Flat list of floats, NaN / ±inf / masked as None (JSON has no NaN)."""
    arr = np.ma.masked_invalid(np.ma.asarray(values, dtype=float)).ravel()
    return [None if m else float(v) for v, m in zip(arr.data, np.ma.getmaskarray(arr))]


def _series(key: str, kind: str, values, label: str | None = None, x=None, **extra) -> dict:
    values = np.ma.asarray(values, dtype=float)
    entry = {"key": key, "kind": kind, "label": label, "values": _numbers(values)}
    if values.ndim > 1:
        entry["shape"] = list(values.shape)
    if x is not None:
        entry["x"] = _numbers(x)
    entry.update(extra)
    return entry


def _label(artist) -> str | None:
    label = artist.get_label() if hasattr(artist, "get_label") else None
    return label if label and not str(label).startswith("_") else None  # '_child3' is matplotlib's default


def _key(axes_index: int, kind: str, index: int, label: str | None) -> str:
    return f"ax{axes_index}/{kind}{index}" + (f":{label}" if label else "")


def _unjittered(ax, points) -> np.ndarray:
    """Scatter offsets with categorical coordinates rounded to their category: seaborn's stripplot jitter
    is random and not data."""
    from matplotlib.category import UnitData
    offsets = np.ma.array(points.get_offsets(), dtype=float)
    for column, axis in enumerate((ax.xaxis, ax.yaxis)):
        if isinstance(getattr(axis, "units", None), UnitData) and offsets.ndim == 2 and len(offsets):
            offsets[:, column] = np.round(offsets[:, column])
    return offsets


def _axes_series(i: int, ax) -> list[dict]:
    from matplotlib.collections import PathCollection, QuadMesh
    from matplotlib.container import BarContainer
    out = []
    for j, line in enumerate(ax.lines):
        x, y = line.get_data()
        out.append(_series(_key(i, "line", j, _label(line)), "line", y, _label(line), x=x))
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    for j, bar in enumerate(bars):
        horizontal = getattr(bar, "orientation", "vertical") == "horizontal"
        sizes = [p.get_width() if horizontal else p.get_height() for p in bar.patches]
        where = [p.get_y() + p.get_height() / 2 if horizontal else p.get_x() + p.get_width() / 2 for p in bar.patches]
        out.append(_series(_key(i, "bar", j, _label(bar)), "bar", sizes, _label(bar), x=where))
    for j, image in enumerate(ax.images):
        out.append(_series(_key(i, "image", j, _label(image)), "image", image.get_array(), _label(image)))
    scatter = [c for c in ax.collections if isinstance(c, PathCollection)]
    for j, points in enumerate(scatter):
        out.append(_series(_key(i, "scatter", j, _label(points)), "scatter", _unjittered(ax, points), _label(points)))
    meshes = [c for c in ax.collections if isinstance(c, QuadMesh)]  # pcolormesh, seaborn heatmap
    for j, mesh in enumerate(meshes):
        out.append(_series(_key(i, "mesh", j, _label(mesh)), "mesh", mesh.get_array(), _label(mesh)))
    return out


def extract_figure_data(figure) -> list[dict]:
    """Series of every axes of a matplotlib figure, keyed `ax<i>/<kind><j>[:label]` in drawing order.
    Colorbars are skipped: their gradient is drawn by matplotlib, not data."""
    axes = [ax for ax in figure.axes if ax.get_label() != "<colorbar>" and not hasattr(ax, "_colorbar")]
    return [s for i, ax in enumerate(axes) for s in _axes_series(i, ax)]


def _data_entry(name: str, value) -> dict:
    """One `data=` entry: a 1-D sequence, a seeds × points array (-> mean, sd, n), or {mean, sd, n}."""
    if isinstance(value, dict):
        unknown = set(value) - {"mean", "sd", "n", "x"}
        if unknown or "mean" not in value:
            raise ValueError(f"save_figure(data={{{name!r}: ...}}) takes {{'mean': [...], 'sd': [...], 'n': N, "
                             f"'x': [...]}} (sd, n, x optional); got keys {sorted(value)}")
        extra = {"sd": _numbers(value["sd"]), "n": int(value.get("n", 0)) or None} if "sd" in value else {}
        return _series(name, "data", value["mean"], name, x=value.get("x"), **extra)
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 2 and arr.shape[0] >= 2:  # rows are seeds
        return _series(name, "data", arr.mean(axis=0), name, sd=_numbers(arr.std(axis=0, ddof=1)), n=arr.shape[0])
    if arr.ndim != 1:
        raise ValueError(f"save_figure(data={{{name!r}: ...}}) needs a 1-D sequence or a seeds × points array, "
                         f"got shape {arr.shape}")
    return _series(name, "data", arr, name)


def data_series(data) -> list[dict]:
    """Series from `save_figure(..., data=...)`: a dict name -> values, or a pandas DataFrame (numeric columns)."""
    if hasattr(data, "select_dtypes") and hasattr(data, "columns"):  # a DataFrame, without importing pandas
        data = {str(c): data[c].to_numpy() for c in data.select_dtypes("number").columns}
    if not isinstance(data, dict) or not data:
        raise TypeError(f"save_figure(data=...) takes a non-empty dict of name -> numbers or a pandas DataFrame, "
                        f"got {type(data).__name__}")
    try:
        return [_data_entry(str(name), value) for name, value in data.items()]
    except (TypeError, ValueError) as e:
        if "save_figure" in str(e):
            raise
        raise TypeError(f"save_figure(data=...): values must be numbers ({e})") from None


def cpu_kind() -> str:
    """torch's CPU kernel dispatch level (AVX512, AVX2, DEFAULT, ...; ATEN_CPU_CAPABILITY can lower it)."""
    try:
        import torch
        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        return "unknown"


def figure_payload(figure, name: str, data=None) -> dict:
    source, series = ("data", data_series(data)) if data is not None else ("figure", extract_figure_data(figure))
    return {"figure": name, "source": source, "cpu": cpu_kind(), "series": series}


def write_figure_data(folder: Path, name: str, payload: dict) -> Path:
    path = Path(folder) / f"{name}{DATA_SUFFIX}"
    write_json_atomic(path, payload)
    return path


MAX_FIGURE_BYTES = 64 << 20  # a figure's data or a paper's reference is kilobytes; anything this large is not one


def _read_json(path: Path, fix: str):
    """The JSON in `path`, a regular file of at most MAX_FIGURE_BYTES (a FIFO or a device is refused without
    blocking); a FigureDataError naming the file and `fix` when it is not one, not UTF-8, not JSON or too deep."""
    from .files import UnsafePathError, read_regular
    try:
        return json.loads(read_regular(path, MAX_FIGURE_BYTES).decode("utf-8"))
    except UnsafePathError as e:
        raise FigureDataError(f"{e}; {fix}") from None
    except UnicodeDecodeError as e:
        raise FigureDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except RecursionError:
        raise FigureDataError(f"{path}: JSON nested too deeply to read; {fix}") from None
    except ValueError as e:  # json.JSONDecodeError, and an integer too long to convert
        raise FigureDataError(f"{path}: not valid JSON ({str(e)[:200]}); {fix}") from None


def _finite(v) -> bool:
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer beyond a float's range
        return False


def _is_number_list(value, allow_none: bool = True) -> bool:
    """A list of finite numbers (None marks a missing point): NaN, inf and 1e999 are no figure data (the notebook's
    save_figure stores them as null) and could not be written back as strict JSON."""
    return isinstance(value, list) and all((v is None and allow_none) or _finite(v) for v in value)


def _figures_problem(figures) -> str | None:
    """What is wrong with a {figure name: payload} mapping's form (None when every payload has a `series` list
    of {key: str, values: [numbers or null], x/sd: optional such lists, n: optional number}), in words."""
    if not isinstance(figures, dict):
        return f"the figures are a {type(figures).__name__}, not a mapping"
    for name, payload in figures.items():
        if not isinstance(payload, dict) or not isinstance(payload.get("series"), list):
            return f"figure {name!r} has no 'series' list"
        for i, series in enumerate(payload["series"]):
            if not isinstance(series, dict) or not isinstance(series.get("key"), str):
                return f"figure {name!r}: series {i} is not a mapping with a string 'key'"
            if not _is_number_list(series.get("values")):
                return f"figure {name!r}: series {i} has no 'values' list of numbers"
            for field in ("x", "sd"):
                if series.get(field) is not None and not _is_number_list(series[field]):
                    return f"figure {name!r}: series {i} has an '{field}' that is not a list of numbers"
            n = series.get("n")
            if n is not None and (isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n)):
                return f"figure {name!r}: series {i} has an 'n' that is not a number"
    return None


def run_figures(run_dir) -> dict:
    """{figure name: payload} of every `<name>.data.json` in a run folder."""
    out = {}
    for path in sorted(Path(run_dir).glob(f"*{DATA_SUFFIX}")):
        payload = _read_json(path, "re-run the notebook (or remove the file)")
        if (problem := _figures_problem({path.name[:-len(DATA_SUFFIX)]: payload})) is not None:
            raise FigureDataError(f"{path}: {problem}; re-run the notebook (or remove the file)")
        out[path.name[:-len(DATA_SUFFIX)]] = payload
    return out


# ---------------------------------------------------------------------------------------------- reference
def reference_path(paper_id: str, root) -> Path:
    return Path(root) / "papers" / "figures" / f"{paper_id}.json"


def load_reference(paper_id: str, root) -> dict | None:
    path = reference_path(paper_id, root)
    if not path.is_file():
        return None
    data = _read_json(path, f"regenerate it with `fedlab-nb figures update {paper_id}`")
    if not isinstance(data, dict) or not isinstance(data.get("figures"), dict):
        raise FigureDataError(f"{path}: no 'figures' mapping; regenerate it with `fedlab-nb figures update {paper_id}`")
    by_cpu = data.get("by_cpu", {})
    if not isinstance(by_cpu, dict) or not all(isinstance(v, dict) and isinstance(v.get("figures"), dict)
                                               for v in by_cpu.values()):
        raise FigureDataError(f"{path}: 'by_cpu' must map a CPU kind to {{'figures': {{...}}}}; regenerate it with "
                              f"`fedlab-nb figures update {paper_id}` on each CPU kind")
    for figures in [data["figures"], *(v["figures"] for v in by_cpu.values())]:
        if (problem := _figures_problem(figures)) is not None:
            raise FigureDataError(f"{path}: {problem}; regenerate it with `fedlab-nb figures update {paper_id}`")
    return data


def run_cpu(figures: dict) -> str:
    """The CPU kind a run's figure data was made on (this machine's for data saved before it was recorded)."""
    kinds = {p.get("cpu") for p in figures.values() if isinstance(p, dict) and p.get("cpu")}
    return kinds.pop() if len(kinds) == 1 else cpu_kind()


def reference_for(reference: dict, cpu: str) -> tuple[dict, str]:
    """(figures, the CPU kind they were recorded on) to compare a run made on `cpu` with."""
    variant = reference.get("by_cpu", {}).get(cpu)
    if variant is not None:
        return variant["figures"], cpu
    return reference["figures"], reference.get("cpu", "unknown")


def write_reference(paper_id: str, root, figures: dict, parameters: dict, cpu: str, by_cpu: dict | None = None) -> Path:
    path = reference_path(paper_id, root)
    base = Path(root).resolve()
    if not path.parent.resolve().is_relative_to(base):  # papers/figures linked out of the repository
        raise FigureDataError(f"{path.parent} is a link to {path.parent.resolve()}, outside the repository {base}; "
                              "fedlab-nb writes references only inside it: replace the link with a folder")
    body = {"paper": paper_id, "scale": "smoke", "parameters": parameters, "cpu": cpu, "figures": figures}
    if by_cpu:
        body["by_cpu"] = by_cpu
    write_json_atomic(path, body)
    return path


# ---------------------------------------------------------------------------------------------- comparison
def point_tolerance(ref: dict, i: int, ref_value: float, tol: dict) -> float:
    """atol + rtol·|ref| + SPREAD_FACTOR · sd · √(2/n) (the last term only where the series stores sd and n)."""
    allowed = tol["atol"] + tol["rtol"] * abs(ref_value)
    sd, n = ref.get("sd"), ref.get("n")
    if sd and n and i < len(sd) and sd[i] is not None:
        allowed += SPREAD_FACTOR * sd[i] * math.sqrt(2 / n)
    return allowed


def _allowed(field: str, ref_series: dict, i: int, ref_value: float, tol: dict) -> float:
    if field == "values":
        return point_tolerance(ref_series, i, ref_value, tol)
    return tol["atol"] + tol["rtol"] * abs(ref_value)  # x positions carry no seed spread


def _compare_values(key: str, field: str, new: list, ref: list, ref_series: dict, tol: dict) -> list[str]:
    """One line for the worst point beyond tolerance (or a length / NaN mismatch), else nothing."""
    if len(new) != len(ref):
        return [f"{key}: {field} has {len(new)} points, reference {len(ref)}"]
    worst = None
    for i, (a, b) in enumerate(zip(new, ref)):
        if (a is None) != (b is None):
            return [f"{key}: {field}[{i}] is {a}, reference {b}"]
        if a is None:
            continue
        allowed = _allowed(field, ref_series, i, b, tol)
        if abs(a - b) > allowed and (worst is None or abs(a - b) - allowed > worst[0]):
            worst = (abs(a - b) - allowed, i, a, b, allowed)
    if worst is None:
        return []
    _, i, a, b, allowed = worst
    return [f"{key}: {field}[{i}] = {a:.6g}, reference {b:.6g} (|Δ| {abs(a - b):.3g} > tolerance {allowed:.3g})"]


def compare_series(new: dict, ref: dict, tol: dict) -> list[str]:
    problems = []
    if new.get("shape") != ref.get("shape"):
        problems.append(f"{ref['key']}: shape {new.get('shape')}, reference {ref.get('shape')}")
    problems += _compare_values(ref["key"], "values", new["values"], ref["values"], ref, tol)
    if ref.get("x") is not None or new.get("x") is not None:
        problems += _compare_values(ref["key"], "x", new.get("x") or [], ref.get("x") or [], ref, tol)
    return problems


def compare_figures(new: dict, ref: dict, tolerance: dict | None = None) -> list[str]:
    """Problems between {figure: payload} mappings (missing / extra figures or series, points out of tolerance)."""
    tol = {**DEFAULT_TOLERANCE, **(tolerance or {})}
    problems = [f"figure {name!r}: in the reference, not saved by this run" for name in sorted(set(ref) - set(new))]
    problems += [f"figure {name!r}: saved by this run, not in the reference" for name in sorted(set(new) - set(ref))]
    for name in sorted(set(new) & set(ref)):
        new_series = {s["key"]: s for s in new[name]["series"]}
        ref_series = {s["key"]: s for s in ref[name]["series"]}
        problems += [f"figure {name!r}: series {k!r} missing" for k in sorted(set(ref_series) - set(new_series))]
        problems += [f"figure {name!r}: new series {k!r}" for k in sorted(set(new_series) - set(ref_series))]
        for key in sorted(set(new_series) & set(ref_series)):
            problems += [f"figure {name!r}: {p}" for p in compare_series(new_series[key], ref_series[key], tol)]
    return problems


def changes(new: dict, ref: dict | None) -> list[str]:
    """What regenerating the reference changes, one line per figure / series (exact, not within tolerance)."""
    if ref is None:
        return [f"new reference: figure {name!r} with {len(p['series'])} series" for name, p in sorted(new.items())]
    exact = compare_figures(new, ref, {"rtol": 0.0, "atol": 0.0})
    lines = [p for p in exact if "in the reference" in p or "not in the reference" in p or "missing" in p
             or "new series" in p]
    moved = {p for p in exact if p not in lines}
    lines += sorted(moved)
    return lines or ["no change"]


def figure_problems(paper, run_dir) -> list[str] | None:
    """Problems of a run's figure data against papers/figures/<id>.json (the reference of the run's CPU kind
    when recorded, else the main one; the last line then says so); None when there is no reference yet."""
    reference = load_reference(paper.id, paper.root)
    if reference is None:
        return None
    new = run_figures(run_dir)
    cpu = run_cpu(new)
    figures, recorded_on = reference_for(reference, cpu)
    problems = compare_figures(new, figures, getattr(paper, "figure_tolerance", None))
    if problems and recorded_on != cpu:
        problems.append(f"(this run: CPU kind {cpu}; the reference was recorded on {recorded_on}: if the change comes "
                        f"from the CPU alone, record this kind's run with `fedlab-nb figures update {paper.id}` here)")
    return problems


def save_figure(fig, name: str = "main", data=None) -> None:
    """Save a matplotlib figure (or anything with `.figure`, e.g. a seaborn grid or an Axes) for the report,
    and the numbers it shows as `<name>.data.json` (compared with papers/figures/<id>.json by the tests).

    `data` (optional) gives those numbers instead of reading them off the figure: a dict of name -> 1-D
    sequence, name -> seeds × points array (stores mean, sd and n per point), or a pandas DataFrame; pass it
    when the figure shows a mean over seeds. The figure is not closed, so Jupyter still shows it inline.
    Without a run folder (interactive use, nbval) nothing is written. Returns None, so the cell shows no path."""
    if not isinstance(name, str) or not re.match(r"^[\w.-]+$", name):
        raise ValueError(f"save_figure(name=...) must be a simple file name such as 'main', got {name!r}")
    figure = fig if hasattr(fig, "savefig") else getattr(fig, "figure", None)
    if figure is None or not hasattr(figure, "savefig"):
        raise TypeError(f"save_figure needs a matplotlib Figure (or an object with .figure), got {type(fig).__name__}")
    if data is not None:
        data_series(data)  # a bad `data` fails interactively too, not only under the runner
    folder = run_dir()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        figure.savefig(folder / f"{name}.png", dpi=100, bbox_inches="tight")
        write_figure_data(folder, name, figure_payload(figure, name, data))


# ---------------------------------------------------------------------------------------------- CLI helpers
def smoke_run_dir(paper_id: str, root, out_dir, from_dir=None) -> Path:
    """The run folder whose figure data to use: `from_dir`, else a smoke `reproduce` (re-run when the
    up-to-date result predates figure data)."""
    if from_dir is not None:
        folder = Path(from_dir)
    else:
        result = reproduce(paper_id, "smoke", out_dir=out_dir, root=root)
        if result.get("skipped") and not result.get("figure_data"):
            result = reproduce(paper_id, "smoke", force=True, out_dir=out_dir, root=root)
        if result["error"]:
            e = result["error"]
            raise ReproError(f"{paper_id}: the smoke run failed in cell {e['cell']}: {e['ename']}: {e['evalue']}")
        folder = Path(out_dir) / f"{paper_id}-smoke"
    if not run_figures(folder):
        raise ReproError(f"{folder}: no *{DATA_SUFFIX} files; the notebook must save its figures with "
                         "repro.save_figure(fig, ...) while run by fedlab-nb")
    return folder


def update_reference(paper, out_dir, from_dir=None) -> tuple[Path, list[str]]:
    """Regenerate papers/figures/<id>.json from a smoke run; returns (path, what changed). A run on the CPU kind
    of the main reference (or a first run) replaces the main reference and drops the other kinds' runs (they
    were recorded against the old one); a run on another kind is stored under `by_cpu`, the rest kept."""
    folder = smoke_run_dir(paper.id, paper.root, out_dir, from_dir)
    new = run_figures(folder)
    cpu = run_cpu(new)
    old = load_reference(paper.id, paper.root)
    parameters = dict(paper.scales["smoke"]["parameters"])
    if old is None or old.get("cpu", cpu) == cpu:
        lines = changes(new, None if old is None else old["figures"])
        dropped = sorted((old or {}).get("by_cpu", {}))
        lines += [f"dropped the {kind} run (recorded against the old reference); record it again with "
                  f"`fedlab-nb figures update {paper.id}` on such a CPU" for kind in dropped]
        return write_reference(paper.id, paper.root, new, parameters, cpu), lines
    by_cpu = dict(old.get("by_cpu", {}))
    lines = [f"CPU kind {cpu} (the main reference: {old['cpu']}):"] + changes(new, by_cpu.get(cpu, {}).get("figures"))
    by_cpu[cpu] = {"figures": new}
    return write_reference(paper.id, paper.root, old["figures"], old.get("parameters", {}), old["cpu"], by_cpu), lines
