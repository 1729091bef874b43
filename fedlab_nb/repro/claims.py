"""Claims files (`papers/<id>.yaml`): loading, validation, verdicts, and the notebook's `check_claims`.

The format is documented in papers/SCHEMA.md. Verdict of one claim:
`expect` holds -> reproduced; else `partial` holds -> partially reproduced; else not reproduced at this
scale; a missing / NaN metric or a failed notebook -> error. A claim with `seeds: N` is judged on its N
per-seed values instead (verdicts.py): reproduced / not reproduced / inconclusive at this scale.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .expect import Expectation, ExpectationError, MetricError, metric_value, parse_expectation
from .recording import recorded
from .verdicts import (DEFAULT_CONFIDENCE, ERROR, INCONCLUSIVE, MIN_SEEDS, NOT_REPRODUCED, PARTIAL, REPRODUCED,
                       judge_seeded)

STORED_VERDICTS = (REPRODUCED, PARTIAL, NOT_REPRODUCED, INCONCLUSIVE)

ROOT_ENV = "FEDLAB_NB_ROOT"
_PAPER_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # ASCII only, unlike \w
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the repository holding fedlab_nb/, papers/, notebooks/


class ReproError(Exception):
    """A user-facing error of the reproduction harness; `exit_code` 2 = bad usage, 1 = failure."""

    exit_code = 1


class ClaimsFileError(ReproError, ValueError):
    """A claims file is missing a field or has a field of the wrong shape."""


class UnknownPaperError(ReproError, LookupError):
    exit_code = 2


class PaperIdError(ReproError, ValueError):
    """A paper id that is not an identifier (e.g. a path such as '../papers/gas')."""

    exit_code = 2


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    metric: str
    expect: Expectation
    partial: Expectation | None
    paper_value: object
    verdict: str            # stored verdict at smoke scale
    note: str | None
    seeds: int | None = None                # judged on this many per-seed values (verdicts.py)
    confidence: float = DEFAULT_CONFIDENCE  # of the one-sided bounds, for seeded claims
    also_seen: dict | None = None           # {verdict: where}: an adjacent verdict seen on another platform/seed set

    @property
    def accepted(self) -> tuple[str, ...]:
        """The stored verdict, then those also seen: the verdicts a run of this claim may give."""
        return (self.verdict, *(self.also_seen or {}))


@dataclass(frozen=True)
class Paper:
    id: str
    method: str
    paper: dict
    seed_quote: str
    code: str | None
    notebook: str           # relative to the repository root
    scales: dict            # name -> {"device": str|None, "seconds": number|None, "parameters": dict}
    claims: tuple
    path: Path              # the claims file
    requires: tuple = ()    # optional modules the notebook needs (e.g. flwr from an extra)
    figure_tolerance: dict | None = None  # {rtol, atol} for figure data without a seed spread (figures.py)

    @property
    def root(self) -> Path:
        return self.path.parent.parent


# ---------------------------------------------------------------------------------------------- paths
def default_root() -> Path:
    """The repository root: $FEDLAB_NB_ROOT if set, else the folder holding the fedlab_nb package."""
    return Path(os.environ[ROOT_ENV]) if os.environ.get(ROOT_ENV) else PACKAGE_ROOT


def paper_ids(root: Path | None = None) -> list[str]:
    folder = Path(root or default_root()) / "papers"
    return sorted(p.stem for p in folder.glob("*.yaml"))


def check_paper_id(paper_id) -> str:
    """A paper id is an identifier (the name of papers/<id>.yaml): never a path, so it cannot leave papers/."""
    if not isinstance(paper_id, str) or not _PAPER_ID.fullmatch(paper_id):
        raise PaperIdError(f"paper id {paper_id!r} is not an identifier (letters, digits, _; not starting with a "
                           "digit); give the name of a papers/<id>.yaml file, e.g. 'gas', not a path")
    return paper_id


def claims_path(paper_id: str, root: Path | None = None) -> Path:
    """Path of papers/<paper_id>.yaml; an unknown id raises UnknownPaperError with close matches."""
    check_paper_id(paper_id)
    root = Path(root or default_root())
    path = root / "papers" / f"{paper_id}.yaml"
    if not path.is_file():
        known = paper_ids(root)
        close = difflib.get_close_matches(paper_id, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"known papers: {', '.join(known) or 'none'}"
        raise UnknownPaperError(f"unknown paper {paper_id!r} (no {path}); {hint}")
    return path


def find_claims_file(paper_id: str) -> Path:
    """Used from inside a notebook: $FEDLAB_NB_ROOT, then the CWD and its parents, then the package's repo."""
    check_paper_id(paper_id)
    candidates = [Path(os.environ[ROOT_ENV])] if os.environ.get(ROOT_ENV) else []
    cwd = Path.cwd().resolve()
    candidates += [cwd, *cwd.parents, PACKAGE_ROOT]
    for root in candidates:
        if (root / "papers" / f"{paper_id}.yaml").is_file():
            return root / "papers" / f"{paper_id}.yaml"
    return claims_path(paper_id, PACKAGE_ROOT)  # raises with suggestions


# ---------------------------------------------------------------------------------------------- validation
# the known fields of each mapping, in the order the schema lists them
_TOP = ("id", "method", "paper", "seed_quote", "code", "notebook", "scales", "claims", "note", "requires",
        "figure_tolerance")
_TOLERANCE = ("rtol", "atol")
_PAPER = ("title", "authors", "venue", "year", "url")
_SCALE = ("device", "seconds", "parameters", "note")
_CLAIM = ("id", "text", "metric", "expect", "partial", "paper_value", "verdict", "note", "seeds", "confidence",
          "also_seen")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


class _Checker:
    """Field access that raises ClaimsFileError naming the file, the field and what is expected."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str, expected: str):
        raise ClaimsFileError(f"{self.path}: field '{where}' {problem}; expected {expected}")

    def mapping(self, data, where: str, fields: tuple, optional: tuple = ()) -> dict:
        if not isinstance(data, dict):
            self.fail(where or "(top level)", f"is {type(data).__name__}", "a mapping")
        for key in data:
            if key not in fields:
                self.fail(f"{where}.{key}" if where else key, "is not a known field", f"one of {', '.join(fields)}")
        for key in fields:
            if key not in data and key not in optional:
                self.fail(f"{where}.{key}" if where else key, "is missing", "it to be present")
        return data

    def value(self, data: dict, key: str, where: str, types: tuple, expected: str, optional=False):
        if key not in data or (optional and data[key] is None):
            return None
        value = data[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            self.fail(where, f"is {value!r}", expected)
        return value

    def expectation(self, text, where: str) -> Expectation:
        try:
            return parse_expectation(text)
        except ExpectationError as e:
            self.fail(where, f"cannot be parsed ({e})", "e.g. '< 1e-6', '> fedavg_acc + 0.02', "
                      "'within 0.05 of 0.91', 'between 0.4 and 0.6'")


def _seed_fields(c: _Checker, entry: dict, where: str) -> tuple[int | None, float]:
    """`seeds` (an int >= 5) and `confidence` (0.5 < c < 1, only with seeds); `==` cannot be judged over seeds."""
    seeds = c.value(entry, "seeds", f"{where}.seeds", (int,), f"an integer >= {MIN_SEEDS} (or no seeds field for "
                    "a single-run structural claim)", optional=True)
    if seeds is not None and seeds < MIN_SEEDS:
        c.fail(f"{where}.seeds", f"is {seeds}", f"an integer >= {MIN_SEEDS}: noisy claims are judged on at least "
               f"{MIN_SEEDS} seeds")
    confidence = c.value(entry, "confidence", f"{where}.confidence", (int, float), "a number between 0.5 and 1, "
                         "e.g. 0.9", optional=True)
    if confidence is not None and seeds is None:
        c.fail(f"{where}.confidence", "is set without seeds", f"'seeds: N' (N >= {MIN_SEEDS}) beside it, or no "
               "confidence field")
    if confidence is not None and not 0.5 < confidence < 1:
        c.fail(f"{where}.confidence", f"is {confidence!r}", "a number between 0.5 and 1 (exclusive), e.g. 0.9")
    for key in ("expect", "partial"):
        text = entry.get(key)
        if seeds is not None and isinstance(text, str) and text.strip().startswith("=="):
            c.fail(f"{where}.{key}", f"is {text!r} with seeds: {seeds}", "<, <=, >, >=, 'within' or 'between' "
                   "(== cannot be judged over seeds: keep an exact claim single-run, without seeds)")
    return seeds, float(confidence) if confidence is not None else DEFAULT_CONFIDENCE


def _also_seen(c: _Checker, entry: dict, where: str, verdict: str, seeds: int | None) -> dict | None:
    """`also_seen: {inconclusive at this scale: "where it was seen, with numbers"}`: verdicts next to the stored one
    that a seeded claim gave under a change that should not matter (another CPU's floating-point path, another
    seed offset). Never both reproduced and not reproduced: such a claim flips and must be rewritten."""
    raw = entry.get("also_seen")
    if raw is None:
        return None
    if seeds is None:
        c.fail(f"{where}.also_seen", "is set on a single-run claim", "no also_seen: an exact claim must give its "
               "stored verdict everywhere")
    if not isinstance(raw, dict) or not raw:
        c.fail(f"{where}.also_seen", f"is {raw!r}", "a mapping {verdict: where it was seen, with numbers}")
    for seen, why in raw.items():
        if seen not in STORED_VERDICTS or seen == verdict:
            c.fail(f"{where}.also_seen", f"has the key {seen!r}", f"a verdict other than the stored {verdict!r}, one "
                   f"of {' | '.join(STORED_VERDICTS)}")
        if not isinstance(why, str) or not why.strip():
            c.fail(f"{where}.also_seen.{seen}", f"is {why!r}", "where it was seen, with the numbers")
    if {REPRODUCED, NOT_REPRODUCED} <= {verdict, *raw}:
        c.fail(f"{where}.also_seen", "holds both reproduced and not reproduced", "adjacent verdicts only (a claim "
               "seen both ways flips: rewrite it, or store it as inconclusive)")
    return dict(raw)


def _figure_tolerance(c: _Checker, raw) -> dict | None:
    """`figure_tolerance: {rtol: 0.01, atol: 0.01}` (both optional, numbers >= 0)."""
    if raw is None:
        return None
    c.mapping(raw, "figure_tolerance", _TOLERANCE, optional=_TOLERANCE)
    for key in raw:
        value = c.value(raw, key, f"figure_tolerance.{key}", (int, float), "a number >= 0")
        if value < 0:
            c.fail(f"figure_tolerance.{key}", f"is {value!r}", "a number >= 0")
    return {k: float(v) for k, v in raw.items()}


def load_claims(path: Path | str) -> Paper:
    """Read and validate one claims file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClaimsFileError(f"{path}: not valid YAML ({e})") from None
    except OSError as e:
        raise ClaimsFileError(f"{path}: cannot be read ({e.strerror})") from None
    c = _Checker(path)
    c.mapping(data, "", _TOP, optional=("code", "note", "requires", "figure_tolerance"))
    pid = c.value(data, "id", "id", (str,), "a string")
    if pid != path.stem:
        c.fail("id", f"is {pid!r}", f"the file name without .yaml, {path.stem!r}")
    if not _PAPER_ID.fullmatch(pid):
        c.fail("id", f"is {pid!r}", "an identifier (letters, digits, _), also as the file name")
    text_fields = {k: c.value(data, k, k, (str,), "a non-empty string") for k in ("method", "seed_quote", "notebook")}
    for key, value in text_fields.items():
        if not value.strip():
            c.fail(key, "is empty", "a non-empty string")
    _check_notebook_path(c, text_fields["notebook"])
    code = c.value(data, "code", "code", (str,), "a URL string or null", optional=True)

    paper = c.mapping(data["paper"], "paper", _PAPER, optional=("url",))
    for key in ("title", "authors", "venue"):
        c.value(paper, key, f"paper.{key}", (str,), "a string")
    c.value(paper, "year", "paper.year", (int,), "an integer year such as 2024")
    c.value(paper, "url", "paper.url", (str,), "a URL string or null", optional=True)

    scales = {}
    if not isinstance(data["scales"], dict) or "smoke" not in data["scales"]:
        c.fail("scales", "has no 'smoke' entry", "a mapping of scale names (at least 'smoke') to settings")
    for name, entry in data["scales"].items():
        where = f"scales.{name}"
        _check_scale_name(c, name)
        entry = c.mapping({} if entry is None else entry, where, _SCALE, optional=_SCALE)
        params = c.value(entry, "parameters", f"{where}.parameters", (dict,), "a mapping of notebook parameters",
                         optional=True) or {}
        for key in params:
            if not isinstance(key, str) or not _IDENT.match(key):
                c.fail(f"{where}.parameters", f"has key {key!r}", "Python identifiers as parameter names")
        scales[str(name)] = {
            "device": c.value(entry, "device", f"{where}.device", (str,), "a device string such as 'cpu'", True),
            "seconds": c.value(entry, "seconds", f"{where}.seconds", (int, float), "a number of seconds", True),
            "parameters": dict(params),
        }

    if not isinstance(data["claims"], list) or not data["claims"]:
        c.fail("claims", "is empty or not a list", "a non-empty list of claims")
    claims, seen = [], set()
    for i, raw in enumerate(data["claims"]):
        where = f"claims[{i}]"
        entry = c.mapping(raw, where, _CLAIM, optional=("partial", "paper_value", "note", "seeds", "confidence",
                                                       "also_seen"))
        cid = c.value(entry, "id", f"{where}.id", (str,), "an identifier such as 'weight_invariance'")
        if not _IDENT.match(cid) or cid in seen:
            c.fail(f"{where}.id", f"is {cid!r}", "a unique identifier (letters, digits, _)")
        seen.add(cid)
        metric = c.value(entry, "metric", f"{where}.metric", (str,), "the name given to repro.record")
        if not _IDENT.match(metric):
            c.fail(f"{where}.metric", f"is {metric!r}", "an identifier (the name given to repro.record)")
        verdict = c.value(entry, "verdict", f"{where}.verdict", (str,), " | ".join(STORED_VERDICTS))
        if verdict not in STORED_VERDICTS:
            c.fail(f"{where}.verdict", f"is {verdict!r}", " | ".join(STORED_VERDICTS))
        note = c.value(entry, "note", f"{where}.note", (str,), "a string", optional=True)
        if verdict != REPRODUCED and not (note or "").strip():
            c.fail(f"{where}.note", f"is missing for verdict {verdict!r}", "what was tried, with numbers")
        partial = entry.get("partial")
        seeds, confidence = _seed_fields(c, entry, where)
        claims.append(Claim(
            id=cid,
            text=c.value(entry, "text", f"{where}.text", (str,), "one sentence"),
            metric=metric,
            expect=c.expectation(entry["expect"], f"{where}.expect"),
            partial=None if partial is None else c.expectation(partial, f"{where}.partial"),
            paper_value=c.value(entry, "paper_value", f"{where}.paper_value", (str, int, float),
                                "a string or number (or null)", optional=True),
            verdict=verdict,
            note=note,
            seeds=seeds,
            confidence=confidence,
            also_seen=_also_seen(c, entry, where, verdict, seeds),
        ))
    return Paper(id=pid, method=text_fields["method"], paper=dict(paper), seed_quote=text_fields["seed_quote"],
                 code=code, notebook=text_fields["notebook"], scales=scales, claims=tuple(claims), path=path,
                 requires=tuple(c.value(data, "requires", "requires", (list,), "a list of module names", True) or ()),
                 figure_tolerance=_figure_tolerance(c, data.get("figure_tolerance")))


def _check_notebook_path(c: _Checker, notebook: str) -> None:
    """`notebook` is a relative path inside the repository (no absolute path, no '..')."""
    parts = Path(notebook).parts
    if Path(notebook).is_absolute() or notebook.startswith("~") or ".." in parts or "\0" in notebook:
        c.fail("notebook", f"is {notebook!r}", "a path relative to the repository root, without '..', such as "
               "notebooks/<id>.ipynb")


def _check_scale_name(c: _Checker, name) -> None:
    """A scale name names files in the results folder: an identifier, never a path."""
    if not isinstance(name, str) or not _PAPER_ID.fullmatch(name) or len(name) > 64:
        c.fail(f"scales.{str(name)[:80]!r}", "is not an identifier", "letters, digits and _ (at most 64), such as "
               "smoke, medium, paper")


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def missing_requirements(paper: Paper) -> list[str]:
    """The modules in the paper's `requires` whose top-level package is not installed here. Each entry must be
    a dotted module name; only its top-level name is looked up (find_spec('a.b') would import 'a')."""
    import importlib.util
    for m in paper.requires:
        if not isinstance(m, str) or not _MODULE.fullmatch(m) or len(m) > 200:
            raise ClaimsFileError(f"{paper.path}: field 'requires' has {str(m)[:80]!r}; expected dotted module "
                                  "names such as flwr or torch.func")
    return [m for m in paper.requires if importlib.util.find_spec(m.split(".")[0]) is None]


def load_paper(paper_id: str, root: Path | None = None) -> Paper:
    return load_claims(claims_path(paper_id, root))


# ---------------------------------------------------------------------------------------------- verdicts
def judge(claim: Claim, metrics: dict) -> tuple[str, str | None]:
    """(verdict, reason) of one claim against recorded metrics; reason is set for errors only."""
    return judge_detail(claim, metrics)[:2]


def judge_detail(claim: Claim, metrics: dict) -> tuple[str, str | None, dict | None]:
    """(verdict, reason, interval summary): the summary is set for seeded claims (verdicts.judge_seeded)."""
    try:
        if claim.seeds is not None:
            verdict, summary = judge_seeded(claim.expect, claim.partial, claim.metric, claim.seeds, metrics,
                                            claim.confidence)
            return verdict, None, summary
        _refuse_per_seed_lists(claim, metrics)
        value = metric_value(metrics, claim.metric)
        if claim.expect.holds(value, metrics):
            return REPRODUCED, None, None
        if claim.partial is not None and claim.partial.holds(value, metrics):
            return PARTIAL, None, None
        return NOT_REPRODUCED, None, None
    except MetricError as e:
        return ERROR, str(e), None


def _refuse_per_seed_lists(claim: Claim, metrics: dict) -> None:
    """A single-run claim cannot silently compare a per-seed list: say how to fix the claims file."""
    names = {claim.metric} | claim.expect.names | (claim.partial.names if claim.partial else set())
    for name in sorted(names):
        if isinstance(metrics.get(name), list):
            raise MetricError(f"metric {name} holds {len(metrics[name])} per-seed values but claim {claim.id} "
                              f"has no seeds field; add 'seeds: {len(metrics[name])}' to it (or record one number)")


def paper_verdict(verdicts: list[str]) -> str:
    """Summary over claims: error if any errored, reproduced if all were, not reproduced if all were not,
    inconclusive if none was (even partially) reproduced but some were inconclusive, else partially
    reproduced (papers/SCHEMA.md)."""
    if not verdicts or ERROR in verdicts:
        return ERROR
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    if all(v == NOT_REPRODUCED for v in verdicts):
        return NOT_REPRODUCED
    if all(v in (NOT_REPRODUCED, INCONCLUSIVE) for v in verdicts):
        return INCONCLUSIVE
    return PARTIAL


def claim_line(claim: Claim, verdict: str, reason: str | None = None) -> str:
    """The stable line printed by check_claims: no measured numbers in it (a seeded claim says its n). A claim
    with `also_seen` names every accepted verdict, then this run's, which notebooks/sanitize.cfg masks for nbval
    (the run's verdict is still judged against the accepted ones: runner.mismatches)."""
    label = f"ERROR ({reason})" if verdict == ERROR else verdict.upper()
    seeds = f", {claim.seeds} seeds" if claim.seeds is not None else ""
    if claim.also_seen and verdict != ERROR:
        label = " or ".join(v.upper() for v in claim.accepted) + f" (this run: {label})"
    return f"{claim.id} ({claim.metric} {claim.expect.text}{seeds}): {label}"


def claim_verdicts(paper_id: str, metrics: dict | None = None) -> list[tuple[Claim, str, str | None]]:
    """(claim, verdict, reason) for each claim of papers/<paper_id>.yaml, against this session's metrics."""
    paper = load_claims(find_claims_file(paper_id))
    metrics = recorded() if metrics is None else metrics
    return [(claim, *judge(claim, metrics)) for claim in paper.claims]


def check_claims(paper_id: str, metrics: dict | None = None) -> None:
    """Print one stable verdict line per claim of papers/<paper_id>.yaml; call it last in the claims cell.

    Returns None so that Jupyter shows only the printed lines (nbval compares them)."""
    for claim, verdict, reason in claim_verdicts(paper_id, metrics):
        print(claim_line(claim, verdict, reason))


def show_intervals(paper_id: str, metrics: dict | None = None) -> None:
    """Print mean ± half-width per seeded claim; for a cell nbval does not check (the numbers vary)."""
    from .verdicts import summary_text
    paper = load_claims(find_claims_file(paper_id))
    metrics = recorded() if metrics is None else metrics
    for claim in paper.claims:
        if claim.seeds is not None:
            verdict, reason, summary = judge_detail(claim, metrics)
            print(f"{claim.id}: {summary_text(summary) or reason} -> {verdict}")
