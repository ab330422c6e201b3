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
    args: argparse.Namespace,
    name: str,
    flags: dict[str, str] | None = None,
    *,
    own_task: bool = True,
    rollouts: bool = True,
) -> Preset:
    """Preset `name` with the command line's settings (`settings_overrides`); ValueError in the
    user's words. `own_task`: the run uses the preset's task, which is checked too (`check_task`;
    `rollouts`: generated completions must fit as well)."""
    from birkhoff.overrides import apply
    from birkhoff.presets import get_preset

    overrides = settings_overrides(args, flags)
    preset = apply(get_preset(name), overrides)
    if own_task:
        check_task(preset, overrides, rollouts=rollouts)
    return preset


TASK_SETTINGS = ("task", "task_options.", "model.max_seq_len", "rl.max_new_tokens")
NUM_SAMPLED = 64  # problems whose lengths are checked against model.max_seq_len


def check_task(preset: Preset, overrides: list[Override], *, rollouts: bool = True) -> None:
    """The preset's task takes its options, and a fresh model's max_seq_len holds its problems
    (prompt + answer, and prompt + rl.max_new_tokens for rollouts); ValueError naming the
    settings the user wrote. A preset that starts from an imported model (its own tokenizer
    and max_seq_len) gets the options check only."""
    import random

    from birkhoff.overrides import CHECK_MESSAGE
    from birkhoff.tasks.batches import build_supervised_batch, prompt_ids
    from birkhoff.tasks.problems import get_task, sample_problems
    from birkhoff.tokenizer import CharTokenizer

    labels = [o.label for o in overrides if o.path.startswith(TASK_SETTINGS)]
    given = f" (with {', '.join(labels)})" if labels else ""
    try:
        task = get_task(preset.task, **preset.task_options)
    except ValueError as err:
        match = CHECK_MESSAGE.match(str(err))
        options = {o.path.removeprefix("task_options."): o.label for o in overrides}
        if match and match[1] in options:
            raise ValueError(f"{options[match[1]]} is invalid: {match[3]}") from None
        raise ValueError(f"{err}{given}") from None
    if preset.init is not None:
        return
    tok, limit = CharTokenizer(), preset.model.max_seq_len
    problems = sample_problems(task, random.Random(0), NUM_SAMPLED)
    longest = build_supervised_batch(problems, tok).input_ids.shape[1]
    what = f"prompt + answer take up to {longest} tokens"
    if rollouts and preset.rl is not None and longest <= limit:
        prompt = max(len(prompt_ids(p, tok)) for p in problems)
        new = preset.rl.max_new_tokens
        longest, what = prompt + new, f"prompts of up to {prompt} tokens + {new} new tokens"
    if longest > limit:
        raise ValueError(
            f"model.max_seq_len={limit} is too short for task {preset.task!r}: {what}{given}"
        )


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
