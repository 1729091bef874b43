"""Imports run only downward: the import-linter contracts of pyproject.toml ([tool.importlinter]) hold, every
module of the package sits in a layer (or in repro, which imports nothing of the library), and no import inside
a function body reaches another layer (a lazy import may not hide an import that runs back up)."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedlab_nb"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
LAYERS = next(c for c in CONFIG["contracts"] if c["type"] == "layers")["layers"]  # top first
# Loads that cross a layer inside a function on purpose, each downward and for a cost: the command line loads
# the layer a sub-command needs (so `fedlab-nb --help` does not import torch and every method), and a
# federation's label heatmap loads matplotlib and seaborn (2 s) only when drawn.
LAZY_DOWNWARD = {("fedlab_nb.cli", "*"), ("fedlab_nb.data.federated", "fedlab_nb.viz")}


def layer_of(module: str) -> int | None:
    """0 for the lowest layer, upward; None outside the layers (the package's __init__, repro)."""
    for depth, layer in enumerate(reversed(LAYERS)):
        for name in layer.replace(":", "|").split("|"):
            name = name.strip().strip("()")
            if module == name or module.startswith(name + "."):
                return depth
    return None


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), package, path


def function_imports(path: Path, package: list[str]):
    """(line, imported module) of every `fedlab_nb` import inside a function body of the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                if inner.level:
                    base = package[:len(package) - inner.level + 1] + ([inner.module] if inner.module else [])
                    names = [".".join(base)]
                else:
                    names = [inner.module or ""]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            else:
                continue
            yield from ((inner.lineno, n) for n in names if n == "fedlab_nb" or n.startswith("fedlab_nb."))


def test_import_linter_contracts_hold():
    pytest.importorskip("importlinter", reason="import-linter is in the dev extra")
    # its own process: in-process, its console writes to a stream an earlier test's capture may have closed
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, "an import-linter contract is broken (run `lint-imports`):\n" + run.stdout[-4000:]


def test_contracts_declare_the_layers_and_repro():
    assert [c["id"] for c in CONFIG["contracts"]] == ["layers", "repro-imports-no-library", "library-imports-no-repro",
                                                       "no-cycles"]
    assert layer_of("fedlab_nb.core.method") < layer_of("fedlab_nb.data") < layer_of("fedlab_nb.engine") \
        < layer_of("fedlab_nb.methods.robustness.rules") < layer_of("fedlab_nb.api") < layer_of("fedlab_nb.cli")


def test_every_module_is_in_a_layer():
    """A new module at the package root is placed in a layer of pyproject.toml (or is repro)."""
    loose = [m for m, _, _ in modules() if m != "fedlab_nb" and not m.startswith("fedlab_nb.repro")
             and layer_of(m) is None]
    assert not loose, f"add these to a layer of [tool.importlinter] in pyproject.toml: {loose}"


def test_no_import_inside_a_function_crosses_a_layer():
    crossing = []
    for module, package, path in modules():
        here = layer_of(module)
        for line, imported in function_imports(path, package):
            there = layer_of(imported)
            if there == here or (module, imported) in LAZY_DOWNWARD or (
                    (module, "*") in LAZY_DOWNWARD and (there is None or there <= here)):
                continue  # the same layer (or both in repro), or a declared lazy load downward
            crossing.append(f"{path.relative_to(ROOT)}:{line}: {imported}")
    assert not crossing, "import at module level (downward) or move the code (upward):\n" + "\n".join(crossing)
