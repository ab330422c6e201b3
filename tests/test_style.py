"""Line-level rules of STYLE.md that a lint can check: no `# fmt: skip` outside tables of numbers
(rule 5: accept the formatter's output), no device timings in source (measurements live in
docs/results.md and docs/log/), and module docstrings of about ten lines (design detail lives in
the docs/*.md notes).
"""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "birkhoff"

# files with `# fmt: skip` on tables of numbers (allowed for good)
NUMBER_TABLES: tuple[str, ...] = ()
FMT_SKIP = re.compile(r"#\s*fmt:\s*skip")
DEVICE = re.compile(r"\b[HAB]\d00\b|\bGH200\b|\bGB200\b")
TIMING = re.compile(r"\d\s*(us|µs|ms|TB/s|GB/s|TFLOP/s)\b")
MAX_MODULE_DOC_LINES = 14


def source_files() -> dict[str, list[str]]:
    return {
        path.relative_to(SRC).as_posix(): path.read_text().splitlines()
        for path in sorted(SRC.rglob("*.py"))
    }


def test_no_fmt_skip_outside_number_tables():
    found = {
        f"{name}:{i}"
        for name, lines in source_files().items()
        if not name.startswith(NUMBER_TABLES)
        for i, line in enumerate(lines, 1)
        if FMT_SKIP.search(line)
    }
    assert not found, f"`# fmt: skip` outside a number table (accept ruff format): {sorted(found)}"


def test_no_device_timings_in_source():
    found = {
        f"{name}:{i}"
        for name, lines in source_files().items()
        for i, line in enumerate(lines, 1)
        if DEVICE.search(line) and TIMING.search(line)
    }
    assert not found, f"device timings belong in docs/, not source: {sorted(found)}"


def test_module_docstrings_are_short():
    found = {}
    for name, lines in source_files().items():
        doc = ast.get_docstring(ast.parse("\n".join(lines)), clean=False) or ""
        if doc.count("\n") > MAX_MODULE_DOC_LINES:
            found[name] = doc.count("\n")
    assert not found, (
        f"module docstrings over {MAX_MODULE_DOC_LINES} lines (move the detail to docs/): {found}"
    )
