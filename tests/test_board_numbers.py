"""The board's numbers in README.md and docs/teachers.md are the claims files' (scripts/board_numbers.py), and the
README's first screen says what a newcomer needs: the two commands, how long they take, what to open."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("board_numbers", ROOT / "scripts" / "board_numbers.py")
board_numbers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(board_numbers)


def test_readme_and_teachers_carry_the_boards_numbers():
    want = board_numbers.block()
    for path in board_numbers.FILES:
        assert want in path.read_text(), f"{path.name}: run scripts/board_numbers.py"


def test_the_numbers_count_every_paper_and_claim():
    results = board_numbers.stored_results()
    text = board_numbers.block()
    papers = sum(r.get("implementation") != "construct" for r in results)
    assert f"- {papers} papers, by headline verdict:" in text
    headlines = sum(c["role"] == "headline" for r in results for c in r["claims"])
    assert f"- {headlines} headline claims:" in text and len(results) == len(list((ROOT / "papers").glob("*.yaml")))


def test_the_readmes_first_screen_is_short_and_says_what_to_open():
    first = (ROOT / "README.md").read_text().split("## Five lines")[0]
    assert len(first.splitlines()) <= 45  # the board block included
    for needed in ("bash scripts/setup.sh", "bash scripts/test.sh", "results/index.html", "minutes"):
        assert needed in first
