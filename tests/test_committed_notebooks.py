"""Committed notebooks a reader can trust: only the cell nbval checks keeps outputs, and its stored output says
it is the expected output (scripts/expected_outputs.py writes that form; notebooks/sanitize.cfg strips the line)."""
import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("expected_outputs", ROOT / "scripts" / "expected_outputs.py")
expected_outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(expected_outputs)


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_stored_outputs_are_marked_as_expected(path):
    problems = expected_outputs.expected_form(nbformat.read(str(path), as_version=4))
    assert not problems, f"{path.name}: " + "; ".join(problems) + " (run scripts/expected_outputs.py)"


def test_the_sanitizer_removes_the_header_nbval_would_otherwise_compare():
    cfg = (ROOT / "notebooks" / "sanitize.cfg").read_text()
    assert expected_outputs.HEADER.rstrip("\n").replace("(", r"\(") in cfg


def test_marking_clears_unchecked_outputs_and_adds_the_header():
    nb = nbformat.v4.new_notebook()
    other = nbformat.v4.new_code_cell("print(1)", execution_count=3,
                                      outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])
    checked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint('ok')", execution_count=None,
                                        outputs=[nbformat.v4.new_output("stream", name="stdout", text="ok\n")])
    nb.cells = [other, checked]
    assert len(expected_outputs.expected_form(nb)) == 3
    expected_outputs.mark(nb)
    assert expected_outputs.expected_form(nb) == []
    assert other.outputs == [] and other.execution_count is None
    assert checked.outputs[0].text == expected_outputs.HEADER + "ok\n" and checked.execution_count == 1
