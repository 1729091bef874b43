"""Run a paper's notebook with papermill and turn its recorded metrics into a result file.

    run_notebook(id, scale)  -> executed notebook, parameters.json, figures + metrics in their own folder
                                results/runs/<id>-<scale>-<name>=<value>_...-<8 hex of the parameters>/
                                (never reproduce's files)
    reproduce(id, scale)     -> the above + claim verdicts in results/<id>-<scale>.json (skipped when a
                                result with the same notebook, claims file and parameters exists and its outputs are untouched)
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import nbformat

from .claims import (ERROR, ROOT_ENV, PACKAGE_ROOT, Paper, ReproError, default_root, judge_detail, load_paper,
                     SCALE_NAME, role_counts, headline_verdict, report_values)
from .files import UnsafePathError, make_folder, publish, recover_run, refuse_link, run_lock, staging, user_path
from .recording import METRICS_FILE, RUN_DIR_ENV, write_json_atomic
from .results import StaleResultWarning, file_digest, printable, read_result, safe_output

KERNEL = "python3"
_NO_DEFAULT = object()  # a parameter whose default is not a literal: any type accepted


class ParameterError(ReproError, ValueError):
    exit_code = 2


# ---------------------------------------------------------------------------------------------- parameters
def _parameters_cell(notebook: Path) -> tuple[str, list[ast.stmt]] | None:
    """(source, statements) of the notebook's code cell tagged `parameters`, None without one; a notebook that
    cannot be read or parsed raises a one-line ReproError naming it."""
    try:
        nb = nbformat.read(str(notebook), as_version=4)
        cells = [c for c in nb.cells
                 if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", [])]
    except UnicodeDecodeError as e:
        raise ReproError(f"{notebook}: not a notebook (not UTF-8 text: {e.reason} at byte {e.start}); "
                         "restore it from git or save it again from Jupyter") from None
    except OSError as e:
        raise ReproError(f"{notebook}: cannot be read ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # NotJSONError is a ValueError
        why = (str(e).splitlines() or [type(e).__name__])[0][:100]
        raise ReproError(f"{notebook}: not a Jupyter notebook ({why}); restore it from git or save it again "
                         "from Jupyter") from None
    if not cells:
        return None
    source = cells[0].source
    try:
        return source, ast.parse(source).body
    except (SyntaxError, ValueError, RecursionError) as e:
        where = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ReproError(f"{notebook}: its parameters cell is not valid Python ({getattr(e, 'msg', None) or e}{where}); "
                         "fix that cell") from None


def notebook_parameters(notebook: Path) -> dict:
    """Names and literal defaults assigned in the notebook's cell tagged `parameters`."""
    cell = _parameters_cell(notebook)
    if cell is None:
        return {}
    defaults = {}
    for node in cell[1]:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    defaults[target.id] = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError):
                    defaults[target.id] = _NO_DEFAULT
    return defaults


def parameter_table(notebook: Path) -> list[dict]:
    """The notebook's `parameters` cell, one row per name in its order: {name, type, default (source text),
    comment (the line's trailing comment)}; the type is the annotation's, else the literal default's."""
    cell = _parameters_cell(notebook)
    if cell is None:
        return []
    source, body = cell
    lines, rows = source.splitlines(), {}
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if value is None:
            continue
        try:
            kind = _type_family(ast.literal_eval(value))
        except (ValueError, TypeError, SyntaxError):
            kind = "any"
        if kind == "NoneType":
            kind = "any"
        if isinstance(node, ast.AnnAssign):
            kind = ast.get_source_segment(source, node.annotation) or kind
        rest = lines[node.end_lineno - 1][node.end_col_offset:].strip()
        comment = rest[1:].strip() if rest.startswith("#") else ""
        for target in targets:
            if isinstance(target, ast.Name):
                rows[target.id] = {"name": target.id, "type": kind, "default": _default_text(source, value),
                                   "comment": comment}
    return list(rows.values())


def _default_text(source: str, value: ast.expr, width: int = 48) -> str:
    """A default as one line (a literal spread over lines is printed again; other code is its source text,
    comments dropped), clipped to `width` characters."""
    text = ast.get_source_segment(source, value) or "?"
    if "\n" in text:
        try:
            text = repr(ast.literal_eval(value))
        except (ValueError, TypeError, SyntaxError):
            text = " ".join(ast.unparse(value).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _literal(default):
    return None if default is _NO_DEFAULT else default


def _type_family(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def check_parameters(parameters: dict, defaults: dict, notebook: Path) -> dict:
    """Refuse unknown names and values whose type differs from the default's (an int for a float is fine)."""
    checked = {}
    for name, value in parameters.items():
        if name not in defaults:
            import difflib
            close = difflib.get_close_matches(name, list(defaults), n=1)
            raise ParameterError(f"unknown parameter {name!r} for {notebook.name}"
                                 + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; valid: {', '.join(sorted(defaults)) or 'none (no cell tagged parameters)'}")
        if not _finite(value):  # parameters.json and the result file are strict JSON: no inf or NaN
            raise ParameterError(f"parameter {name!r} of {notebook.name} is {value!r}: inf and NaN cannot be recorded "
                                 "in parameters.json; give a finite number (e.g. a large one for 'no limit')")
        default = defaults[name]
        if value is None and default is not _NO_DEFAULT and default is not None:  # -p x '' (or ~, null) is None
            raise ParameterError(f"parameter {name!r} of {notebook.name} is None (an empty -p value, ~ or null), but its "
                                 f"default is {_type_family(default)} {default!r}; give a {_type_family(default)} value")
        if default is _NO_DEFAULT or default is None or value is None:
            checked[name] = value
        elif isinstance(default, float) and _type_family(value) == "int":
            try:
                checked[name] = float(value)
            except OverflowError:  # an integer of 309+ digits
                raise ParameterError(f"parameter {name!r} of {notebook.name} is a float (default {default!r}); got an "
                                     f"integer of {len(str(abs(value)))} digits, beyond a float's range (1.8e308): "
                                     "give a smaller number") from None
        elif _type_family(value) != _type_family(default):
            raise ParameterError(f"parameter {name!r} of {notebook.name} has type {_type_family(default)} "
                                 f"(default {default!r}); got {_type_family(value)} {value!r}")
        else:
            checked[name] = value
    return checked


def _finite(value) -> bool:
    """No inf or NaN anywhere in a parameter value (lists and mappings looked into)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def build_parameters(paper: Paper, scale: str, overrides: dict | None, device: str | None) -> tuple[dict, dict]:
    """(checked papermill parameters, notebook defaults) for one run."""
    check_scale(scale)
    if scale not in paper.scales:
        raise ParameterError(f"paper {paper.id!r} has no scale {scale!r}; scales: {', '.join(paper.scales)}")
    for name, flag, example in (("scale", "--scale", "paper"), ("device", "--device", "cuda")):
        if name in (overrides or {}):  # else --scale silently wins over -p scale, and -p device skips the check
            raise ParameterError(f"-p {name} {printable(repr(overrides[name]), 40)}: the run's {name} is set with "
                                 f"{flag} (e.g. {flag} {example}), which checks it; drop -p {name}")
    notebook = notebook_path(paper)
    defaults = notebook_parameters(notebook)
    infinite = [n for n, v in defaults.items() if v is not _NO_DEFAULT and not _finite(v)]
    if infinite:  # parameters.json records the defaults too, and it is strict JSON
        raise ParameterError(f"{notebook.name}'s parameters cell sets {infinite[0]} = "
                             f"{printable(repr(defaults[infinite[0]]), 40)}: inf and NaN cannot be recorded in "
                             "parameters.json; write a finite default (e.g. a large number for 'no limit')")
    params = dict(paper.scales[scale]["parameters"])
    params.update(overrides or {})
    if "scale" in defaults:
        params["scale"] = scale
    if device is not None:
        params["device"] = device
    return check_parameters(params, defaults, notebook), defaults


QUICK = "quick"  # the notebook parameter that cuts the paper scale to a code-path test (tests/test_paper_scale.py)


def refuse_quick(params: dict, what: str) -> None:
    """A run with `quick` true (the paper scale's code path on a tiny budget, for the tests) is never a result:
    `reproduce` and the paper-scale store refuse it (`fedlab-nb run` still runs it, its parameters.json says so)."""
    if params.get(QUICK):
        raise ParameterError(f"{what}: made with quick=True, the paper scale's code path on a tiny budget for the "
                             "tests, not a result; it is never recorded as one (run it with `fedlab-nb run ID --scale "
                             "paper -p quick True`; reproduce without quick)")


def check_scale(scale) -> str:
    """A scale name is an identifier ('smoke', 'paper'): it names files in the results folder, never a path."""
    if not isinstance(scale, str) or not SCALE_NAME.fullmatch(scale):
        raise ParameterError(f"scale {scale!r} is not a scale name (letters, digits, _, -, at most 64); use a scale "
                             "of the claims file such as 'smoke', 'paper' or 'paper-substitute'")
    return scale


def notebook_path(paper: Paper) -> Path:
    """The paper's notebook: a file inside the repository root (no absolute path, '..' or link out of it)."""
    path, root = paper.root / paper.notebook, paper.root.resolve()
    if Path(paper.notebook).is_absolute() or ".." in Path(paper.notebook).parts \
            or not path.resolve().is_relative_to(root):
        raise UnsafePathError(f"{paper.path}: notebook {paper.notebook!r} is outside the repository {root}; give a "
                              "path relative to it, such as notebooks/<id>.ipynb")
    if not path.is_file():
        raise ReproError(f"{paper.path}: notebook {paper.notebook!r} does not exist ({path})")
    return path


# ---------------------------------------------------------------------------------------------- running
@contextlib.contextmanager
def _environment(**values: str):
    """Temporarily set environment variables; the kernel papermill starts inherits them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _out_dir(out_dir, root: Path) -> Path:
    if out_dir is None:
        out_dir = os.environ.get("FEDLAB_NB_RESULTS") or root / "results"
    # once, against the caller's directory: papermill runs in the notebook's
    return user_path(out_dir, "the results folder").absolute()


def run_notebook(paper_id: str, scale: str = "smoke", parameters: dict | None = None, device: str | None = None,
                 out_dir=None, root=None, progress: bool = False) -> dict:
    """Execute a paper's notebook; returns {notebook, run_dir, folder, parameters_file, parameters, metrics,
    error, wall_seconds} (`notebook` is None when no executed notebook was written).
    `progress`: True for papermill's bar, "lines" for a plain line on stderr as each code cell starts.

    A notebook that raises does not raise here: `error` holds the failing cell index, exception name and
    message, and the executed notebook (with the traceback) is still saved."""
    root = Path(root or default_root()).absolute()
    paper = load_paper(paper_id, root)
    params, defaults = build_parameters(paper, scale, parameters, device)
    results = _out_dir(out_dir, root)
    given = [*(parameters or {}), *(["device"] if device is not None else [])]
    folder = run_folder(paper.id, scale, params, results, first=given)
    make_folder(folder.parent)
    stem = f"{paper.id}-{scale}"
    refuse_link(folder)
    _refuse_links(folder, stem)
    refuse_link(folder / PARAMETERS_FILE)
    with run_lock(results, paper.id, scale), staging(folder, stem) as tmp:
        if progress == "lines":  # the parameters are valid and the lock is held: say what runs, and where
            print(printable(f"{paper.id} ({scale}): running {paper.notebook} into {folder}"), file=sys.stderr,
                  flush=True)
        write_parameters_file(tmp, paper, scale, params, defaults, dict(parameters or {}), device)
        run = _execute(paper, scale, params, tmp, progress)
        executed = (tmp / f"{stem}.ipynb").is_file()  # not when the kernel could not start
        # a kernel that never started leaves only its log: an earlier run's notebook and figures stay whole
        publish(tmp, folder, [PARAMETERS_FILE, *_outputs(stem)] if executed else [PARAMETERS_FILE, f"{stem}.kernel.log"])
    notebook = folder / f"{stem}.ipynb"
    return {**run, "notebook": str(notebook) if executed else None, "run_dir": str(folder / stem),
            "folder": str(folder), "parameters_file": str(folder / PARAMETERS_FILE)}


def _refuse_links(folder: Path, stem: str) -> None:
    """Before running: no output of the run may be a symbolic link (publish would replace or delete it), nor a
    folder where a file goes or a file where the figures folder goes (publish would refuse it after the run)."""
    for name in _outputs(stem, result=True):
        target = refuse_link(folder / name)
        if target.exists() and target.is_dir() != (name == stem):
            kind, goes = ("a folder", "a file") if target.is_dir() else ("not a folder", "the figures folder")
            raise UnsafePathError(f"{target} is {kind} where fedlab-nb writes {goes}; move it away")


def _outputs(stem: str, result: bool = False) -> list[str]:
    """What a run leaves in its folder, the result file last (`files.publish` moves them in this order)."""
    return [stem, f"{stem}.ipynb", f"{stem}.kernel.log", *([f"{stem}.json"] if result else [])]


FOLDER_CHARS = re.compile(r"[^A-Za-z0-9_.=-]+")
MINUS_SIGNS = str.maketrans({c: "-" for c in "\u2010\u2011\u2012\u2013\u2212\ufe63\uff0d"})  # dashes typed as a minus
FOLDER_LENGTH = 120  # characters of a run folder's name, the 8 hex digits included


def parameters_key(params: dict) -> str:
    """8 hex digits of the parameters: runs with other parameters never share a folder."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _folder_value(value) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)  # true, false, null
    if isinstance(value, (list, tuple)):
        return "-".join(map(_folder_value, value)) or "empty"
    return str(value)


def _folder_text(value: str) -> str:
    """A value in a folder name: [A-Za-z0-9_.=-] only, no dashes at its ends nor dots at its end, but the sign and
    the leading dot of a number it had (-0.5, −0.5 typed from a PDF, -.5 and ' -1' show as -0.5, -0.5, -.5, -1)."""
    value = value.strip().translate(MINUS_SIGNS)
    sign = "-" if value.startswith("-") else ""
    body = FOLDER_CHARS.sub("-", value[len(sign):])
    dot = "." if body[:1] == "." and body[1:2].isdigit() else ""  # .5 keeps its dot; ..x or .x do not
    body = body.strip("-.")
    return (sign + dot + body if body[:1].isalnum() else body) or "-"


def run_folder(paper_id: str, scale: str, params: dict, out_dir, first=()) -> Path:
    """results/runs/<id>-<scale>-<name>=<value>_...-<8 hex of the parameters>: a `run` never overwrites what
    `reproduce` wrote (and the board embeds), and runs with other parameters do not overwrite each other.
    The names in `first` (those given on the command line) come first, then the others by name; the readable
    part holds only [A-Za-z0-9_.=-] and is clipped so that the name stays under FOLDER_LENGTH characters."""
    names = [n for n in first if n in params] + sorted(n for n in params if n not in first and n != "scale")
    shown = "_".join(f"{n}={_folder_text(_folder_value(params[n]))}" for n in names)
    head = f"{paper_id}-{scale}"
    room = FOLDER_LENGTH - len(head) - len("--") - 8
    if len(shown) > room:
        shown = shown[:room].rstrip("_-.")
    return Path(out_dir) / "runs" / f"{head}-{shown or 'defaults'}-{parameters_key(params)}"


PARAMETERS_FILE = "parameters.json"


def write_parameters_file(folder: Path, paper: Paper, scale: str, params: dict, defaults: dict,
                          overrides: dict, device: str | None) -> Path:
    """parameters.json beside a run's executed notebook: what it ran with and the command that runs it again."""
    given = [f"-p {n} {_yaml_text(v)}" for n, v in overrides.items()]
    command = " ".join(["fedlab-nb run", paper.id, "--scale", scale, *given, *(["--device", device] if device else [])])
    effective = {n: _literal(v) for n, v in defaults.items()}
    effective.update(params)
    data = {"paper": paper.id, "scale": scale, "notebook": paper.notebook, "command": command,
            "given": overrides, "scale_parameters": dict(paper.scales[scale]["parameters"]),
            "parameters": params, "effective": effective}
    path = refuse_link(folder / PARAMETERS_FILE)
    write_json_atomic(path, json.loads(json.dumps(data, default=str)))
    return path


def _yaml_text(value) -> str:
    """A value as `-p NAME VALUE` reads it back (YAML): strings quoted only where YAML would change them."""
    import shlex
    text = json.dumps(value, default=str)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", value) and \
            value.lower() not in ("true", "false", "null", "yes", "no", "on", "off", "nan", "inf"):
        text = value
    return shlex.quote(text)


def _execute(paper: Paper, scale: str, params: dict, out_dir: Path, progress: bool = False) -> dict:
    """Run the notebook into `out_dir` (a staging folder: `files.staging`): <id>-<scale>/ (metrics, figures),
    <id>-<scale>.ipynb and <id>-<scale>.kernel.log."""
    import papermill  # imported here: slow, and not needed inside notebooks

    run_dir = make_folder(out_dir / f"{paper.id}-{scale}")
    # a previous run's metrics and figures must not pass for this run's
    for stale in [run_dir / METRICS_FILE, *run_dir.glob("*.png"), *run_dir.glob("*.data.json")]:
        stale.unlink(missing_ok=True)
    executed = out_dir / f"{paper.id}-{scale}.ipynb"
    notebook = notebook_path(paper)
    # the kernel must import the same fedlab_nb as we do, installed or not
    pythonpath = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
    error, start = None, time.perf_counter()
    kernel_log = out_dir / f"{paper.id}-{scale}.kernel.log"  # the kernel process's own messages, not the cells'
    with _environment(**{RUN_DIR_ENV: str(run_dir.resolve()), ROOT_ENV: str(paper.root.resolve()),
                         "PYTHONPATH": pythonpath}), _quiet_papermill(), tempfile.TemporaryDirectory(
                             prefix="fedlab_nb_kernel_") as sockets:
        try:
            lines = progress == "lines"
            papermill.execute_notebook(str(notebook), str(executed), parameters=params, kernel_name=KERNEL,
                                       cwd=str(notebook.parent), progress_bar=bool(progress) and not lines,
                                       log_output=False, kernel_manager_class=_ipc_kernel_manager(sockets, kernel_log),
                                       **({"engine_name": _line_engine(paper.id)} if lines else {}))
        except papermill.PapermillExecutionError as e:
            error = {"cell": e.cell_index, "execution_count": e.exec_count, "ename": e.ename,
                     "evalue": str(e.evalue)}
        except Exception as e:  # kernel died, kernel missing, unreadable notebook ...
            error = {"cell": None, "execution_count": None, "ename": type(e).__name__, "evalue": str(e)}
    metrics_file = run_dir / METRICS_FILE
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    return {"notebook": str(executed), "run_dir": str(run_dir), "parameters": params, "metrics": metrics,
            "error": error, "wall_seconds": round(time.perf_counter() - start, 2)}


LINE_ENGINE = "fedlab_nb_lines"


def _line_engine(label: str, stream=None) -> str:
    """papermill's nbclient engine printing `<label>: cell k of n (elapsed s)` as each code cell starts: the
    progress of a run whose stderr is not a terminal (a log file, CI), where a bar would be noise."""
    from papermill.engines import NBClientEngine, papermill_engines

    class LineEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            code = [i for i, c in enumerate(nb_man.nb.cells) if c.cell_type == "code"]
            start, cell_start = time.perf_counter(), nb_man.cell_start

            def announce(cell, cell_index=None, **kw):
                if cell_index in code:
                    print(f"{label}: cell {code.index(cell_index) + 1} of {len(code)} "
                          f"({time.perf_counter() - start:.0f} s elapsed)", file=stream or sys.stderr, flush=True)
                return cell_start(cell, cell_index, **kw)
            nb_man.cell_start = announce
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register(LINE_ENGINE, LineEngine)
    return LINE_ENGINE


def _ipc_kernel_manager(folder: str, log: Path | None = None):
    """A kernel manager on IPC sockets in `folder`: local only, and the kernel does not print its "running
    over TCP without encryption" warning into every run's output. The kernel process's own log (its
    shutdown "KeyboardInterrupt caught" line ...) goes to `log`, not the terminal; cell output is unaffected."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _default_transport(self):
            return "ipc"

        @default("ip")
        def _default_ip(self):
            return os.path.join(folder, "kernel")

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            if log is not None:
                kw.setdefault("stderr", open(log, "wb"))  # noqa: SIM115 (the kernel process owns it)
            return await super()._async_launch_kernel(kernel_cmd, **kw)
    return IPCKernelManager


@contextlib.contextmanager
def _quiet_papermill():
    """papermill's parameter-cell reader warns "Unable to parse line N" for comments with parentheses; the
    parameters it injects do not depend on that reader, so its warnings are noise here."""
    import logging
    logger = logging.getLogger("papermill.translators")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------- reproduce
def content_hash(paper: Paper, params: dict) -> str:
    """Changes when the notebook, the claims file or the parameters change."""
    h = hashlib.sha256()
    h.update(notebook_path(paper).read_bytes())
    h.update(paper.path.read_bytes())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cpu_name() -> str:
    """The CPU a result was computed on: its model name and torch's kernel dispatch level (AVX512, AVX2 ...)."""
    import torch
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()} " \
           f"({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores)"


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("torch", "numpy", "papermill", "fedlab_nb"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = sys.modules[name].__dict__.get("__version__") if name in sys.modules else None
    return versions


def _git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def result_path(paper_id: str, scale: str, out_dir) -> Path:
    return Path(out_dir) / f"{paper_id}-{scale}.json"


def reproduce(paper_id: str, scale: str = "smoke", force: bool = False, parameters: dict | None = None,
              device: str | None = None, out_dir=None, root=None, progress: bool = False) -> dict:
    """Run the notebook, check every claim, write results/<id>-<scale>.json and return it.

    An up-to-date result (same hash, not an error) is returned as is with `skipped: True` unless `force`.
    `progress`: a bar on stderr (cell k of n, elapsed, estimated remaining) — for long runs such as paper scale."""
    root = Path(root or default_root()).absolute()
    out_dir = _out_dir(out_dir, root)
    paper = load_paper(paper_id, root)
    params, defaults = build_parameters(paper, scale, parameters, device)
    refuse_quick(params, f"reproduce {paper.id} --scale {scale}")
    digest = content_hash(paper, params)
    path = result_path(paper.id, scale, out_dir)
    stem = f"{paper.id}-{scale}"
    _refuse_links(out_dir, stem)
    with run_lock(out_dir, paper.id, scale):  # one run of a paper at a time
        recover_run(out_dir, stem)  # a publish killed part-way: its old result is whole again before it is judged
        if refuse_link(path).exists() and not force:
            old, problem = read_result(path)
            if problem:  # a corrupt result is stale: say so, run again
                warnings.warn(f"{path} {problem}; treating it as stale and running {paper.id} again",
                              StaleResultWarning, stacklevel=2)
            elif old.get("hash") == digest and old.get("verdict") != ERROR and _outputs_intact(old, out_dir):
                return {**old, "skipped": True}
        with staging(out_dir, stem) as tmp:  # the old result and its figures stay until this run completes
            run = _execute(paper, scale, params, tmp, progress)
            result = judge_run(paper, scale, params, defaults, run, tmp, digest)
            publish(tmp, out_dir, _outputs(stem, result=True))
    return result


def judge_run(paper: Paper, scale: str, params: dict, defaults: dict, run: dict, out_dir: Path, digest: str) -> dict:
    """Claim verdicts from what one execution recorded (`run`: notebook or None, run_dir, metrics, error,
    wall_seconds); writes results/<id>-<scale>.json and returns it. Shared by `reproduce` (papermill) and the
    test suite's single nbval execution of each notebook."""
    refuse_quick(params, f"{paper.id} ({scale})")
    rows, root, path = [], paper.root, result_path(paper.id, scale, out_dir)
    sized = (paper.paper_scale or {}).get("paper_sized")  # None: every claim runs at the paper's size
    for claim in paper.claims:
        summary = None
        if run["error"]:
            verdict, reason = ERROR, f"notebook failed in cell {run['error']['cell']}: {run['error']['ename']}"
        else:
            verdict, reason, summary = judge_detail(claim, run["metrics"], scale)
        rows.append({"id": claim.id, "role": claim.role, "text": claim.text, "metric": claim.metric,
                     "expect": claim.expect.text, "partial": claim.partial.text if claim.partial else None,
                     "paper_value": claim.paper_value, "paper_note": claim.paper_note, "setting": claim.setting,
                     "ours": run["metrics"].get(claim.metric), "verdict": verdict, "reason": reason,
                     "stored_verdict": claim.verdict, "also_seen": claim.also_seen, "seeds": claim.seeds,
                     "interval": summary, "note": claim.note,
                     "at_paper_size": (sized is None or claim.id in sized) if scale == "paper" else None})
    run_dir = Path(run["run_dir"])
    result = {
        "paper": paper.id, "method": paper.method, "title": paper.paper.get("title"), "scale": scale,
        "citation": {k: paper.paper.get(k) for k in ("authors", "venue", "year", "url")},
        "implementation": paper.implementation,
        "verdict": ERROR if run["error"] else headline_verdict(rows),
        "counts": role_counts(rows),
        "claims": rows, "report": report_values(paper, run["metrics"]), "metrics": run["metrics"],
        "error": run["error"],
        # a kernel that never started wrote no notebook: the one in the results folder is an earlier run's
        "notebook": os.path.relpath(run["notebook"], out_dir) if run.get("notebook") and Path(
            run["notebook"]).is_file() else None,
        "figures": sorted(os.path.relpath(p, out_dir) for p in run_dir.glob("*.png")),
        "figure_data": sorted(os.path.relpath(p, out_dir) for p in run_dir.glob("*.data.json")),
        "parameters": params,
        "device": params.get("device", _literal(defaults.get("device"))),
        "seed": params.get("seed", _literal(defaults.get("seed"))),
        "versions": _versions(), "git_commit": _git_commit(root), "cpu": cpu_name(),
        "wall_seconds": run["wall_seconds"], "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hash": digest,
        "outputs": _output_digests(out_dir, [*([run["notebook"]] if run.get("notebook") else []), *run_dir.iterdir()]),
    }
    result = json.loads(json.dumps(result, default=str))  # e.g. a tuple parameter -> list
    write_json_atomic(refuse_link(path), result)
    return result


def _output_digests(out_dir: Path, files) -> dict:
    """{path relative to out_dir: sha256} of the executed notebook and the run folder's files."""
    return {os.path.relpath(f, out_dir): file_digest(f) for f in sorted(map(Path, files)) if Path(f).is_file()}


def _outputs_intact(result: dict, out_dir: Path) -> bool:
    """Whether the notebook, figures and metrics on disk are still the ones this result was made from."""
    outputs = result.get("outputs")
    return isinstance(outputs, dict) and bool(outputs) and all(
        (path := safe_output(out_dir, rel)) is not None and file_digest(path) == digest
        for rel, digest in outputs.items())


def mismatches(result: dict) -> list[str]:
    """Claims whose verdict is neither the one stored in the claims file nor one it lists under `also_seen`
    (meaningful at smoke scale)."""
    def says(r):
        return repr(r["stored_verdict"]) + "".join(f" or {v!r}" for v in r.get("also_seen") or {})
    return [f"{r['id']}: got {r['verdict']!r}, claims file says {says(r)}"
            + (f" ({r['reason']})" if r.get("reason") else "")
            for r in result["claims"] if r.get("stored_verdict") is not None  # None: a file that never stored one
            and r["verdict"] != r["stored_verdict"] and r["verdict"] not in (r.get("also_seen") or {})]
