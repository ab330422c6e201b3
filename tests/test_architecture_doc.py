"""docs/architecture.md has one line per module: every module under src/birkhoff/ (package
`__init__.py` files aside) is named in the table of its package, and no row names a module that
is gone, so the page cannot drift from the tree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "birkhoff"
HEADING = re.compile(r"^## `src/birkhoff/(.*)`$")
ROW = re.compile(r"^\| `([^`]+\.py)` \|")


def documented() -> set[str]:
    found, package = set(), None
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("## "):
            match = HEADING.match(line)
            package = match.group(1) if match else None
        elif package is not None and (row := ROW.match(line)):
            found.add(package + row.group(1))
    return found


def modules() -> set[str]:
    return {
        path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py") if path.name != "__init__.py"
    }


def test_architecture_doc_names_every_module():
    missing = sorted(modules() - documented())
    assert not missing, f"modules without a line in docs/architecture.md: {missing}"


def test_architecture_doc_names_no_missing_module():
    stale = sorted(documented() - modules())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
