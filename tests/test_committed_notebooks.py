"""Committed notebooks a reader can trust: only the cell nbval checks keeps outputs, and its stored output says
it is the expected output (scripts/expected_outputs.py writes that form; notebooks/sanitize.cfg strips the line)."""
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from fedlab_nb import repro
from fedlab_nb.repro import claims as C

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


# ---------------------------------------------------------------------------------------------- stated verdicts
PAPERS = expected_outputs.notebook_papers()


@pytest.mark.parametrize("path", sorted(PAPERS), ids=lambda p: p.stem)
def test_each_notebook_states_its_headline_verdict_from_its_claims_file(path):
    """The headline cell after the claims cell prints the paper's verdict as its claims file stores it (nbval
    checks the run prints the same); a changed verdict in the file fails here until the notebook says it too."""
    problems = expected_outputs.headline_problems(nbformat.read(str(path), as_version=4), PAPERS[path])
    assert not problems, f"{path.name}: " + "; ".join(problems) + " (run scripts/expected_outputs.py)"


def test_a_headline_cell_that_disagrees_with_the_claims_file_is_found():
    path = next(p for p, pid in PAPERS.items() if pid == "afl")
    nb = nbformat.read(str(path), as_version=4)
    claims, head = expected_outputs._headline_index(nb, "afl")
    nb.cells[head].outputs[0].text = nb.cells[head].outputs[0].text.replace("PARTIALLY REPRODUCED", "REPRODUCED")
    assert expected_outputs.headline_problems(nb, "afl") == ["the headline cell's stored verdict differs from "
                                                             "papers/afl.yaml"]
    del nb.cells[head]
    assert "no headline cell" in expected_outputs.headline_problems(nb, "afl")[0]


_VERDICT_WORDS = re.compile(r"\b(partially reproduced|not reproduced|inconclusive|reproduced)\b", re.I)
_WORD_VERDICT = {"partially reproduced": C.PARTIAL, "not reproduced": C.NOT_REPRODUCED,
                 "inconclusive": C.INCONCLUSIVE, "reproduced": C.REPRODUCED}


def _sentences(markdown: str):
    """Bullets and sentences of a notebook's prose."""
    for block in re.split(r"\n\s*[-*]\s+|\n\n", markdown):
        yield from re.split(r"(?<=[.;!?])\s+(?=[A-Z*`(])", block)


def stated_verdict_conflicts(paper, markdown: str) -> list[str]:
    """Sentences that name exactly one claim of the paper and a verdict none of whose words is a verdict the
    claims file accepts for it (stored or also seen)."""
    conflicts = []
    for sentence in _sentences(markdown):
        named = [c for c in paper.claims if re.search(rf"\b{c.id}\b", sentence)]
        words = {_WORD_VERDICT[w.lower()] for w in _VERDICT_WORDS.findall(sentence)}
        if len(named) == 1 and words and not words & set(named[0].accepted):
            conflicts.append(f"{named[0].id} is stored as {named[0].verdict!r}, the text says: {sentence.strip()!r}")
    return conflicts


@pytest.mark.parametrize("path", sorted(PAPERS), ids=lambda p: p.stem)
def test_prose_naming_a_claim_states_its_stored_verdict(path):
    nb = nbformat.read(str(path), as_version=4)
    markdown = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    conflicts = stated_verdict_conflicts(repro.load_paper(PAPERS[path], ROOT), markdown)
    assert not conflicts, f"{path.name}: " + "; ".join(conflicts)


def test_a_sentence_stating_another_verdict_is_found():
    paper = repro.load_paper("afl", ROOT)
    assert stated_verdict_conflicts(paper, "- `weight_invariance` is **not reproduced** here.\n- Other text.")
    assert not stated_verdict_conflicts(paper, "`weight_invariance`: reproduced (exact to 1e-12).")
    assert not stated_verdict_conflicts(paper, "No claim named here is not reproduced.")
