"""Reading result files and the files they name, treating both as untrusted input.

A result file (results/<id>-<scale>.json) that cannot be read is *stale*, never fatal: `reproduce` runs it
again, `list` and the board show it as stale. A figure is embedded only if it is a PNG inside the results
folder, so a crafted result file cannot pull /etc/passwd (or ../secrets.png) into index.html.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys
from pathlib import Path

STALE = "stale"  # the board's verdict for a result file that cannot be used
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_NAME = re.compile(r"^(?P<paper>[A-Za-z_][A-Za-z0-9_]*)-(?P<scale>.+)\.json$")
_FIELDS = {"paper": str, "scale": str, "verdict": str, "claims": list}
_ROLES = ("headline", "supporting", "check")  # claims.ROLES (results.py imports nothing from claims.py)
_VERDICTS = ("reproduced", "partially reproduced", "not reproduced at this scale", "inconclusive at this scale",
             "error")  # verdicts.py's: what a run writes for the paper and each claim
MAX_BYTES = 64 << 20   # a result file is a few kB; anything this large is not one
MAX_DEPTH = 32         # results nest 4 deep; a 100,000-deep array is an attack, not a result
# C0/C1 controls (tab and newline are replaced below), the line/paragraph separators U+2028/U+2029, and every
# Unicode format character (category Cf), which reorder or hide text: U+00AD soft hyphen, U+061C ARABIC LETTER MARK,
# U+180E, U+200B-U+200F (zero widths, LRM, RLM), U+202A-U+202E (embeddings, overrides), U+2060-U+206F (word joiner,
# invisible operators, isolates U+2066-U+2069), U+FEFF, U+FFF9-U+FFFB, U+E0000-U+E007F tags, and the rarer ones
# (Arabic/Syriac number marks, Kaithi, Egyptian hieroglyph, shorthand and musical format controls)
_CONTROL = re.compile("[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
                      "\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
                      "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e007f]")

# a file name's bytes that are not UTF-8 reach Python as surrogates U+DC80-U+DCFF (os.fsdecode): shown as \xNN, so
# `tiny-sm\xffoke.json` is never printed as `tiny-smoke.json`, another file
_UNDECODABLE = re.compile("[\udc80-\udcff]")
# a backslash of the text before x, another backslash or such a byte: doubled, so \xNN means a byte, \\ a backslash
_AMBIGUOUS_BACKSLASH = re.compile("\\\\(?=[x\\\\\udc80-\udcff])")


def printable(text, limit: int | None = None) -> str:
    """`text` from a file (claims file, result JSON), safe to print on a terminal: control characters (escape
    sequences, CR, BEL, C1 codes, bidi overrides, and lone surrogates from a '\\ud800' escape, which a UTF-8
    terminal cannot print) are dropped, a file name's bytes that are not UTF-8 shown as \\xNN, tabs and
    newlines become spaces; `limit` shortens it (with '…'). A backslash of the text itself is doubled where it is
    followed by x or a backslash, so a name holding the characters '\\xff' never prints as one with the byte 0xff."""
    text = _CONTROL.sub(_keep_bytes, str(text)).replace("\t", " ").replace("\n", " ")
    text = _UNDECODABLE.sub(_byte_escape, _AMBIGUOUS_BACKSLASH.sub(r"\\\\", text))
    return text if limit is None or len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def printable_name(name) -> str:
    """A file name (or a scale taken from one) shown so that two names never print the same: every backslash
    doubled, a non-UTF-8 byte as \\xNN, and every control or format character `printable` would drop (zero
    widths, NUL, tab, newline) as \\uXXXX or \\UXXXXXXXX."""
    text = _CONTROL.sub(_char_escape, str(name).replace("\\", "\\\\"))
    return text.replace("\t", "\\u0009").replace("\n", "\\u000a")


def _char_escape(match) -> str:
    c = match.group()
    if _UNDECODABLE.fullmatch(c):
        return _byte_escape(match)
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def _keep_bytes(match) -> str:
    """A control character goes; a file name's undecodable byte stays, to be shown as \\xNN."""
    return match.group() if _UNDECODABLE.fullmatch(match.group()) else ""


def _byte_escape(match) -> str:
    return f"\\x{ord(match.group()) - 0xDC00:02x}"


def printable_strings(value):
    """Parsed JSON with every string (keys too) stripped of control and format characters as `printable` strips
    them, tabs and newlines kept: what the board writes into REPORT.md and index.html."""
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if isinstance(value, list):
        return [printable_strings(v) for v in value]
    if isinstance(value, dict):
        return {printable_strings(k): printable_strings(v) for k, v in value.items()}
    return value


class StaleResultWarning(UserWarning):
    """A result file is corrupt or not a result; it is treated as missing (and re-run by `reproduce`)."""


def read_result(path) -> tuple[dict | None, str | None]:
    """(result, None), or (None, why the file cannot be used) for an unreadable / corrupt / foreign file."""
    path = Path(path)
    try:
        data = json.loads(_read_text(path))
    except OSError as e:
        return None, printable(f"cannot be read ({e.strerror or e})", 200)
    except (UnicodeDecodeError, ValueError) as e:  # bad JSON, or an integer of more than 4,300 digits
        return None, printable(f"is not valid JSON ({e})", 200)
    except RecursionError:
        return None, "is not a result file (nested too deeply)"
    if _depth(data) > MAX_DEPTH:
        return None, f"is not a result file (nested more than {MAX_DEPTH} deep)"
    if not isinstance(data, dict):
        return None, f"holds a JSON {type(data).__name__}, not a result"
    if _too_large(data):
        return None, "is not a result file (an integer too large for a float: a number no run writes)"
    wrong = [k for k, kind in _FIELDS.items() if not isinstance(data.get(k), kind)]
    if wrong:
        return None, f"is not a result file (field {', '.join(wrong)} missing or of the wrong type)"
    if not all(isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("id", "verdict", "expect"))
               for c in data["claims"]):
        return None, "is not a result file (a claim without id / expect / verdict)"
    if any(v not in _VERDICTS for v in [data["verdict"], *(c["verdict"] for c in data["claims"])]):
        return None, f"is not a result file (a verdict that is not one of {', '.join(_VERDICTS)})"
    if not (data.get("metrics") is None or isinstance(data["metrics"], dict)):
        return None, f"is not a result file (field metrics is a {type(data['metrics']).__name__}, not a mapping)"
    if not (data.get("stale") is None or isinstance(data["stale"], str)):
        return None, f"is not a result file (field stale is a {type(data['stale']).__name__}, not text)"
    if not all(c.get("role") is None or c.get("role") in _ROLES for c in data["claims"]):
        bad = next(c for c in data["claims"] if c.get("role") is not None and c.get("role") not in _ROLES)
        return None, printable(f"is not a result file (claim {bad['id']!r} has role {bad['role']!r}, not one of "
                               f"{', '.join(_ROLES)})", 200)
    named = _NAME.match(path.name)  # results/<paper>-<scale>.json must hold that paper's run at that scale
    if named and (data["paper"], data["scale"]) != (named["paper"], named["scale"]):
        return None, printable(f"is not a result file of its name (it says paper {data['paper']!r}, scale "
                               f"{data['scale']!r})", 200)
    if not _error_ok(data.get("error")):
        return None, "is not a result file (field error is not a mapping with cell, ename and evalue)"
    if not _counts_ok(data.get("counts")):
        return None, "is not a result file (field counts is not {role: {verdict: count}})"
    if not (data.get("report") is None or isinstance(data["report"], list)
            and all(isinstance(r, dict) and isinstance(r.get("id"), str) for r in data["report"])):
        return None, "is not a result file (field report is not a list of rows with an id)"
    for c in data["claims"]:
        if not _interval_ok(c.get("interval")) or not all(c.get(k) is None or isinstance(c[k], str)
                                                         for k in ("partial", "reason", "text", "metric", "note",
                                                                   "role", "stored_verdict")) \
                or not _also_seen_ok(c.get("also_seen")):
            return None, printable(f"is not a result file (claim {c['id']!r}: interval, role, stored_verdict, "
                                   "also_seen or text fields of the wrong type)", 200)
    return data, None


def _error_ok(error) -> bool:
    """None, or the notebook's failure: {cell: int or None, ename: str, evalue: str, ...}."""
    return error is None or isinstance(error, dict) and isinstance(error.get("ename"), str) \
        and isinstance(error.get("evalue"), str) and (error.get("cell") is None or isinstance(error["cell"], int))


def _counts_ok(counts) -> bool:
    """None, or {role: {verdict: count}} with whole counts >= 0."""
    return counts is None or isinstance(counts, dict) and all(
        isinstance(by, dict) and all(isinstance(v, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                     for v, n in by.items()) for by in counts.values())


def _also_seen_ok(also_seen) -> bool:
    """None, or {verdict: where it was seen}."""
    return also_seen is None or isinstance(also_seen, dict) and all(isinstance(v, str) for v in also_seen.values())


def _read_text(path: Path) -> str:
    """The file's text if it is a regular file (not a link, FIFO or device) of at most MAX_BYTES."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError("not a regular file")
        if info.st_size > MAX_BYTES:
            raise OSError(f"{info.st_size} bytes, more than a result file's {MAX_BYTES}")
        return f.read(info.st_size + 1).decode()  # not MAX_BYTES + 1: a buffered read allocates what it is asked


def _depth(data) -> int:
    """How deep lists and mappings nest in parsed JSON (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        item, d = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                todo += [(v, d + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _too_large(data) -> bool:
    """Whether parsed JSON (at most MAX_DEPTH deep) holds an integer beyond float's range (float() would raise
    OverflowError wherever the report averages or formats it)."""
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, list):
            todo += item
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > sys.float_info.max:
            return True
    return False


def _number(value) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _interval_ok(summary) -> bool:
    """A seeded claim's interval: None, or numbers mean / half_width / n / confidence (and a numeric margin)."""
    if not summary:
        return summary is None or summary == {}
    if not isinstance(summary, dict) or not all(_number(summary.get(k)) for k in ("mean", "half_width", "n", "confidence")):
        return False
    margin = summary.get("margin")
    return not margin or isinstance(margin, dict) and _number(margin.get("mean")) and _number(margin.get("half_width"))


def result_files(results_dir, paper_id: str | None = None) -> list[tuple[Path, str, str]]:
    """(path, paper id, scale) of every results/<id>-<scale>.json (of one paper if `paper_id`), sorted."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        m = _NAME.match(path.name)
        if m and (paper_id is None or m["paper"] == paper_id):
            found.append((path, m["paper"], m["scale"]))
    return found


def stale_result(paper_id: str, scale: str, path: Path, problem: str, scales=None) -> dict:
    """A placeholder result for the board: a corrupt file shows up as a stale row instead of vanishing. Its advice
    re-runs the scale only where the paper has one by that name (`scales`; None: not known)."""
    fix = (f"run `fedlab-nb reproduce {paper_id} --scale {scale}` to replace it" if scales is None or scale in scales
           else f"remove or rename it: {paper_id} has no scale by that name")
    return {"paper": paper_id, "scale": scale, "verdict": STALE, "claims": [], "error": None,
            "stale": f"{path.name} {problem}; {fix}"}


def safe_figure(results_dir, figure) -> Path | None:
    """The file a result's `figures` entry names, if it is a PNG inside `results_dir`, else None.

    Refuses absolute paths, '..', symlinks that leave the folder, and anything without the PNG signature."""
    if not isinstance(figure, str) or not figure or Path(figure).is_absolute() or ".." in Path(figure).parts:
        return None
    base = Path(results_dir).resolve()
    try:
        path = (base / figure).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte in the name
        return None
    if not path.is_relative_to(base) or not path.is_file() or path.suffix.lower() != ".png":
        return None
    with path.open("rb") as f:
        return path if f.read(len(PNG_MAGIC)) == PNG_MAGIC else None


def safe_output(results_dir, name) -> Path | None:
    """The file a result's `outputs` entry names, if it is a regular file inside `results_dir` (no absolute
    path, no '..', no link out of the folder, no device such as /dev/zero), else None."""
    if not isinstance(name, str) or not name or "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    base = Path(results_dir).resolve()
    try:
        path = (base / name).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        return None
    return path if path.is_relative_to(base) and path.is_file() else None


def file_digest(path) -> str | None:
    """sha256 of a file, None when it does not exist (used to tell whether outputs were overwritten)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()
