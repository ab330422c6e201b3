"""`birkhoff presets`: one line per preset; `birkhoff presets NAME` prints every setting of one as
TOML that `--config` reads back (with `--config` / `--set`, the settings as resolved)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from birkhoff.cli.common import UsageError
from birkhoff.cli.config import add_config_arguments, preset_from_args

if TYPE_CHECKING:
    from birkhoff.presets import Preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=None, help="the preset to print as TOML")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from birkhoff.overrides import to_toml
    from birkhoff.presets import PRESETS

    changed = args.config is not None or args.overrides or args.dotted
    if args.name is None and not changed:
        width = max(map(len, PRESETS))
        for name, factory in PRESETS.items():
            print(f"{name:<{width}}  {describe(factory())}")
        return 0
    try:
        preset = preset_from_args(args, args.name or "tiny-cpu")
    except ValueError as err:
        raise UsageError(str(err)) from err
    print(to_toml(preset), end="")
    return 0


def describe(preset: Preset) -> str:
    """One line: the model's shape, the task, the supervised and GRPO schedule."""
    m, t, rl = preset.model, preset.train, preset.rl
    moe = f", MoE {m.moe.num_experts} experts top-{m.moe.experts_per_token}" if m.moe else ""
    if m.attention is not None:  # DeepSeek-V4: its layer kinds, in order
        short = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA"}
        kinds = [short.get(kind, "HCA") for kind in m.attention.layer_types]
        moe = f", V4 attention ({' + '.join(kinds)}){moe}"
    options = ",".join(f"{k}={v}" for k, v in preset.task_options.items())
    parts = [
        f"dim {m.dim} x {m.num_layers} layers, S={m.num_streams}, M={m.mtp_depth}{moe}, "
        f"seq {m.max_seq_len}",
        f"{preset.task}({options})",
        f"train {t.num_steps} x {t.batch_size} rows"
        + (f", {t.amp_dtype} autocast" if t.amp_dtype != "none" else ""),
    ]
    if rl is not None:
        parts.append(
            f"run: {rl.warmup_steps} warm-up + {rl.num_steps} GRPO steps of "
            f"{rl.num_prompts} prompts x {rl.group_size}"
        )
    return "; ".join(parts)
