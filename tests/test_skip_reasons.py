"""A skipped test says why (`pytest -rs` prints it): every `skipif` has a reason, every
`pytest.skip` a message, and a test marked `gpu` skips with one that says it needs CUDA."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """Calls of `pytest.<name>` / `pytest.mark.<name>` in `tree`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
    ]


def reason_text(call: ast.Call) -> str:
    """The reason's source text (a literal, an f-string or an expression)."""
    reason = next((k.value for k in call.keywords if k.arg in ("reason", "msg")), None)
    if reason is None and call.args[1:] and calls_skipif(call):
        reason = call.args[1]
    if reason is None and call.args and not calls_skipif(call):
        reason = call.args[0]
    return ast.unparse(reason) if reason is not None else ""


def calls_skipif(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Attribute) and call.func.attr == "skipif"


def test_every_skip_says_why() -> None:
    silent = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in calls(tree, "skipif") + calls(tree, "skip"):
            if not reason_text(call).strip("'\" "):
                silent.append(f"{path.relative_to(TESTS)}:{call.lineno}")
    assert not silent, f"skips without a reason: {silent}"


def test_gpu_tests_skip_saying_they_need_cuda() -> None:
    missing = []
    for path in sorted(TESTS.rglob("*.py")):
        source = path.read_text()
        if "mark.gpu" not in source or path == Path(__file__).resolve():
            continue
        tree = ast.parse(source, filename=str(path))
        reasons = [reason_text(c) for c in calls(tree, "skipif") + calls(tree, "skip")]
        if not any("needs" in r and "CUDA" in r for r in reasons):
            missing.append(str(path.relative_to(TESTS)))
    assert not missing, f"gpu-marked tests without a 'needs CUDA' skip: {missing}"
