#!/usr/bin/env python
"""The board's numbers where people read them: README.md and docs/teachers.md carry a block between
`<!-- board:start -->` and `<!-- board:end -->` written here from the claims files.

    .venv/bin/python scripts/board_numbers.py           # rewrite the blocks
    .venv/bin/python scripts/board_numbers.py --check   # exit 1 when a block differs (tests/test_board_numbers.py)

The smoke-scale board gives the stored verdicts (a run that differs fails the test suite and `reproduce`), so the
stored verdicts are the board's numbers: papers by headline verdict (constructs apart), claims by role.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlab_nb.repro.claims import ReproError, load_paper, paper_ids, stored_result  # noqa: E402
from fedlab_nb.repro.files import write_atomic  # noqa: E402
from fedlab_nb.repro.report import summary_lines  # noqa: E402

FILES = (ROOT / "README.md", ROOT / "docs" / "teachers.md")
BLOCK = re.compile(r"<!-- board:start -->.*?<!-- board:end -->", re.S)


def stored_results(root: Path = ROOT) -> list[dict]:
    """One result per paper as the smoke board shows it when every claim gives its stored verdict."""
    return [stored_result(load_paper(pid, root)) for pid in paper_ids(root)]


def block(root: Path = ROOT) -> str:
    lines = summary_lines(stored_results(root))
    return ("<!-- board:start -->\nThe board at smoke scale (from the claims files; `scripts/board_numbers.py`):\n"
            + "".join(f"- {line}\n" for line in lines) + "<!-- board:end -->")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    want, status = block(), 0
    for path in FILES:
        text = path.read_text()
        if not BLOCK.search(text):
            print(f"{path}: no <!-- board:start --> ... <!-- board:end --> block", file=sys.stderr)
            status = 1
            continue
        new = BLOCK.sub(lambda _: want, text)
        if new != text:
            if args.check:
                print(f"{path}: the board's numbers are out of date: run scripts/board_numbers.py", file=sys.stderr)
                status = 1
            else:
                try:
                    write_atomic(path, new)  # a link at README.md is refused, never written through
                except ReproError as e:
                    raise SystemExit(f"{e}; {path} is not rewritten") from None
                print(f"rewrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
