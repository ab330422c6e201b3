"""The flags that set a run's configuration: `--preset`, `--config FILE.toml`, `--set PATH=VALUE`,
`--PATH VALUE` (torchtitan style, e.g. `--rl.lr 1e-4`) and a command's dedicated flags
(`--steps`, `--seed`, ...).

Order: the preset, then the file, then `--set` and `--PATH` flags as written, then the dedicated
flags; a later setting wins. birkhoff.overrides parses and checks them and words every error
with the flag the user wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from birkhoff.overrides import Override
    from birkhoff.presets import Preset

SECTIONS = ("model.", "train.", "rl.", "task_options.")  # prefixes of `--PATH VALUE` flags


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="settings on top of the preset's (`birkhoff presets NAME` writes "
        "every setting of one)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="one setting, e.g. rl.lr=1e-4, train.batch_size=32 (repeatable; also as --rl.lr 1e-4)",
    )
    parser.set_defaults(dotted=[])


def dotted_overrides(extra: list[str]) -> list[Override]:
    """`--rl.lr 1e-4` / `--rl.lr=1e-4` flags (left over by argparse) as overrides.

    A flag without a value (the last one, or one followed by another flag) sets true."""
    from birkhoff.overrides import Override

    out, i = [], 0
    while i < len(extra):
        token = extra[i]
        name, sep, value = token[2:].partition("=")
        if not token.startswith("--") or not name.startswith(SECTIONS):
            raise ValueError(f"unrecognized arguments: {' '.join(extra[i:])}")
        if not sep:
            has_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
            value = extra[i + 1] if has_value else "true"
            i += has_value
        out.append(Override(name, value, f"--{name} {value}" if not sep else token))
        i += 1
    return out


def preset_from_args(
    args: argparse.Namespace, name: str, flags: dict[str, str] | None = None
) -> Preset:
    """Preset `name` with the command line's settings (`settings_overrides`); ValueError in the
    user's words."""
    from birkhoff.overrides import apply
    from birkhoff.presets import get_preset

    return apply(get_preset(name), settings_overrides(args, flags))


def settings_overrides(
    args: argparse.Namespace, flags: dict[str, str] | None = None
) -> list[Override]:
    """The file's, the `--set` / `--PATH` and the dedicated `flags` (dest -> path) settings."""
    from birkhoff.overrides import Override, text_override, toml_overrides

    overrides = toml_overrides(args.config) if args.config is not None else []
    overrides += [text_override(text, f"--set {text}") for text in args.overrides]
    overrides += args.dotted
    for dest, path in (flags or {}).items():
        value = getattr(args, dest)
        if value is not None:
            overrides.append(Override(path, value, f"--{dest.replace('_', '-')} {value}"))
    return overrides
