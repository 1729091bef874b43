"""Issue 40 item 8: one naming convention — paper id = claims file = notebook = the registry's index."""
from pathlib import Path

import fedlab_nb.methods  # noqa: F401  (every method registers itself)
import fedlab_nb.data  # noqa: F401
from fedlab_nb.core.registry import REGISTRY
from fedlab_nb.repro.claims import load_paper, paper_ids
from fedlab_nb.repro.course import LESSONS

ROOT = Path(__file__).resolve().parents[1]


def test_every_notebook_is_named_after_its_paper_id():
    ids = paper_ids(ROOT)
    for pid in ids:
        assert load_paper(pid, ROOT).notebook == f"notebooks/{pid}.ipynb", pid
    assert sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(ids)


def test_the_registry_points_at_the_claims_file_and_notebook_of_the_same_name():
    ids = set(paper_ids(ROOT))
    for key, entry in REGISTRY.items():
        if entry.claims is not None:
            assert entry.claims in ids, (key, entry.claims)
            assert (ROOT / "notebooks" / f"{entry.notebook}.ipynb").is_file(), key


def test_the_lessons_name_existing_papers():
    ids = set(paper_ids(ROOT))
    for lesson in LESSONS:
        assert set(lesson.papers) <= ids, lesson.key


def test_no_name_in_a_chapter_shadows_one_of_its_modules():
    """`fedlab_nb.methods.<chapter>.<file>` is always the module, never a factory of the same name."""
    import importlib
    import pkgutil
    import types
    import fedlab_nb.methods as methods
    chapters = [m.name for m in pkgutil.iter_modules(methods.__path__) if m.ispkg]
    assert set(chapters) == {lesson.key for lesson in LESSONS}
    for chapter in chapters:
        package = importlib.import_module(f"fedlab_nb.methods.{chapter}")
        for module in pkgutil.iter_modules(package.__path__):
            assert isinstance(getattr(package, module.name), types.ModuleType), f"{chapter}.{module.name}"


def test_run_config_is_keyword_only():
    """Issue 40 item 4: RunConfig(30, None, 1, ...) would shift silently when a field is added."""
    import pytest
    from fedlab_nb.engine.server import RunConfig
    with pytest.raises(TypeError):
        RunConfig(30)
    assert RunConfig(rounds=30, lr=0.1).rounds == 30
