"""Reading result files and the files they name, treating both as untrusted input.

A result file (results/<id>-<scale>.json) that cannot be read is *stale*, never fatal: `reproduce` runs it
again, `list` and the board show it as stale. A figure is embedded only if it is a PNG inside the results
folder, so a crafted result file cannot pull /etc/passwd (or ../secrets.png) into index.html.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

STALE = "stale"  # the board's verdict for a result file that cannot be used
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_NAME = re.compile(r"^(?P<paper>[A-Za-z_][A-Za-z0-9_]*)-(?P<scale>.+)\.json$")
_FIELDS = {"paper": str, "scale": str, "verdict": str, "claims": list}


class StaleResultWarning(UserWarning):
    """A result file is corrupt or not a result; it is treated as missing (and re-run by `reproduce`)."""


def read_result(path) -> tuple[dict | None, str | None]:
    """(result, None), or (None, why the file cannot be used) for an unreadable / corrupt / foreign file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"is not valid JSON ({e})"
    if not isinstance(data, dict):
        return None, f"holds a JSON {type(data).__name__}, not a result"
    wrong = [k for k, kind in _FIELDS.items() if not isinstance(data.get(k), kind)]
    if wrong:
        return None, f"is not a result file (field {', '.join(wrong)} missing or of the wrong type)"
    if not all(isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("id", "verdict", "expect"))
               for c in data["claims"]):
        return None, "is not a result file (a claim without id / expect / verdict)"
    if data.get("error") is not None and not isinstance(data["error"], dict):
        return None, "is not a result file (field error is not a mapping)"
    return data, None


def result_files(results_dir, paper_id: str | None = None) -> list[tuple[Path, str, str]]:
    """(path, paper id, scale) of every results/<id>-<scale>.json (of one paper if `paper_id`), sorted."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        m = _NAME.match(path.name)
        if m and (paper_id is None or m["paper"] == paper_id):
            found.append((path, m["paper"], m["scale"]))
    return found


def stale_result(paper_id: str, scale: str, path: Path, problem: str) -> dict:
    """A placeholder result for the board: a corrupt file shows up as a stale row instead of vanishing."""
    return {"paper": paper_id, "scale": scale, "verdict": STALE, "claims": [], "error": None,
            "stale": f"{path.name} {problem}; run `fedlab-nb reproduce {paper_id} --scale {scale}` to replace it"}


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
