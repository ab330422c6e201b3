"""The package's dependency direction and function sizes, read from the sources (ast).

Layers, lowest first (docs: shared DESIGN.md): config <- kernels <- model <- engine <- refit <-
train <- rl <- presets <- overrides <- cli; a layer never imports a higher one. recompute/ and
tasks/ are leaves that import nothing above config (tokenizer counts as config's level);
runtime/ imports config and model; interop/ imports model, runtime and engine's fp8 format,
never train, rl or cli.
Every import counts, also one inside a function (a lazy import is still a dependency). Modules
are as long as their concept needs; functions stay under MAX_FUNCTION_LINES (STYLE.md rule 1).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "birkhoff"
MAX_FUNCTION_LINES = 60  # a body's lines, signature and docstring not counted


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
    """File (relative to src/birkhoff) -> the birkhoff subpackages it imports (a subpackage is a
    folder or a top-level module such as presets.py)."""
    if (SRC / subpackage).is_dir():
        files = sorted((SRC / subpackage).rglob("*.py"))
    else:
        files = [SRC / f"{subpackage}.py"] if (SRC / f"{subpackage}.py").is_file() else []
    return {
        str(f.relative_to(SRC)): {
            m.split(".")[1]
            for m in imported(f.read_text(), f)
            if m.count(".") >= 1 and not m.split(".")[1].startswith("__")  # not __version__
        }
        for f in files
    }


LAYERS = (
    "config",
    "kernels",
    "model",
    "engine",
    "refit",
    "train",
    "rl",
    "presets",
    "overrides",
    "cli",
)
LEAVES = {  # leaf -> what it may import besides itself
    "recompute": {"config"},
    "tasks": {"config", "tokenizer"},
    "tokenizer": {"config"},
    "runtime": {"config", "kernels", "model"},
}
ALL = set(LAYERS) | set(LEAVES) | {"interop"}


def allowed(subpackage: str) -> set[str]:
    """The subpackages `subpackage` may import: lower layers and the leaves (layers), its own
    list (leaves), model and runtime and what they rest on (interop)."""
    if subpackage in LEAVES:
        return LEAVES[subpackage] | {subpackage}
    if subpackage == "interop":
        # engine: the block-fp8 format (engine/fp8.py) of checkpoints with fp8 weights
        return {"config", "kernels", "model", "engine", "runtime", "tokenizer", "interop"}
    below = set(LAYERS[: LAYERS.index(subpackage) + 1]) | set(LEAVES)
    return below | ({"interop"} if subpackage in ("rl", "presets", "overrides", "cli") else set())


# Edges that break the rules today (rl/ reads presets and overrides, which import rl/'s config:
# a cycle), each
# until the change that removes it lands. No new edge may join them.
KNOWN = {
    ("rl/inputs.py", "presets"),
    ("rl/loop.py", "presets"),
    ("rl/loop.py", "overrides"),
}


def violations(subpackage: str) -> set[tuple[str, str]]:
    """(file, subpackage it must not import) edges of `subpackage`."""
    ok = allowed(subpackage)
    return {(f, m) for f, mods in imports_of(subpackage).items() for m in mods if m not in ok}


@pytest.mark.parametrize("subpackage", sorted(ALL))
def test_dependencies_point_one_way(subpackage: str) -> None:
    bad = sorted(violations(subpackage) - KNOWN)
    assert not bad, f"{subpackage} imports a higher layer: {bad}"


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


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body after its signature and docstring (the formatter lays out
    signatures and call arguments one a line; that is no part of a function's size)."""
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and isinstance(first.value.value, str) and len(node.body) > 1:  # type: ignore[attr-defined]
        first = node.body[1]
    return node.end_lineno - first.lineno + 1  # type: ignore[operator]


def function_lengths() -> dict[str, int]:
    """ "file:function" -> its body's lines (`body_lines`), for every function of the package."""
    out: dict[str, int] = {}
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{f.relative_to(SRC)}:{node.name}"
                out[name] = max(out.get(name, 0), body_lines(node))
    return out


def test_no_function_exceeds_the_line_cap() -> None:
    long = {k: n for k, n in function_lengths().items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split by concept): {long}"


def test_the_rules_cover_every_subpackage() -> None:
    """A new folder or top-level module gets a place in the order before it gets code."""
    names = {p.stem if p.suffix == ".py" else p.name for p in SRC.iterdir()}
    names -= {"__init__", "__main__", "__pycache__"}
    assert names <= ALL, f"not placed in LAYERS / LEAVES: {sorted(names - ALL)}"
