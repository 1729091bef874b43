"""`fedlab-nb`: list papers, run or reproduce their notebooks, build the report, list data sets.

    fedlab-nb list
    fedlab-nb params afl                                            (its notebook's parameters and scales)
    fedlab-nb run afl -p clients 20 --scale smoke --device cpu    (writes results/runs/afl-smoke-clients=20_...-<hash>/)
    fedlab-nb reproduce afl fedau --scale smoke [--force]      |   fedlab-nb reproduce --all
    fedlab-nb report
    fedlab-nb figures check afl   |   fedlab-nb figures update afl   (papers/figures/afl.json)
    fedlab-nb data                |   fedlab-nb data fetch mnist
Papers are papers/*.yaml under the repository root (the folder holding fedlab_nb/), or --root / $FEDLAB_NB_ROOT.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import re
import sys
import time
import warnings
from pathlib import Path

import yaml

from fedlab_nb.repro import claims as C
from fedlab_nb.repro.files import recover_publishes, user_path, writable_folder
from fedlab_nb.repro.results import StaleResultWarning, printable, printable_name, read_result, result_files
from fedlab_nb.repro.verdicts import summary_text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedlab-nb", description="Notebook-first federated learning: "
                                 "run paper notebooks and check their claims.")
    # --root / --results work before or after the command (SUPPRESS: an absent one keeps the other's value)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--root", default=argparse.SUPPRESS, help="repository root holding papers/ and "
                       "notebooks/ (default: $FEDLAB_NB_ROOT or the folder above the fedlab_nb package)")
    where.add_argument("--results", default=argparse.SUPPRESS,
                       help="results folder (default: $FEDLAB_NB_RESULTS or ROOT/results)")
    ap.add_argument("--root", help="repository root (also accepted after the command)")
    ap.add_argument("--results", help="results folder (also accepted after the command)")
    sub = ap.add_subparsers(dest="command", required=True)

    def command(name, help):
        return sub.add_parser(name, help=help, parents=[where])

    ls = command("list", "one line per paper: its headline verdict, supporting claims and checks beside it")
    ls.add_argument("--claims", action="store_true", help="also every claim (headline, supporting, check) and "
                    "reported number, with the paper's number and setting under each headline claim")
    ls.add_argument("--role", choices=[*C.ROLES, "reported"], help="only claims of this role (implies --claims)")
    ls.add_argument("--verdict", help="only papers whose headline verdict contains this, e.g. 'not reproduced'")
    ls.add_argument("--chapter", help="only papers of the course lesson whose key or title contains this")
    run = sub.add_parser("run", help="execute one paper's notebook with papermill", parents=[where],
                         description="Execute one paper's notebook with papermill into its own folder, "
                         "results/runs/<id>-<scale>-<name>=<value>_...-<8 hex>/ (the executed notebook, "
                         "parameters.json, figures and metrics), then judge the paper's claims.",
                         epilog="A paper's parameters, their types and defaults, and its scales: fedlab-nb params ID")
    run.add_argument("paper")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="notebook parameter (fedlab-nb params ID lists them); VALUE is read as YAML "
                     "(0.1 -> float, true -> bool)")
    # -p VALUE may be any negative number ('-1e-3', '-2E5', '-.5'): argparse's own test takes only '-1' / '-.5'
    run._negative_number_matcher = ap._negative_number_matcher = re.compile(r"^-\.?\d")
    par = command("params", "a paper's notebook parameters (types, defaults) and its scales' overrides")
    par.add_argument("paper")
    rep = command("reproduce", "run notebooks, check claims, write results/<id>-<scale>.json")
    rep.add_argument("papers", nargs="*")
    rep.add_argument("--all", action="store_true", help="every papers/*.yaml")
    rep.add_argument("--force", action="store_true", help="re-run even if the result is up to date")
    rep.add_argument("-j", "--jobs", type=int, default=None,
                     help="notebooks to run at once (default: one per core, each kernel on one thread)")
    for p in (run, rep):
        p.add_argument("--scale", default="smoke", help="a scale of the claims file (default: smoke)")
        p.add_argument("--device", type=_device, help="override the notebook's device parameter (cpu, cuda, auto)")
    command("report", "results/REPORT.md and results/index.html from all results")
    lab = command("lab", "JupyterLab on a copy of the notebooks in results/lab/ (running cells never changes the tracked "
                  "files); --student: the course view, the student versions in results/lab/student/")
    lab.add_argument("--student", action="store_true",
                     help="the course view for students: open results/lab/student/, the student version of every "
                          "notebook (solutions replaced by stubs; the check cells print PASS / TRY AGAIN); without it "
                          "the instructor copies, solutions included")
    lab.add_argument("--fresh", action="store_true", help="replace the copies with the repository's notebooks "
                     "(with --student: fresh student versions; a student's answers there are lost)")
    lab.add_argument("--dry-run", action="store_true", help="copy, print the command, do not start JupyterLab")
    lab.add_argument("--port", type=_port, help="JupyterLab's port (default: its own, 8888 or the next free one)")
    lab.add_argument("--ip", type=_ip, help="the address JupyterLab listens on (e.g. 0.0.0.0 in a container)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser (a remote machine, a container)")
    hist = command("history", "summarise a saved run (History.save's CSV): final accuracy, bytes, (epsilon, delta)")
    hist.add_argument("path", help="the .csv written by History.save (its .json beside it holds the run's settings)")
    figs = command("figures", "compare a smoke run's figure data with papers/figures/ID.json, or regenerate it")
    figs.add_argument("action", choices=["check", "update"], help="check: compare; update: rewrite the reference")
    figs.add_argument("paper")
    figs.add_argument("--from", dest="from_dir", help="use this run folder (results/ID-smoke) instead of running")
    data = command("data", "registered data sets and whether they are available offline")
    fetch = data.add_subparsers(dest="data_command").add_parser(
        "fetch", help="download one data set's original files (needs internet; the only download)")
    fetch.add_argument("name")
    fetch.add_argument("--dir", help="target folder (default: $FEDLAB_NB_DATA/NAME or ~/.cache/fedlab_nb/NAME)")
    return ap


def _device(text: str) -> str:
    """--device: checked here, so a typo is a usage error (exit 2) rather than a failed notebook."""
    if not re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda, cuda:N, mps or auto")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use a number from 1 to 65535, e.g. 8888")
    return int(text)


def _ip(text: str) -> str:
    """--ip: an IP address, a host name or '*' (JupyterLab's listen address); anything else (a typo, a control
    sequence) is a usage error instead of a JupyterLab that fails to start after printing it."""
    if text != "*" and not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})", text, re.ASCII):
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{printable(repr(text), 60)} is not an address; use an IP address "
                                             "(e.g. 0.0.0.0 in a container, 127.0.0.1), a host name or '*'") from None
    return text


def _lab_options(args) -> list[str]:
    """JupyterLab options passed through, and --allow-root when run as root (JupyterLab refuses root otherwise)."""
    opts = [f"--port={args.port}"] if args.port else []
    opts += [f"--ip={args.ip}"] if args.ip else []
    opts += ["--no-browser"] if args.no_browser else []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        print("running as root (a container, Colab, CI): passing --allow-root to JupyterLab")
        opts.append("--allow-root")
    return opts


def _root(args) -> Path:
    """The repository root, absolute: resolved once against the caller's directory (papermill changes it); a
    root that is missing or a file is a usage error (list and report would say nothing is there and exit 0)."""
    root = user_path(args.root if args.root else C.default_root(), "--root").absolute()
    if not root.is_dir():
        where = "--root" if args.root else f"${C.ROOT_ENV}" if os.environ.get(C.ROOT_ENV) else "the package's folder"
        raise UsageError(f"the repository root {printable(str(root), 160)} ({where}) is "
                         f"{'a file' if root.exists() else 'missing'}; give --root (or ${C.ROOT_ENV}) the folder "
                         "that holds papers/ and notebooks/")
    return root


def _results(args, root: Path, write: bool = False) -> Path:
    """The results folder, absolute (a relative --results or $FEDLAB_NB_RESULTS is the caller's); refused when
    it is a file, and with `write` created and checked writable, each with a one-line error naming the fix."""
    # '~/res' quoted in $FEDLAB_NB_RESULTS reaches us unexpanded: it means the home folder, not a folder named '~'
    given = args.results or os.environ.get("FEDLAB_NB_RESULTS")
    path = user_path(given or root / "results", "--results" if args.results else "$FEDLAB_NB_RESULTS").absolute()
    try:
        if given and path.is_symlink() and path.is_dir():  # the folder the user named (a scratch disk): its target
            path = Path(os.path.realpath(path))           # — links inside it are still never written through
        is_file = path.exists() and not path.is_dir()
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent ...
        raise UsageError(f"--results {printable(str(path), 120)} cannot be used ({e.strerror or e}); give --results "
                         "(or $FEDLAB_NB_RESULTS) a folder path that exists or can be made") from None
    if is_file:
        raise UsageError(f"the results folder {path} is a file, not a folder: give --results (or $FEDLAB_NB_RESULTS) "
                         "a folder, or move the file away")
    return writable_folder(path) if write else path


def _registry() -> dict:
    """The method registry with every method module loaded (and the Flower adapter when flwr is installed)."""
    import importlib
    import fedlab_nb.methods  # noqa: F401  (it imports every chapter; each method file registers itself)
    from fedlab_nb.core.registry import REGISTRY
    try:
        importlib.import_module("fedlab_nb.flower")
    except ImportError:
        pass
    return REGISTRY


def _implemented_by(paper_id: str) -> str:
    entries = [e for e in _registry().values() if e.claims == paper_id]
    return ", ".join(f"{e.module.replace('.', '/')}.py ({e.key})" for e in entries) or "no registered method"


def _last_results(results: Path, pid: str, scales=()) -> dict:
    """{scale: result} of one paper's result files; a corrupt one is a stale placeholder (with a warning)."""
    last = {}
    for path, _, scale in result_files(results, pid):
        data, problem = read_result(path)
        if problem is None and scales and scale not in scales:  # no run of this paper could have written it
            problem = "is at a scale the paper's claims file does not have"
        if problem:  # a corrupt result is stale, not fatal
            fix = ("move it away: reproduce writes the result file there and replaces neither a folder nor a link"
                   if path.is_symlink() or path.is_dir() else
                   f"fedlab-nb reproduce {pid} --scale {scale} replaces it" if scale in scales
                   else f"remove or rename it: {pid} has no scale by that name")  # or a name not UTF-8
            print(f"warning: {printable_name(path)} " + printable(f"{problem}; treated as stale ({fix})"),
                  file=sys.stderr)
            last[printable_name(scale)] = {"verdict": "stale (corrupt result file)", "claims": []}
        else:  # read_result checked that its paper and scale are its name's
            last[printable_name(scale)] = data
    return last


def _paper_line(paper, last: dict) -> str:
    """One line per paper: the headline verdict (stored; constructs say so), what stands beside it, the last runs."""
    from fedlab_nb.repro.report import beside
    stored = C.stored_result(paper)
    runs = "; ".join(f"{s}: {r['verdict']}" for s, r in last.items()) or "not run yet"
    label = f"{C.CONSTRUCT}: {stored['verdict']}" if paper.is_construct else stored["verdict"]
    return f"{paper.id} — {paper.method}: {label} ({beside(stored)}; last: {runs})"


def _claim_line(claim, last: dict) -> str:
    seen = ", ".join(f"{s}: {r['verdict']}" + (f" [{summary_text(r.get('interval'))}]" if r.get("interval") else "")
                     for s, r in last.items() for r in r["claims"] if r["id"] == claim.id)
    seeds = f", {claim.seeds} seeds" if claim.seeds is not None else ""
    also = "".join(f" (also seen: {v})" for v in claim.also_seen or {})
    return (f"  {claim.role} {claim.id} ({claim.metric} {claim.expect.text}{seeds}): stored {claim.verdict}{also}"
            + (f"; last {seen}" if seen else ""))


def _headline_detail(claim) -> list[str]:
    """The paper's number and the two settings under a headline claim's line."""
    number = claim.paper_value if claim.paper_value is not None else f"none ({claim.paper_note})"
    lines = [f"      paper's number: {number}"]
    if claim.setting:
        lines.append(f"      setting: paper {claim.setting['paper']} / ours {claim.setting['ours']}")
    return lines


def _wanted(paper, args) -> bool:
    """The paper passes --verdict (its stored headline verdict) and --chapter (the lesson's key or title)."""
    if args.verdict and args.verdict.lower() not in C.stored_result(paper)["verdict"]:
        return False
    if args.chapter:
        from fedlab_nb.repro.course import CourseError, lesson_of
        try:
            lesson = lesson_of(paper.id)
        except CourseError:
            return False
        return args.chapter.lower() in f"{lesson.key} {lesson.title}".lower()
    return True


def cmd_list(args) -> int:
    root, status = _root(args), 0
    ids = C.paper_ids(root)
    if not ids:
        print(f"no claims files in {root / 'papers'}")
    results = _results(args, root)
    recover_publishes(results)  # a run killed while it published: its old figures go back before they are listed
    for pid in ids:
        try:
            paper = C.load_paper(pid, root)
        except C.ReproError as e:
            print(printable(f"{pid}: INVALID: {e}"), file=sys.stderr)  # the file name and text are a file's
            status = 1
            continue
        if not _wanted(paper, args):
            continue
        last = _last_results(results, pid, paper.scales)
        print(printable(_paper_line(paper, last)))  # the method's name and the verdicts come from files
        if not (args.claims or args.role):
            continue
        print(printable(f"  notebook {paper.notebook}; implementation: {paper.implementation}; library: {_implemented_by(pid)}"))
        for claim in sorted(paper.claims, key=lambda c: C.ROLES.index(c.role)):
            if args.role in (None, claim.role):
                print(printable(_claim_line(claim, last)))
                if claim.role == C.HEADLINE:
                    print("\n".join(map(printable, _headline_detail(claim))))
        for row in paper.report if args.role in (None, "reported") else ():
            print(printable(f"  reported {row.id} ({row.metric}): {row.text}"))
    free = sorted(f"{e.key} ({e.module.replace('.', '/')}.py)" for e in _registry().values() if not e.claims)
    if free and not (args.verdict or args.chapter):
        print("registered methods without a claims file yet: " + ", ".join(free))
    return status


class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars (PyYAML speaks 1.1): `1e-3` is a float, `010` is 10,
    `0o17` is 15; `2024-01-01`, `yes`, `on` and `1:20` stay strings. No aliases (`&a [*a]` is a list that
    holds itself): a value with one is not YAML here, so it stays a string."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.MarkedYAMLError(None, None, "aliases (*name) are not allowed in a -p value",
                                       self.peek_event().start_mark)
        return super().compose_node(parent, index)


Yaml12Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in [
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
        ("float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
         "-+0123456789."),
        ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""])]:
    Yaml12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(
    loader.construct_scalar(node), 0 if loader.construct_scalar(node)[:2] in ("0o", "0x") else 10))


def _parse_parameters(pairs) -> dict:
    """-p NAME VALUE pairs; VALUE is YAML 1.2 (0.1 and 1e-3 -> float, true -> bool, [1, 2] -> list, else a string)."""
    from fedlab_nb.repro.runner import ParameterError
    params = {}
    for name, text in pairs:
        try:
            params[name] = yaml.load(text, Loader=Yaml12Loader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError:
            params[name] = text
        except (ValueError, RecursionError) as e:  # !!float abc, !!int abc, an integer of thousands of digits
            raise ParameterError(f"-p {name} {printable(text, 40)}: {C.yaml_value_problem(e)}; give a plain value "
                                 "(e.g. 0.1, 3, true, [1, 2] or text)") from None
        odd = _not_plain(params[name])
        if odd:  # !!timestamp, !!binary, !!set ...: a value the notebook's parameters cell and parameters.json cannot hold
            raise ParameterError(f"-p {name} {printable(text, 40)}: a YAML tag made it a {odd}; give a plain value "
                                 "(e.g. 0.1, 3, true, [1, 2] or text)")
    return params


def _not_plain(value) -> str | None:
    """The type name of the first value in `value` that is not JSON-like (text, number, bool, null, list, mapping)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo += item
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif not (item is None or isinstance(item, (str, int, float, bool))):
            return type(item).__name__
    return None


def cmd_run(args) -> int:
    from fedlab_nb.repro.report import fmt
    from fedlab_nb.repro.runner import QUICK, run_notebook
    root = _root(args)
    params = _parse_parameters(args.parameter)
    watching = sys.stderr.isatty()  # a bar when someone is watching, else a plain line per cell (logs, CI)
    out = run_notebook(args.paper, args.scale, params, args.device, _results(args, root, write=True), root,
                       progress=True if watching else "lines")
    if out["error"]:  # the error first; then where to read the traceback, only if that notebook exists
        e = out["error"]
        where = f" in cell {e['cell']}" if e["cell"] is not None else ""
        print(printable(f"error: notebook failed{where} after {out['wall_seconds']} s: {e['ename']}: {e['evalue']}"),
              file=sys.stderr)
        if out["notebook"]:
            print(f"the executed notebook, with the traceback: {out['notebook']}", file=sys.stderr)
        else:
            log = Path(out["folder"]) / f"{Path(out['run_dir']).name}.kernel.log"
            earlier = log.with_name(f"{Path(out['run_dir']).name}.ipynb").is_file()
            print("no executed notebook was written" + (f" (the kernel's log: {log})" if log.is_file() else "") +
                  ("; the notebook and figures in the run folder are an earlier run's, kept" if earlier else ""),
                  file=sys.stderr)
    else:
        print(f"executed notebook: {out['notebook']}  ({out['wall_seconds']} s)")
    print(f"run folder: {out['folder']} (parameters.json; figures and metrics in {Path(out['run_dir']).name}/)")
    for name, value in sorted(out["metrics"].items()):
        print(printable(f"  {name} = {fmt(value)}"))  # rounded for reading; the notebook's text is stripped
    if out["error"]:
        return 1
    paper, errored = C.load_paper(args.paper, root), 0
    for claim in paper.claims:
        verdict = C.judge(claim, out["metrics"])
        errored += verdict[0] == C.ERROR
        print(printable(C.claim_line(claim, *verdict)))
    if errored and params.get(QUICK) is True:  # a code-path test on a tiny budget: its claims are never a result
        print(f"{errored} claim(s) could not be judged on this quick run's tiny budget (not a result)", file=sys.stderr)
    elif errored:  # as reproduce: a claim that could not be judged is a failed run, whatever the scale
        print(f"error: {errored} claim(s) could not be judged (ERROR above: a metric the notebook did not record)",
              file=sys.stderr)
        return 1
    return 0


def cmd_params(args) -> int:
    """A paper's notebook parameters (from its cell tagged `parameters`) and what each scale sets."""
    from fedlab_nb.repro.runner import notebook_path, parameter_table
    root = _root(args)
    paper = C.load_paper(args.paper, root)
    rows = parameter_table(notebook_path(paper))
    print(printable(f"{paper.id} — {paper.method}: {paper.notebook}, cell tagged `parameters`"))
    if not rows:
        print("  no parameters (the notebook has no cell tagged parameters; -p is refused)")
    width = [max((len(r[k]) for r in rows), default=0) for k in ("name", "type", "default")]
    for r in rows:
        note = "  # set by --scale" if r["name"] == "scale" else "  # set by --device" if r["name"] == "device" else ""
        comment = f"  # {r['comment']}" if r["comment"] else note
        print(printable(f"  {r['name']:<{width[0]}}  {r['type']:<{width[1]}}  {r['default']:<{width[2]}}{comment}"
                        .rstrip()))
    print("scales (--scale NAME; -p NAME VALUE overrides any of these):")
    for name, scale in paper.scales.items():
        given = ", ".join(f"{k}={v!r}" for k, v in scale["parameters"].items()) or "the notebook's defaults"
        extra = (f"; device {scale['device']}" if scale.get("device") else "") + \
            (f"; about {scale['seconds']} s" if scale.get("seconds") is not None else "")
        print(printable(f"  {name}: {given}{extra}"))
    example = next((r for r in rows if r["name"] not in ("scale", "device", "seed")), None)
    if example:
        print(printable(f"e.g. fedlab-nb run {paper.id} -p {example['name']} {example['default']}"))
    return 0


def cmd_reproduce(args) -> int:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    root = _root(args)
    if args.all == bool(args.papers):
        raise UsageError("give paper ids or --all (not both)")
    ids = C.paper_ids(root) if args.all else list(dict.fromkeys(args.papers))  # a paper named twice runs once
    if args.all and not ids:
        raise UsageError(f"no claims files in {root / 'papers'}; give --root the repository that holds papers/*.yaml")
    if not args.all:  # fail fast on a typo before running anything
        for pid in ids:
            C.claims_path(pid, root)
    jobs = args.jobs if args.jobs is not None else min(len(ids), len(os.sched_getaffinity(0)))
    if jobs < 1:
        raise UsageError(f"-j/--jobs must be >= 1 (notebooks run at once), got {args.jobs}")
    opts = {"scale": args.scale, "force": args.force, "device": args.device, "out_dir": str(_results(args, root, write=True)),
            "root": str(root), "all": args.all, "progress": jobs == 1 and args.scale != "smoke"}
    status, failed, t0 = 0, [], time.perf_counter()
    if jobs == 1:
        done = (_reproduce_paper(pid, opts) for pid in ids)
    else:  # each notebook's kernel is its own process; a worker process per notebook keeps their environments apart
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the kernels inherit it: one thread each, cores not oversubscribed
        pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn"))
        done = _pooled(pool, ids, opts)
    for n, (pid, code, out, err) in enumerate(done, 1):
        prefix = f"[{n}/{len(ids)}] " if len(ids) > 1 else ""
        print(prefix + "\n".join(map(printable, out)), flush=True) if out else None  # a skipped run's lines come from
        print("\n".join(map(printable, err)), file=sys.stderr, flush=True) if err else None  # its result file
        status = max(status, code)
        failed += [pid] if code else []
    if jobs > 1:
        pool.shutdown()
    if len(ids) > 1:
        print(f"{len(ids)} notebooks in {time.perf_counter() - t0:.0f} s ({jobs} at a time)", file=sys.stderr)
    if failed and len(ids) > 1:
        print(f"{len(failed)} of {len(ids)} papers could not be reproduced: {', '.join(failed)}", file=sys.stderr)
    return status


def _pooled(pool, ids, opts):
    """Each paper's (id, status, stdout, stderr) as its worker finishes; a worker process that died (killed, out of
    memory) takes the pool with it: each paper left in it gets one line, not a traceback."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool
    futures = {pool.submit(_reproduce_paper, pid, opts): pid for pid in ids}
    for f in as_completed(futures):
        try:
            yield f.result()
        except BrokenProcessPool:
            pid = futures[f]
            yield pid, 1, [], [f"{pid} ({opts['scale']}): ERROR — a worker process of this parallel run died (killed, "
                               "or out of memory) before it finished; its earlier result, if any, is kept: run it "
                               f"again, e.g. fedlab-nb reproduce {pid} -j 1"]


def _reproduce_paper(pid: str, opts: dict) -> tuple:
    """Reproduce one paper; returns (id, exit status, stdout lines, stderr lines) so that parallel runs print
    each notebook's lines together, as it finishes."""
    from fedlab_nb.repro.runner import mismatches, reproduce
    root, scale, out, err = Path(opts["root"]), opts["scale"], [], []
    try:  # an invalid claims file or a bad parameter: report it, go on with the others
        paper = C.load_paper(pid, root)
        missing = C.missing_requirements(paper) if opts["all"] else []
        if opts["all"] and scale == "paper" and (paper.paper_scale or {}).get("status") != "runs here":
            status = (paper.paper_scale or {}).get("status", "not assessed")
            return pid, 0, [f"{pid} (paper): SKIPPED — {status} (docs/paper_scale.md)"], []
        if missing:  # an optional extra is not installed: not a failure of the reproduction
            return pid, 0, [f"{pid} ({scale}): SKIPPED — needs {', '.join(missing)} "
                            f"(e.g. pip install -e '.[{'flower' if 'flwr' in missing else 'dev'}]')"], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StaleResultWarning)
            r = reproduce(pid, scale, opts["force"], device=opts["device"], out_dir=opts["out_dir"], root=root,
                          progress=opts["progress"])
        err += _warning_lines(caught)
    except C.ReproError as e:
        return pid, e.exit_code, [], [f"{pid}: error: {e}"]
    state = "up to date" if r.get("skipped") else f"{r['wall_seconds']} s"
    code = 0
    out.append(f"{pid} ({scale}): {r['verdict'].upper()}  [{state}]")
    if r["error"]:
        e = r["error"]
        err.append(f"  notebook failed in cell {e['cell']}: {e['ename']}: {e['evalue']}")
        code = 1
    out += [f"  {c['id']}: {c['verdict']}" + (f" ({c['reason']})" if c.get("reason") else "") for c in r["claims"]]
    errored = [c["id"] for c in r["claims"] if c["verdict"] == C.ERROR]
    if errored and not r["error"]:  # a claim that cannot be judged fails the run at every scale
        err.append(f"  {len(errored)} claim(s) could not be judged: {', '.join(errored)} (see the reasons above)")
        code = 1
    if scale == "smoke" and not r["error"]:  # stored verdicts are smoke-scale verdicts
        wrong = mismatches(r)
        err += [f"  MISMATCH {line}" for line in wrong]
        code = max(code, 1 if wrong else 0)
    return pid, code, out, err


def _warning_lines(caught) -> list:
    """Stale-result warnings as one line each; any other warning goes on as usual."""
    lines = []
    for w in caught:
        if issubclass(w.category, StaleResultWarning):
            lines.append(printable(f"warning: {w.message}"))  # the message names a file: its name is text from disk
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return lines


def cmd_report(args) -> int:
    from fedlab_nb.repro.report import build_report, load_results, summary_lines
    root = _root(args)
    results = _results(args, root, write=True)
    build_report(results, root)
    print("\n".join(map(printable, summary_lines(load_results(results, root)))))
    print(f"wrote {results / 'REPORT.md'} and {results / 'index.html'} (open it in a browser)")
    return 0


MAX_NOTEBOOK_BYTES = 512 << 20   # lab copies notebooks/*.ipynb: a regular file of at most this size


def cmd_lab(args) -> int:
    """Copy notebooks/*.ipynb into results/lab/ (keeping copies a user already changed, unless --fresh) and
    start JupyterLab there: the executed cells and their outputs stay out of the tracked notebooks. With
    --student, the student versions (fedlab_nb.repro.course.student_notebook) go to results/lab/student/ and
    JupyterLab opens that folder: the course view, where a student sees no solution."""
    import nbformat
    from fedlab_nb.repro.course import student_notebook
    from fedlab_nb.repro.files import UnsafePathError, make_folder, read_regular, refuse_link, write_atomic
    root = _root(args)
    target = make_folder(_results(args, root, write=True) / "lab")
    if args.student:
        target = make_folder(target / "student")
    copied = 0
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        if not nb.resolve().is_relative_to(root.resolve()):  # as runner.notebook_path: nothing from outside
            raise UnsafePathError(f"{nb} is a link to {nb.resolve()}, outside the repository {root.resolve()}; "
                                  "remove it or copy the notebook into notebooks/")
        dest = refuse_link(target / nb.name)  # a symbolic link there is refused, a hard one replaced (write_atomic)
        if args.fresh or not dest.exists():
            source = read_regular(nb, MAX_NOTEBOOK_BYTES)  # a FIFO or device is refused, not read
            if args.student:
                try:
                    source = nbformat.writes(student_notebook(nbformat.reads(source.decode("utf-8"), as_version=4)))
                except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:  # not UTF-8, not JSON
                    raise C.ReproError(f"cannot make the student version of {nb}: not a readable notebook "
                                       f"({type(e).__name__}: {str(e)[:120]}); fix or remove it") from None
            write_atomic(dest, source)
            copied += 1
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={target}", *_lab_options(args)]
    kind = "student versions" if args.student else "notebooks (instructor copies, solutions included)"
    print(f"{copied} {kind} copied to {target} (existing copies kept; --fresh replaces them)"
          + ("" if args.student else "; students: fedlab-nb lab --student opens the student versions"))
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise UsageError("JupyterLab is not installed: bash scripts/setup.sh dev,flower,notebooks,browser,course "
                         "(or pip install -e '.[notebooks]')") from None
    os.execv(sys.executable, cmd)  # JupyterLab takes over this process (Ctrl-C stops it)


def cmd_history(args) -> int:
    from fedlab_nb.core.history import History
    path = Path(args.path)
    if path.suffix != ".csv" or not path.is_file():
        raise UsageError(f"{path} is not a History CSV file; give the path History.save(...) wrote (e.g. runs/dp.csv)")
    try:
        hist = History.load(path)
    except (ValueError, OSError) as e:  # pandas' parse errors are ValueErrors; a bad .json sidecar names its fix
        raise UsageError(f"cannot read {path} as a History: {e}") from None
    try:
        summary = hist.summary()  # text in a number column fails here, not in load()
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        why = printable((str(e).splitlines() or [type(e).__name__])[0], 160)
        raise UsageError(f"cannot summarise {path} as a History ({why}); give a CSV that History.save(...) wrote, "
                         "numbers in its number columns") from None
    print("\n".join(map(printable, summary.splitlines())))
    return 0


def cmd_figures(args) -> int:
    from fedlab_nb.repro import figures as F
    root = _root(args)
    paper = C.load_paper(args.paper, root)
    if args.action == "update":
        path, lines = F.update_reference(paper, _results(args, root), args.from_dir)
        print("\n".join(f"  {printable(line)}" for line in lines))
        print(f"wrote {path}")
        return 0
    reference = F.load_reference(paper.id, root)
    if reference is None:
        raise C.ReproError(f"no reference {F.reference_path(paper.id, root)}; create it with "
                           f"`fedlab-nb figures update {paper.id}`")
    folder = F.smoke_run_dir(paper.id, root, _results(args, root), args.from_dir)
    problems = F.figure_problems(paper, folder)
    print("\n".join(f"  {printable(p)}" for p in problems) or f"{paper.id}: figure data within tolerance of the reference")
    return 1 if problems else 0


def cmd_data(args) -> int:
    if args.data_command == "fetch":
        from fedlab_nb.data.fetch import fetch
        try:
            print(f"{args.name}: files in {fetch(args.name, args.dir)}")
        except ValueError as e:
            raise UsageError(str(e)) from None
        except OSError as e:  # no network, refused, disk full ...
            raise C.ReproError(f"could not fetch {args.name}: {e}") from None
        return 0
    try:
        from fedlab_nb.data import list_datasets
    except ImportError:
        try:
            from fedlab_nb.data.datasets import list_datasets
        except ImportError as e:
            raise C.ReproError(f"the data set registry is not available ({e})") from None
    for row in list_datasets(check=True):
        state = "available" if row.get("available") else "missing"
        extra = "offline" if row.get("offline") else "needs a local copy"
        print(f"{row['name']:<16} {state:<9} ({extra}) {row.get('description', '')}")
    return 0


class UsageError(C.ReproError):
    exit_code = 2


COMMANDS = {"list": cmd_list, "run": cmd_run, "params": cmd_params, "reproduce": cmd_reproduce, "report": cmd_report, "data": cmd_data,
            "figures": cmd_figures, "history": cmd_history, "lab": cmd_lab}


DISK_ERRORS = {errno.ENOSPC: ("the disk is full", "free space there"),  # (what happened, the fix there)
               errno.EDQUOT: ("the disk quota is used up", "free quota there"),
               errno.EROFS: ("the file system is read-only", "use a writable folder"),
               errno.EIO: ("the disk or mount failed (an I/O error)", "check the disk or network mount"),
               errno.EFBIG: ("a file grew past the file-size limit", "raise the limit (ulimit -f)"),
               errno.ESTALE: ("a network mount went stale", "remount it"),
               errno.EMFILE: ("this process has too many files open", "raise the limit (ulimit -n)"),
               errno.ENFILE: ("the system has too many files open", "close other programs")}
OTHER_OS_ERROR = ("the operating system refused a file operation", "check that path (its name, length and folder)")


def disk_error(e: OSError, args) -> str:
    """One line for a write the disk refused: what happened, where, that finished results are kept, the fix."""
    where = e.filename or _results(args, _root(args))
    what, fix = DISK_ERRORS.get(e.errno, OTHER_OS_ERROR)
    if e.errno not in DISK_ERRORS:  # not a disk that refused a write: no advice about the results folder
        return f"{what} ({e.strerror or e}) on {where}: {fix}"
    return (f"{what} ({e.strerror or e}) while writing {where}; results already written are kept as they were: "
            f"{fix}, or give --results a folder on another disk")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)  # argparse itself exits with 2 on bad usage
    try:
        return COMMANDS[args.command](args)
    except C.ReproError as e:  # its text may quote a file (a notebook, a claims file): printed without control codes
        print(f"fedlab-nb {args.command}: error: {printable(e)}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):  # a folder or file this user may not read or write
            where = printable(e.filename or _results(args, _root(args)))
            print(f"fedlab-nb {args.command}: error: permission denied on {where}; give --results a folder you can "
                  "read and write, or change its permissions", file=sys.stderr)
            return 1
        print(f"fedlab-nb {args.command}: error: {printable(disk_error(e, args))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
