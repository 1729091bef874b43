"""pip (pyproject.toml) and conda (environment.yml) must describe the same dependencies."""
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


SETUP_EXTRAS = ("dev", "flower", "notebooks", "browser", "course")  # what the README's set-up installs


def _norm(req: str) -> str:
    return req.replace(" ", "").lower()


def test_pip_and_conda_dependencies_match():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(extras) == set(SETUP_EXTRAS), f"extras {sorted(extras)}: add new ones to the README's set-up and here"
    pip_side = set(map(_norm, project["dependencies"] + [r for e in SETUP_EXTRAS for r in extras[e]]))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_side = {_norm(r) for r in pip_section if not r.startswith("-e")}
    assert pip_side == conda_side, f"only in pyproject: {pip_side - conda_side}; only in environment.yml: {conda_side - pip_side}"


def test_torch_range_admits_the_cpu_wheel():
    from packaging.specifiers import SpecifierSet
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in deps if d.startswith("torch"))
    assert "2.13.0" in SpecifierSet(torch_spec[len("torch"):])


def test_readme_setup_installs_every_extra():
    readme = (ROOT / "README.md").read_text()
    assert f"scripts/setup.sh {','.join(SETUP_EXTRAS)}" in readme
