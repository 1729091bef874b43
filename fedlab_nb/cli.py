"""`fedlab-nb`: list papers, run or reproduce their notebooks, build the report, list data sets.

    fedlab-nb list
    fedlab-nb run afl -p clients 20 --scale smoke --device cpu
    fedlab-nb reproduce afl fedau --scale smoke [--force]      |   fedlab-nb reproduce --all
    fedlab-nb report
    fedlab-nb data                |   fedlab-nb data fetch mnist
Papers are papers/*.yaml under the repository root (the folder holding fedlab_nb/), or --root / $FEDLAB_NB_ROOT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from fedlab_nb.repro import claims as C


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

    command("list", "papers, their claims and the last verdicts")
    run = command("run", "execute one paper's notebook with papermill")
    run.add_argument("paper")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="notebook parameter; VALUE is read as YAML (0.1 -> float, true -> bool)")
    rep = command("reproduce", "run notebooks, check claims, write results/<id>-<scale>.json")
    rep.add_argument("papers", nargs="*")
    rep.add_argument("--all", action="store_true", help="every papers/*.yaml")
    rep.add_argument("--force", action="store_true", help="re-run even if the result is up to date")
    for p in (run, rep):
        p.add_argument("--scale", default="smoke", help="a scale of the claims file (default: smoke)")
        p.add_argument("--device", help="override the notebook's device parameter (cpu, cuda, auto)")
    command("report", "results/REPORT.md and results/index.html from all results")
    data = command("data", "registered data sets and whether they are available offline")
    fetch = data.add_subparsers(dest="data_command").add_parser(
        "fetch", help="download one data set's original files (needs internet; the only download)")
    fetch.add_argument("name")
    fetch.add_argument("--dir", help="target folder (default: $FEDLAB_NB_DATA/NAME or ~/.cache/fedlab_nb/NAME)")
    return ap


def _root(args) -> Path:
    return Path(args.root) if args.root else C.default_root()


def _results(args, root: Path) -> Path:
    return Path(args.results or os.environ.get("FEDLAB_NB_RESULTS") or root / "results")


def cmd_list(args) -> int:
    root, status = _root(args), 0
    ids = C.paper_ids(root)
    if not ids:
        print(f"no claims files in {root / 'papers'}")
    results = _results(args, root)
    for pid in ids:
        try:
            paper = C.load_paper(pid, root)
        except C.ReproError as e:
            print(f"{pid}: INVALID: {e}", file=sys.stderr)
            status = 1
            continue
        last = {}
        for path in sorted(results.glob(f"{pid}-*.json")):
            data = json.loads(path.read_text())
            if data.get("paper") == pid:
                last[data["scale"]] = data
        runs = "; ".join(f"{s}: {r['verdict']}" for s, r in last.items()) or "not run yet"
        print(f"{pid} — {paper.method} ({len(paper.claims)} claims; last: {runs})")
        for claim in paper.claims:
            seen = ", ".join(f"{s}: {r['verdict']}" for s, r in last.items()
                             for r in r["claims"] if r["id"] == claim.id)
            print(f"  {claim.id} ({claim.metric} {claim.expect.text}): stored {claim.verdict}"
                  + (f"; last {seen}" if seen else ""))
    return status


def _parse_parameters(pairs) -> dict:
    params = {}
    for name, text in pairs:
        try:
            params[name] = yaml.safe_load(text)
        except yaml.YAMLError:
            params[name] = text
    return params


def cmd_run(args) -> int:
    from fedlab_nb.repro.runner import run_notebook
    root = _root(args)
    params = _parse_parameters(args.parameter)
    out = run_notebook(args.paper, args.scale, params, args.device, _results(args, root), root)
    print(f"executed notebook: {out['notebook']}  ({out['wall_seconds']} s)")
    for name, value in sorted(out["metrics"].items()):
        print(f"  {name} = {value}")
    if out["error"]:
        e = out["error"]
        print(f"error: notebook failed in cell {e['cell']}: {e['ename']}: {e['evalue']}", file=sys.stderr)
        return 1
    paper = C.load_paper(args.paper, root)
    for claim in paper.claims:
        print(C.claim_line(claim, *C.judge(claim, out["metrics"])))
    return 0


def cmd_reproduce(args) -> int:
    from tqdm import tqdm
    from fedlab_nb.repro.runner import mismatches, reproduce
    root = _root(args)
    if args.all == bool(args.papers):
        raise UsageError("give paper ids or --all (not both)")
    ids = C.paper_ids(root) if args.all else args.papers
    if not args.all:  # fail fast on a typo before running anything
        for pid in ids:
            C.claims_path(pid, root)
    status = 0
    for pid in tqdm(ids, desc="papers", unit="paper", file=sys.stderr, disable=len(ids) < 2):
        missing = C.missing_requirements(C.load_paper(pid, root)) if args.all else []
        if missing:  # an optional extra is not installed: not a failure of the reproduction
            tqdm.write(f"{pid} ({args.scale}): SKIPPED — needs {', '.join(missing)} "
                       f"(e.g. pip install -e '.[{'flower' if 'flwr' in missing else 'dev'}]')")
            continue
        try:
            r = reproduce(pid, args.scale, args.force, device=args.device, out_dir=_results(args, root), root=root)
        except C.ReproError as e:  # e.g. an invalid claims file: report it, go on with the others
            tqdm.write(f"{pid}: error: {e}", file=sys.stderr)
            status = max(status, 1)
            continue
        state = "up to date" if r.get("skipped") else f"{r['wall_seconds']} s"
        tqdm.write(f"{pid} ({args.scale}): {r['verdict'].upper()}  [{state}]")
        if r["error"]:
            e = r["error"]
            tqdm.write(f"  notebook failed in cell {e['cell']}: {e['ename']}: {e['evalue']}", file=sys.stderr)
            status = 1
        for c in r["claims"]:
            tqdm.write(f"  {c['id']}: {c['verdict']}" + (f" ({c['reason']})" if c.get("reason") else ""))
        if args.scale == "smoke" and not r["error"]:  # stored verdicts are smoke-scale verdicts
            for line in mismatches(r):
                tqdm.write(f"  MISMATCH {line}", file=sys.stderr)
                status = 1
    return status


def cmd_report(args) -> int:
    from fedlab_nb.repro.report import build_report
    results = _results(args, _root(args))
    print(build_report(results))
    print(f"wrote {results / 'REPORT.md'} and {results / 'index.html'}", file=sys.stderr)
    return 0


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


COMMANDS = {"list": cmd_list, "run": cmd_run, "reproduce": cmd_reproduce, "report": cmd_report, "data": cmd_data}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)  # argparse itself exits with 2 on bad usage
    try:
        return COMMANDS[args.command](args)
    except C.ReproError as e:
        print(f"fedlab-nb {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
