"""Claims files (`papers/<id>.yaml`): loading, validation, verdicts, and the notebook's `check_claims`.

The format is documented in papers/SCHEMA.md. Verdict of one claim:
`expect` holds -> reproduced; else `partial` holds -> partially reproduced; else not reproduced at this
scale; a missing / NaN metric or a failed notebook -> error. A claim with `seeds: N` is judged on its N
per-seed values instead (verdicts.py): reproduced / not reproduced / inconclusive at this scale.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .expect import Expectation, ExpectationError, MetricError, covers, metric_value, parse_expectation
from .recording import recorded
from .verdicts import (DEFAULT_CONFIDENCE, ERROR, INCONCLUSIVE, MIN_SEEDS, NOT_REPRODUCED, PARTIAL, REPRODUCED,
                       judge_seeded, summary_text)

STORED_VERDICTS = (REPRODUCED, PARTIAL, NOT_REPRODUCED, INCONCLUSIVE)
HEADLINE, SUPPORTING, CHECK = "headline", "supporting", "check"
ROLES = (HEADLINE, SUPPORTING, CHECK)
CONSTRUCT = "construct"
IMPLEMENTATIONS = ("paper", "official-code", CONSTRUCT)
# a metric named with one of these words (between underscores) is bounded, and must declare its `range`
BOUNDED_WORDS = frozenset("acc accuracy auroc auc cos cosine corr correlation spearman pearson kendall prob "
                          "probability frac fraction".split())
MAX_HEADLINES = 3  # a paper's abstract makes one to three claims; more would dilute its verdict
MAX_CLAIMS_BYTES = 1_000_000  # a claims file is a page of text; a larger one is refused before parsing
MAX_CLAIMS_NODES = 20_000     # values (scalars, lists, mappings) in one; the largest here holds under 700

ROOT_ENV = "FEDLAB_NB_ROOT"
_PAPER_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # ASCII only, unlike \w
SCALE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")  # names files results/<id>-<scale>.json: never a path
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
    role: str = SUPPORTING                  # headline | supporting | check (papers/SCHEMA.md, "Version 3")
    range: tuple | None = None              # (lo, hi): every value the metric can take, for bounded metrics
    paper_note: str | None = None           # why the paper's number is absent, or why only the sign is tested
    setting: dict | None = None             # headline claims: {paper: ..., ours: ...}

    @property
    def accepted(self) -> tuple[str, ...]:
        """The stored verdict, then those also seen: the verdicts a run of this claim may give."""
        return (self.verdict, *(self.also_seen or {}))


@dataclass(frozen=True)
class ReportRow:
    """A number shown without a verdict (`report:` in a claims file): it cannot fail, so it is not a claim."""

    id: str
    text: str
    metric: str
    note: str | None = None
    range: tuple | None = None


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
    implementation: str = "paper"   # paper | official-code | construct: what the notebook implements
    sources: tuple = ()             # what was read (paper text, official code, summaries) and what was not
    report: tuple = ()              # ReportRow: numbers shown without a verdict
    paper_scale: dict | None = None  # the paper's own experiment: setting, data, status, estimate (SCHEMA.md)

    @property
    def root(self) -> Path:
        return self.path.parent.parent

    @property
    def headlines(self) -> tuple:
        return tuple(c for c in self.claims if c.role == HEADLINE)

    @property
    def is_construct(self) -> bool:
        return self.implementation == CONSTRUCT


# ---------------------------------------------------------------------------------------------- paths
def default_root() -> Path:
    """The repository root: $FEDLAB_NB_ROOT if set, else the folder holding the fedlab_nb package."""
    return Path(os.environ[ROOT_ENV]) if os.environ.get(ROOT_ENV) else PACKAGE_ROOT


def paper_ids(root: Path | None = None) -> list[str]:
    folder = Path(root or default_root()) / "papers"
    return sorted(p.stem for p in folder.glob("*.yaml"))


MAX_EXPECT = 1000  # characters of one expect / partial; the longest in papers/ is 62
MAX_PAPER_ID = 64  # the longest papers/<id>.yaml is 30 characters; file systems refuse names over 255 bytes


def check_paper_id(paper_id) -> str:
    """A paper id is an identifier (the name of papers/<id>.yaml): never a path, so it cannot leave papers/."""
    shown = repr(paper_id) if len(repr(paper_id)) <= 80 else f"{repr(paper_id)[:60]}… ({len(repr(paper_id))} characters)"
    if isinstance(paper_id, str) and len(paper_id) > MAX_PAPER_ID:
        raise PaperIdError(f"paper id {shown} is too long (at most {MAX_PAPER_ID} characters); give the name of a "
                           "papers/<id>.yaml file, e.g. 'gas'")
    if not isinstance(paper_id, str) or not _PAPER_ID.fullmatch(paper_id):
        raise PaperIdError(f"paper id {shown} is not an identifier (letters, digits, _; not starting with a "
                           "digit); give the name of a papers/<id>.yaml file, e.g. 'gas', not a path")
    return paper_id


def claims_path(paper_id: str, root: Path | None = None) -> Path:
    """Path of papers/<paper_id>.yaml; an unknown id raises UnknownPaperError with close matches."""
    check_paper_id(paper_id)
    root = Path(root or default_root())
    path = root / "papers" / f"{paper_id}.yaml"
    if path.exists() and not path.is_file():  # a link to /dev/zero, a FIFO, a folder: not "unknown"
        raise _not_regular(path)
    if path.is_symlink() and not path.exists():  # a link to nothing, or a loop: it is there, but broken
        raise ReproError(f"{path} is a symbolic link that leads nowhere (to {os.readlink(path)!r}: missing, or a "
                         "loop); remove it, or point it at a claims file")
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
_TOP = ("id", "method", "paper", "seed_quote", "code", "implementation", "sources", "notebook", "scales", "claims",
        "report", "note", "requires", "figure_tolerance", "paper_scale")
_TOLERANCE = ("rtol", "atol")
_PAPER = ("title", "authors", "venue", "year", "url")
_SCALE = ("device", "seconds", "parameters", "note")
_CLAIM = ("id", "role", "text", "metric", "range", "expect", "partial", "paper_value", "paper_note", "setting",
          "verdict", "note", "seeds", "confidence", "also_seen")
_REPORT = ("id", "text", "metric", "range", "note", "paper_value", "seeds")
_PAPER_SCALE = ("setting", "data", "status", "estimate", "note", "paper_sized")
PAPER_SCALE_STATUS = ("runs here", "needs a GPU", "needs data", "no experiment")
_SETTING = ("paper", "ours")
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

    def expectation(self, text, where: str, claim: str | None = None) -> Expectation:
        if isinstance(text, str) and len(text) > MAX_EXPECT:  # it would be echoed whole in every error line
            self.fail(where, ("" if claim is None else f"of claim {claim!r} ") + f"is {len(text):,} characters long",
                      f"an expectation of at most {MAX_EXPECT} characters, e.g. '> fedavg_acc + 0.02'")
        try:
            return parse_expectation(text)
        except ExpectationError as e:
            self.fail(where, ("" if claim is None else f"of claim {claim!r} ") + f"cannot be parsed ({e})", "e.g. '< 1e-6', '> fedavg_acc + 0.02', "
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


def _range(c: _Checker, entry: dict, where: str, metric: str) -> tuple | None:
    """`range: [lo, hi]`, finite, lo < hi; required when the metric's name says it is bounded (BOUNDED_WORDS)."""
    raw = entry.get("range")
    if raw is None:
        words = set(metric.lower().split("_")) & BOUNDED_WORDS
        if words:
            c.fail(f"{where}.range", f"is missing for metric {metric!r} (the word {sorted(words)[0]!r} says it is "
                   "bounded)", "the metric's whole range, e.g. 'range: [0, 1]' for an accuracy, '[-1, 1]' for a "
                   "difference of accuracies or a correlation")
        return None
    ends = raw if isinstance(raw, list) and len(raw) == 2 else [None, None]
    ok = isinstance(raw, list) and len(raw) == 2 and raw != [None, None] and all(
        v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in raw)
    low, high = (-math.inf if ends[0] is None else ends[0]), (math.inf if ends[1] is None else ends[1])
    if not ok or low >= high:
        c.fail(f"{where}.range", f"is {raw!r}", "[lo, hi]: two finite numbers with lo < hi, e.g. [0, 1], or null for "
               "an open end, e.g. [0, null] for a ratio")
    return float(low), float(high)


def _can_fail(c: _Checker, expectation: Expectation | None, where: str, span: tuple | None) -> None:
    """Refuse an expectation that holds on the metric's whole range: it cannot fail, so it is not a claim."""
    if expectation is not None and span is not None and covers(expectation, *span):
        c.fail(where, f"is {expectation.text!r}, which holds for every value of the metric's range "
               f"[{span[0]:g}, {span[1]:g}] (it cannot fail)", "a bound that some value of the range fails, or the "
               "number moved to the file's 'report:' list (shown without a verdict)")


def _not_self_referential(c: _Checker, expectation: Expectation | None, where: str, metric: str) -> None:
    """Refuse an expectation whose bound names the claim's own metric ('<= value' on metric value): it cannot fail."""
    if expectation is not None and metric in expectation.names:
        c.fail(where, f"is {expectation.text!r}, whose bound names the claim's own metric {metric!r} (it compares the "
               "metric with itself, so it cannot fail)", "a bound in numbers or other metrics, e.g. '<= 10' or "
               "'<= baseline_value'")


def _role_fields(c: _Checker, entry: dict, where: str, seeds: int | None) -> tuple[str, str | None, dict | None]:
    """(role, paper_note, setting): a check is single-run; a headline carries the paper's number and setting."""
    role = c.value(entry, "role", f"{where}.role", (str,), " | ".join(ROLES))
    if role is None:
        c.fail(f"{where}.role", "is missing", f"one of {' | '.join(ROLES)}: headline for what the paper's abstract "
               "or introduction claims, check for an identity or exact special case, else supporting")
    if role not in ROLES:
        c.fail(f"{where}.role", f"is {role!r}", f"one of {' | '.join(ROLES)} (papers/SCHEMA.md, 'Roles')")
    if role == CHECK and seeds is not None:
        c.fail(f"{where}.seeds", f"is set on a check (seeds: {seeds})", "no seeds: a check is an exact, single-run "
               "test of our code; a claim judged over seeds is 'role: supporting' or 'role: headline'")
    paper_note = c.value(entry, "paper_note", f"{where}.paper_note", (str,), "a string", optional=True)
    setting = entry.get("setting")
    if role != HEADLINE:
        if setting is not None:
            c.mapping(setting, f"{where}.setting", _SETTING)
        return role, paper_note, setting
    if "paper_value" not in entry:
        c.fail(f"{where}.paper_value", "is missing on a headline claim", "the paper's number with its location, "
               "e.g. '0.843 (Table 2, FedProx mu=1, Synthetic(1,1))', or null with paper_note saying why")
    value = entry["paper_value"]
    if value is None and not (paper_note or "").strip():
        c.fail(f"{where}.paper_note", "is missing beside 'paper_value: null' on a headline claim", "why the paper "
               "gives no number for it (or what was searched when its text was not reachable)")
    if value is not None and not (isinstance(value, str) and re.search(r"\d", value) and re.search(r"\(.+\)", value)):
        c.fail(f"{where}.paper_value", f"is {value!r}", "the paper's number with its location in parentheses, e.g. "
               "'0.843 (Table 2, ...)', or null with paper_note")
    c.mapping(setting, f"{where}.setting", _SETTING)
    for key in _SETTING:
        text = c.value(setting, key, f"{where}.setting.{key}", (str,), "a string: data, model, clients, rounds")
        if not text.strip():
            c.fail(f"{where}.setting.{key}", "is empty", "data, model, clients, rounds")
    return role, paper_note, dict(setting)


def _implementation(c: _Checker, data: dict) -> tuple[str, tuple]:
    """`implementation: paper | official-code | construct` and `sources:` (a non-empty list of strings)."""
    implementation = c.value(data, "implementation", "implementation", (str,), " | ".join(IMPLEMENTATIONS))
    if implementation not in IMPLEMENTATIONS:
        c.fail("implementation", f"is {implementation!r}", f"one of {' | '.join(IMPLEMENTATIONS)}")
    sources = c.value(data, "sources", "sources", (list,), "a list of strings: what was read, what was not reachable")
    if not sources or not all(isinstance(x, str) and x.strip() for x in sources):
        c.fail("sources", f"is {sources!r}", "a non-empty list of non-empty strings")
    return implementation, tuple(sources)


def _report_rows(c: _Checker, raw, taken: set) -> tuple:
    """`report:` rows: {id, text, metric, range?, note?}; ids unique among claims and report rows."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        c.fail("report", f"is {type(raw).__name__}", "a list of {id, text, metric, note} rows")
    rows = []
    for i, entry in enumerate(raw):
        where = f"report[{i}]"
        c.mapping(entry, where, _REPORT, optional=("range", "note", "paper_value", "seeds"))
        rid = c.value(entry, "id", f"{where}.id", (str,), "an identifier")
        metric = c.value(entry, "metric", f"{where}.metric", (str,), "the name given to repro.record")
        for key, value in (("id", rid), ("metric", metric)):
            if not _IDENT.match(value) or (key == "id" and value in taken):
                c.fail(f"{where}.{key}", f"is {value!r}", "a unique identifier (letters, digits, _)")
        taken.add(rid)
        rows.append(ReportRow(id=rid, metric=metric, range=_range(c, entry, where, metric),
                              text=c.value(entry, "text", f"{where}.text", (str,), "one sentence"),
                              note=c.value(entry, "note", f"{where}.note", (str,), "a string", optional=True)))
    return tuple(rows)


def _paper_scale(c: _Checker, raw, scales: dict, ids: set) -> dict | None:
    """`paper_scale: {setting, data, status, estimate, note, paper_sized}`: the paper's own experiment and whether it
    runs here. 'runs here' needs a `paper` scale on the CPU; a stand-in runs under `paper-substitute`, never under
    `paper`. `paper_sized` lists the claims and report rows that run at the paper's own size under scale `paper`
    (absent: all of them); the others run at their smoke setting there, and tables say so."""
    if raw is None:
        return None
    c.mapping(raw, "paper_scale", _PAPER_SCALE, optional=("estimate", "note", "paper_sized"))
    _paper_sized(c, raw.get("paper_sized", ...), ids)
    for key in ("setting", "data", "status"):
        text = c.value(raw, key, f"paper_scale.{key}", (str,), "a string")
        if not text.strip():
            c.fail(f"paper_scale.{key}", "is empty", "a string")
    for key in ("estimate", "note"):
        c.value(raw, key, f"paper_scale.{key}", (str,), "a string", optional=True)
    if raw["status"] not in PAPER_SCALE_STATUS:
        c.fail("paper_scale.status", f"is {raw['status']!r}", " | ".join(PAPER_SCALE_STATUS))
    if "paper" in scales and raw["status"] not in ("runs here", "needs a GPU"):
        c.fail("scales.paper", f"is set while paper_scale.status is {raw['status']!r}: the paper's own setting does "
               "not run here", "name the stand-in 'paper-substitute' (never 'paper'), or run the paper's setting")
    if raw["status"] == "runs here" and (scales.get("paper") or {}).get("device") != "cpu":
        c.fail("scales.paper.device", f"is {(scales.get('paper') or {}).get('device')!r} while paper_scale.status is "
               "'runs here'", "'cpu': the paper's own setting runs on this machine's CPU")
    return dict(raw)


def _paper_sized(c: _Checker, raw, ids: set) -> None:
    """`paper_scale.paper_sized`: a non-empty list of distinct claim / report ids of this file."""
    if raw is ...:
        return
    if not isinstance(raw, list) or not raw or not all(isinstance(i, str) for i in raw):
        c.fail("paper_scale.paper_sized", f"is {raw!r}", "a non-empty list of claim or report ids (leave it out when "
               "every claim runs at the paper's size)")
    for cid in raw:
        if cid not in ids or raw.count(cid) > 1:
            c.fail("paper_scale.paper_sized", f"names {cid!r} " + ("twice" if cid in ids else "(no such claim)"),
                   "ids from this file's claims and report rows, each once")


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


def _finite_json(value) -> bool:
    """No float inf or NaN anywhere in a parameter's value (lists and mappings included; walked without
    recursion, so any depth is fine)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ())
    return True


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a mapping's duplicate key (PyYAML keeps the last silently) and any alias (a few
    nested aliases expand to gigabytes: an alias bomb)."""

    def compose_node(self, parent, index):
        self.nodes = getattr(self, "nodes", 0) + 1
        if self.nodes > MAX_CLAIMS_NODES:  # parsing is pure Python: 480,000 values in 1 MB take ~20 s to load
            raise yaml.MarkedYAMLError(None, None, f"more than {MAX_CLAIMS_NODES:,} values (a claims file holds a "
                                       "few hundred); keep large data out of it", self.peek_event().start_mark)
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.MarkedYAMLError(None, None, "aliases (*name) are not allowed in a claims file; write the "
                                       "value out", mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # '? [a, b]': unhashable, and never a claims file's key
                raise yaml.MarkedYAMLError(None, None, "a mapping key must be a plain name, not a list or a mapping",
                                           key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.MarkedYAMLError(None, None, f"duplicate key {key!r} (PyYAML would keep only the last); "
                                           "delete one of them", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _not_regular(path: Path) -> ClaimsFileError:
    """The error for a claims path that is there but is not a regular file."""
    return ClaimsFileError(f"{path}: not a regular file (a device, a FIFO or a folder, perhaps through a link), so "
                           "it is not read as a claims file; replace it with the paper's YAML or remove it")


def _read_regular(path: Path, limit: int) -> bytes:
    """At most limit + 1 bytes of `path`, a regular file (opened without blocking: a FIFO or a device that
    took its place is refused, not read until memory runs out)."""
    import stat
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        return f.read(limit + 1)


def read_yaml(path: Path):
    """The claims file's YAML (strict: no duplicate keys, no aliases, at most MAX_CLAIMS_BYTES)."""
    try:
        raw = _read_regular(path, MAX_CLAIMS_BYTES)
        if len(raw) > MAX_CLAIMS_BYTES:
            raise ClaimsFileError(f"{path}: over {MAX_CLAIMS_BYTES} bytes; a claims file may hold at most {MAX_CLAIMS_BYTES}")
        return yaml.load(raw.decode("utf-8"), Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ClaimsFileError(f"{path}: not valid YAML ({e.problem or e.context}{where})") from None
    except yaml.YAMLError as e:
        raise ClaimsFileError(f"{path}: not valid YAML ({e})") from None
    except UnicodeDecodeError as e:
        raise ClaimsFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ClaimsFileError(f"{path}: cannot be read ({e.strerror})") from None
    except RecursionError:
        raise ClaimsFileError(f"{path}: not valid YAML (lists or mappings nested too deeply); "
                              "flatten the nesting") from None
    except ValueError as e:  # a tag's constructor: !!float abc, !!int abc, an int of thousands of digits
        raise ClaimsFileError(f"{path}: not valid YAML ({yaml_value_problem(e)}); fix that value") from None


def yaml_value_problem(e: ValueError) -> str:
    """One line on a YAML value its constructor refused (!!float abc, an integer of thousands of digits)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "integer string conversion" in text:
        text = "an integer of thousands of digits"
    return f"a value cannot be read: {text}"


def load_claims(path: Path | str) -> Paper:
    """Read and validate one claims file."""
    path = Path(path)
    data = read_yaml(path)
    c = _Checker(path)
    c.mapping(data, "", _TOP, optional=("code", "note", "requires", "figure_tolerance", "report", "paper_scale"))
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
            if not _finite_json(params[key]):  # parameters.json is strict JSON: .nan / .inf cannot be recorded
                c.fail(f"{where}.parameters.{key}", "holds inf or NaN", "finite numbers (parameters.json is strict JSON)")
        seconds = c.value(entry, "seconds", f"{where}.seconds", (int, float), "a number of seconds", True)
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            c.fail(f"{where}.seconds", f"is {seconds!r}", "a finite number of seconds > 0 (the run's rough time)")
        scales[str(name)] = {
            "device": c.value(entry, "device", f"{where}.device", (str,), "a device string such as 'cpu'", True),
            "seconds": seconds,
            "parameters": dict(params),
        }

    if not isinstance(data["claims"], list) or not data["claims"]:
        c.fail("claims", "is empty or not a list", "a non-empty list of claims")
    claims, seen = [], set()
    for i, raw in enumerate(data["claims"]):
        where = f"claims[{i}]"
        entry = c.mapping(raw, where, _CLAIM, optional=("partial", "paper_value", "note", "seeds", "confidence",
                                                       "also_seen", "range", "paper_note", "setting", "role"))
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
        seeds, confidence = _seed_fields(c, entry, where)
        role, paper_note, setting = _role_fields(c, entry, where, seeds)
        span = _range(c, entry, where, metric)
        expect = c.expectation(entry["expect"], f"{where}.expect", cid)
        partial = None if entry.get("partial") is None else c.expectation(entry["partial"], f"{where}.partial", cid)
        for field_name, e in (("expect", expect), ("partial", partial)):
            _can_fail(c, e, f"{where}.{field_name}", span)
            _not_self_referential(c, e, f"{where}.{field_name}", metric)
        claims.append(Claim(
            id=cid,
            text=c.value(entry, "text", f"{where}.text", (str,), "one sentence"),
            metric=metric,
            expect=expect,
            partial=partial,
            paper_value=c.value(entry, "paper_value", f"{where}.paper_value", (str, int, float),
                                "a string or number (or null)", optional=True),
            verdict=verdict,
            note=note,
            seeds=seeds,
            confidence=confidence,
            also_seen=_also_seen(c, entry, where, verdict, seeds),
            role=role, range=span, paper_note=paper_note, setting=setting,
        ))
    n_headlines = sum(claim.role == HEADLINE for claim in claims)
    if not 1 <= n_headlines <= MAX_HEADLINES:
        c.fail("claims", f"has {n_headlines} claims with 'role: headline'", f"1 to {MAX_HEADLINES}: what the paper's "
               "abstract or introduction claims (the paper's verdict comes from its headline claims)")
    implementation, sources = _implementation(c, data)
    report = _report_rows(c, data.get("report"), seen)
    ids = {claim.id for claim in claims} | {row.id for row in report}
    return Paper(id=pid, method=text_fields["method"], paper=dict(paper), seed_quote=text_fields["seed_quote"],
                 code=code, notebook=text_fields["notebook"], scales=scales, claims=tuple(claims), path=path,
                 requires=_requires(c, data),
                 figure_tolerance=_figure_tolerance(c, data.get("figure_tolerance")),
                 implementation=implementation, sources=sources, report=report,
                 paper_scale=_paper_scale(c, data.get("paper_scale"), scales, ids))


def _check_notebook_path(c: _Checker, notebook: str) -> None:
    """`notebook` is a relative path inside the repository (no absolute path, no '..')."""
    parts = Path(notebook).parts
    if Path(notebook).is_absolute() or notebook.startswith("~") or ".." in parts or "\0" in notebook:
        c.fail("notebook", f"is {notebook!r}", "a path relative to the repository root, without '..', such as "
               "notebooks/<id>.ipynb")
    if any(len(part.encode("utf-8", "replace")) > 255 for part in parts) or len(notebook) > 1024:
        c.fail("notebook", f"is a name too long for a file system ({len(notebook)} characters, {notebook[:40]!r}…)",
               "a path relative to the repository root with parts of at most 255 bytes, such as notebooks/<id>.ipynb")


def _check_scale_name(c: _Checker, name) -> None:
    """A scale name names files in the results folder: an identifier, never a path."""
    if not isinstance(name, str) or not SCALE_NAME.fullmatch(name):
        c.fail(f"scales.{str(name)[:80]!r}", "is not a scale name", "letters, digits, _ and - (at most 64, starting "
               "with a letter), such as smoke, paper, paper-substitute")


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _requires(c: _Checker, data: dict) -> tuple:
    """`requires`: dotted module names, checked when the file is loaded (so every command gives one answer) and
    never imported here."""
    names = c.value(data, "requires", "requires", (list,), "a list of module names", True) or ()
    for m in names:
        if not isinstance(m, str) or len(m) > 200 or not _MODULE.fullmatch(m):
            c.fail("requires", f"has {str(m)[:80]!r}", "dotted module names such as flwr or torch.func")
    return tuple(names)


def missing_requirements(paper: Paper) -> list[str]:
    """The modules in the paper's `requires` whose top-level package is not installed here; only the top-level
    name is looked up (find_spec('a.b') would import 'a')."""
    return [m for m in paper.requires if not _importable(m.split(".")[0])]


def _importable(name: str) -> bool:
    """find_spec(name) is not None; a module it cannot look up ('__main__' without a spec raises ValueError)
    counts as not importable."""
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load_paper(paper_id: str, root: Path | None = None) -> Paper:
    return load_claims(claims_path(paper_id, root))


# ---------------------------------------------------------------------------------------------- verdicts
def judge(claim: Claim, metrics: dict) -> tuple[str, str | None]:
    """(verdict, reason) of one claim against recorded metrics; reason is set for errors only."""
    return judge_detail(claim, metrics)[:2]


def judge_detail(claim: Claim, metrics: dict, scale: str = "smoke") -> tuple[str, str | None, dict | None]:
    """(verdict, reason, interval summary): the summary is set for seeded claims (verdicts.judge_seeded).
    `seeds: N` is the smoke scale's count; another scale (e.g. paper, with more seeds) is judged on every
    per-seed value its run recorded, at least MIN_SEEDS."""
    try:
        if claim.seeds is not None:
            recorded_n = len(metrics[claim.metric]) if isinstance(metrics.get(claim.metric), list) else 0
            n = recorded_n if scale != "smoke" and recorded_n >= MIN_SEEDS else claim.seeds
            verdict, summary = judge_seeded(claim.expect, claim.partial, claim.metric, n, metrics,
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


def headline_verdict(rows) -> str:
    """The paper's verdict: the combination rule (paper_verdict) over its headline claims alone (result rows
    with 'role' and 'verdict'); supporting claims and checks never enter it."""
    return paper_verdict([r["verdict"] for r in rows if r.get("role") == HEADLINE])


def role_counts(rows) -> dict:
    """{role: {verdict: n}} over a result's claim rows: supporting claims and checks are shown beside the
    headline verdict, never merged into it."""
    counts = {}
    for r in rows:
        by_verdict = counts.setdefault(r.get("role") or SUPPORTING, {})
        by_verdict[r["verdict"]] = by_verdict.get(r["verdict"], 0) + 1
    return counts


def beside_text(counts: dict, n_reported: int = 0) -> str:
    """What stands beside a headline verdict: 'supporting 4/6 reproduced; checks 5/5 hold; 2 reported'."""
    parts = [f"{label} {by.get(REPRODUCED, 0)}/{sum(by.values())} {word}"
             for role, label, word in ((SUPPORTING, "supporting", "reproduced"), (CHECK, "checks", "hold"))
             if (by := counts.get(role))]
    return "; ".join(parts + ([f"{n_reported} reported"] if n_reported else []))


def stored_result(paper: Paper) -> dict:
    """The paper as the smoke board shows it when every claim gives its stored verdict (the verdicts the test
    suite and `reproduce` hold a run to): a result-shaped dict for headline_verdict, beside_text and the board."""
    rows = [{"id": c.id, "role": c.role, "verdict": c.verdict} for c in paper.claims]
    return {"paper": paper.id, "scale": "smoke", "verdict": headline_verdict(rows), "claims": rows,
            "implementation": paper.implementation, "report": list(paper.report)}


def headline_lines(paper: Paper) -> list[str]:
    """The paper's verdict as its claims file states it: the headline verdict (a construct says so), each
    headline claim's stored verdict (and those also seen), and the supporting claims and checks beside it."""
    stored = stored_result(paper)
    verdict = stored["verdict"]
    label = f"{CONSTRUCT}: {verdict}" if paper.is_construct else verdict
    lines = [f"The paper's verdict, from its headline claims (papers/{paper.id}.yaml): {label.upper()}"]
    lines += [f"  headline {c.id}: {' or '.join(c.accepted)}" for c in paper.headlines]
    beside = beside_text(role_counts(stored["claims"]), len(paper.report))
    return lines + ([f"  beside it: {beside}"] if beside else [])


def headline(paper_id: str) -> None:
    """Print the paper's headline verdict as stored in its claims file (the claims cell above checks this run
    against the same file); a notebook's 'Reading the verdicts' starts from these lines, which nbval checks."""
    for line in headline_lines(load_claims(find_claims_file(paper_id))):
        print(line)


def report_values(paper: Paper, metrics: dict) -> list[dict]:
    """The `report:` rows with this run's value (a per-seed list stays a list; report.py shows mean ± h)."""
    def finite(span):  # an open end is stored as null (JSON has no infinity)
        return None if span is None else [v if math.isfinite(v) else None for v in span]
    return [{"id": r.id, "text": r.text, "metric": r.metric, "note": r.note, "range": finite(r.range),
             "ours": metrics.get(r.metric)} for r in paper.report]


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
    paper = load_claims(find_claims_file(paper_id))
    metrics = recorded() if metrics is None else metrics
    for claim in paper.claims:
        if claim.seeds is not None:
            verdict, reason, summary = judge_detail(claim, metrics)
            print(f"{claim.id}: {summary_text(summary) or reason} -> {verdict}")
