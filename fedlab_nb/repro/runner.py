"""Run a paper's notebook with papermill and turn its recorded metrics into a result file.

    run_notebook(id, scale)  -> executed notebook, figures + metrics in their own folder
                                results/runs/<id>-<scale>-<hash of the parameters>/ (never reproduce's files)
    reproduce(id, scale)     -> the above + claim verdicts in results/<id>-<scale>.json (skipped when a
                                result with the same notebook, claims file and parameters exists and its outputs are untouched)
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import json
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
from .files import UnsafePathError, make_folder, publish, refuse_link, run_lock, staging
from .recording import METRICS_FILE, RUN_DIR_ENV, write_json_atomic
from .results import StaleResultWarning, file_digest, read_result, safe_output

KERNEL = "python3"
_NO_DEFAULT = object()  # a parameter whose default is not a literal: any type accepted


class ParameterError(ReproError, ValueError):
    exit_code = 2


# ---------------------------------------------------------------------------------------------- parameters
def notebook_parameters(notebook: Path) -> dict:
    """Names and literal defaults assigned in the notebook's cell tagged `parameters`."""
    nb = nbformat.read(str(notebook), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        return {}
    defaults = {}
    for node in ast.parse(cells[0].source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    defaults[target.id] = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError):
                    defaults[target.id] = _NO_DEFAULT
    return defaults


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
            raise ParameterError(f"unknown parameter {name!r} for {notebook.name}; "
                                 f"valid: {', '.join(sorted(defaults)) or 'none (no cell tagged parameters)'}")
        default = defaults[name]
        if default is _NO_DEFAULT or default is None or value is None:
            checked[name] = value
        elif isinstance(default, float) and _type_family(value) == "int":
            checked[name] = float(value)
        elif _type_family(value) != _type_family(default):
            raise ParameterError(f"parameter {name!r} of {notebook.name} has type {_type_family(default)} "
                                 f"(default {default!r}); got {_type_family(value)} {value!r}")
        else:
            checked[name] = value
    return checked


def build_parameters(paper: Paper, scale: str, overrides: dict | None, device: str | None) -> tuple[dict, dict]:
    """(checked papermill parameters, notebook defaults) for one run."""
    check_scale(scale)
    if scale not in paper.scales:
        raise ParameterError(f"paper {paper.id!r} has no scale {scale!r}; scales: {', '.join(paper.scales)}")
    notebook = notebook_path(paper)
    defaults = notebook_parameters(notebook)
    params = dict(paper.scales[scale]["parameters"])
    params.update(overrides or {})
    if "scale" in defaults:
        params["scale"] = scale
    if device is not None:
        params["device"] = device
    return check_parameters(params, defaults, notebook), defaults


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
    return Path(out_dir).absolute()  # once, against the caller's directory: papermill runs in the notebook's


def run_notebook(paper_id: str, scale: str = "smoke", parameters: dict | None = None, device: str | None = None,
                 out_dir=None, root=None, progress: bool = False) -> dict:
    """Execute a paper's notebook; returns {notebook, run_dir, parameters, metrics, error, wall_seconds}.

    A notebook that raises does not raise here: `error` holds the failing cell index, exception name and
    message, and the executed notebook (with the traceback) is still saved."""
    root = Path(root or default_root()).absolute()
    paper = load_paper(paper_id, root)
    params, _ = build_parameters(paper, scale, parameters, device)
    results = _out_dir(out_dir, root)
    folder = run_folder(paper.id, scale, params, results)
    make_folder(folder.parent)
    stem = f"{paper.id}-{scale}"
    refuse_link(folder)
    _refuse_links(folder, stem)
    with run_lock(results, paper.id, scale), staging(folder, stem) as tmp:
        run = _execute(paper, scale, params, tmp, progress)
        publish(tmp, folder, _outputs(stem))
    return {**run, "notebook": str(folder / f"{stem}.ipynb"), "run_dir": str(folder / stem)}


def _refuse_links(folder: Path, stem: str) -> None:
    """Before running: no output of the run may be a symbolic link (publish would replace or delete it)."""
    for name in _outputs(stem, result=True):
        refuse_link(folder / name)


def _outputs(stem: str, result: bool = False) -> list[str]:
    """What a run leaves in its folder, the result file last (`files.publish` moves them in this order)."""
    return [stem, f"{stem}.ipynb", f"{stem}.kernel.log", *([f"{stem}.json"] if result else [])]


def run_folder(paper_id: str, scale: str, params: dict, out_dir) -> Path:
    """results/runs/<id>-<scale>-<8 hex of the parameters>: a `run` never overwrites what `reproduce` wrote
    (and the board embeds), and runs with other parameters do not overwrite each other."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return Path(out_dir) / "runs" / f"{paper_id}-{scale}-{key}"


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
            papermill.execute_notebook(str(notebook), str(executed), parameters=params, kernel_name=KERNEL,
                                       cwd=str(notebook.parent), progress_bar=progress, log_output=False,
                                       kernel_manager_class=_ipc_kernel_manager(sockets, kernel_log))
        except papermill.PapermillExecutionError as e:
            error = {"cell": e.cell_index, "execution_count": e.exec_count, "ename": e.ename,
                     "evalue": str(e.evalue)}
        except Exception as e:  # kernel died, kernel missing, unreadable notebook ...
            error = {"cell": None, "execution_count": None, "ename": type(e).__name__, "evalue": str(e)}
    metrics_file = run_dir / METRICS_FILE
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    return {"notebook": str(executed), "run_dir": str(run_dir), "parameters": params, "metrics": metrics,
            "error": error, "wall_seconds": round(time.perf_counter() - start, 2)}


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
    digest = content_hash(paper, params)
    path = result_path(paper.id, scale, out_dir)
    stem = f"{paper.id}-{scale}"
    _refuse_links(out_dir, stem)
    with run_lock(out_dir, paper.id, scale):  # one run of a paper at a time
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
    rows, root, path = [], paper.root, result_path(paper.id, scale, out_dir)
    for claim in paper.claims:
        summary = None
        if run["error"]:
            verdict, reason = ERROR, f"notebook failed in cell {run['error']['cell']}: {run['error']['ename']}"
        else:
            verdict, reason, summary = judge_detail(claim, run["metrics"])
        rows.append({"id": claim.id, "role": claim.role, "text": claim.text, "metric": claim.metric,
                     "expect": claim.expect.text, "partial": claim.partial.text if claim.partial else None,
                     "paper_value": claim.paper_value, "paper_note": claim.paper_note, "setting": claim.setting,
                     "ours": run["metrics"].get(claim.metric), "verdict": verdict, "reason": reason,
                     "stored_verdict": claim.verdict, "also_seen": claim.also_seen, "seeds": claim.seeds,
                     "interval": summary, "note": claim.note})
    run_dir = Path(run["run_dir"])
    result = {
        "paper": paper.id, "method": paper.method, "title": paper.paper.get("title"), "scale": scale,
        "citation": {k: paper.paper.get(k) for k in ("authors", "venue", "year", "url")},
        "implementation": paper.implementation,
        "verdict": ERROR if run["error"] else headline_verdict(rows),
        "counts": role_counts(rows),
        "claims": rows, "report": report_values(paper, run["metrics"]), "metrics": run["metrics"],
        "error": run["error"],
        "notebook": os.path.relpath(run["notebook"], out_dir) if run.get("notebook") else None,
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
            for r in result["claims"] if r["verdict"] != r["stored_verdict"] and r["verdict"] not in (r.get("also_seen") or {})]
