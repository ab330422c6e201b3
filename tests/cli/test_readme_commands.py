"""Every `birkhoff ...` command the README shows parses with the real parser: a renamed or
removed flag cannot leave the user's guide behind."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from birkhoff.cli import build_parser
from birkhoff.cli.config import dotted_overrides

README = Path(__file__).resolve().parents[2] / "README.md"


def birkhoff_args(line: str) -> list[str] | None:
    """The arguments after `birkhoff` (or `.venv/bin/birkhoff`, `-m birkhoff`) in `line`, up to
    a shell redirection; None when the line runs no birkhoff command."""
    words = shlex.split(line, comments=True)
    for i, word in enumerate(words):
        if word in ("birkhoff", ".venv/bin/birkhoff"):
            args = words[i + 1 :]
            return args[: args.index(">")] if ">" in args else args
    return None


def readme_commands(*, runnable: bool = True) -> list[list[str]]:
    """Each command of the README's bash blocks and inline code spans; `runnable`: only the
    whole ones (spans with a flag; a span such as `birkhoff train` names a command in prose)."""
    text = README.read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ")
    spans = re.findall(r"`((?:\.venv/bin/)?birkhoff [^`]*)`", text.replace("\n", " "))
    lines = blocks.splitlines() + [s for s in spans if "--" in s or not runnable]
    return [args for line in lines if (args := birkhoff_args(line))]


def test_the_readme_shows_the_main_commands() -> None:
    shown = {args[0] for args in readme_commands(runnable=False)}
    assert {"run", "train", "generate", "eval", "presets", "import-hf"} <= shown


@pytest.mark.parametrize("args", readme_commands(), ids=" ".join)
def test_readme_command_parses(args: list[str]) -> None:
    if "--help" in args:
        return
    parsed, extra = build_parser().parse_known_args(args)
    if extra:  # only `--rl.lr 1e-4`-style settings may be left over
        assert hasattr(parsed, "dotted"), extra
        dotted_overrides(extra)
