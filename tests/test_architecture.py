"""The package's dependency direction and module sizes, read from the sources (ast).

config <- model <- engine <- refit <- train/rl <- cli; recompute and kernels are leaves (the
model's mHC ops dispatch to kernels/, which imports nothing of the package beyond config). Every
import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "birkhoff"
MAX_LINES = 400


def imported(source: str, path: Path) -> set[str]:
    """Every `birkhoff.*` module the source of file `path` imports, relative imports resolved."""
    package = ["birkhoff", *path.relative_to(SRC).parent.parts]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(module)
            out |= {f"{module}.{alias.name}" for alias in node.names}
    return {m for m in out if m == "birkhoff" or m.startswith("birkhoff.")}


def imports_of(subpackage: str) -> dict[str, set[str]]:
    """File (relative to src/birkhoff) -> the birkhoff subpackages it imports."""
    files = sorted((SRC / subpackage).rglob("*.py")) if (SRC / subpackage).is_dir() else []
    return {
        str(f.relative_to(SRC)): {
            m.split(".")[1] for m in imported(f.read_text(), f) if m.count(".") >= 1
        }
        for f in files
    }


RULES = {  # subpackage -> what it must never import
    "model": {
        "engine",
        "refit",
        "train",
        "rl",
        "tasks",
        "interop",
        "cli",
        "recompute",
        "presets",
        "tokenizer",
    },  # fmt: skip
    "engine": {"refit", "train", "rl", "tasks", "interop", "cli"},
    "recompute": {"model", "engine", "refit", "train", "rl"},
    "kernels": {"model", "engine", "refit", "train", "rl"},
    "refit": {"train", "rl"},
    "runtime": {"engine", "refit", "train", "rl", "tasks", "interop", "cli", "presets"},
    "train": {"rl", "interop", "cli", "presets"},
    "interop": {"train", "rl", "cli", "presets"},
}


@pytest.mark.parametrize("subpackage", sorted(RULES))
def test_dependencies_point_one_way(subpackage: str) -> None:
    bad = {f: sorted(mods & RULES[subpackage]) for f, mods in imports_of(subpackage).items()}
    assert not {f: m for f, m in bad.items() if m}, f"{subpackage} imports a higher layer: {bad}"


def test_model_imports_only_config_kernels_and_itself() -> None:
    """The model's mHC ops dispatch to the fused kernels, a leaf that imports only config."""
    allowed = {"config", "kernels", "model"}
    bad = {f: sorted(mods - allowed) for f, mods in imports_of("model").items()}
    assert not {f: m for f, m in bad.items() if m}, bad


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    source = (
        "def f():\n    from birkhoff.refit import x\nfrom ..engine import y\nimport birkhoff.rl\n"
    )
    found = imported(source, SRC / "model" / "layers.py")
    assert {"birkhoff.refit", "birkhoff.engine", "birkhoff.rl"} <= found


def test_no_module_exceeds_the_line_limit() -> None:
    long = {str(f.relative_to(SRC)): n for f in SRC.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"modules over {MAX_LINES} lines: {long}"
