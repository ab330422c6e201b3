"""One GRPO step of a preset against its plain twin (S=1, M=0, no drafts), split into phases.

python benchmarks/cpu_step.py                       # tiny-cpu, 2 x 30 interleaved steps
python benchmarks/cpu_step.py --set rl.num_speculative_tokens=1 --tag k1
python benchmarks/cpu_step.py --profile preset      # cProfile of 5 steps of one variant

Each variant is a `GRPORun` of the preset (the twin: model.num_streams=1, model.mtp_depth=0,
rl.num_speculative_tokens=0, nothing else changed) that first runs the preset's supervised
warm-up (so the drafter's acceptance is the one the main job sees), is refit, and then runs
`--steps` GRPO steps, the variants interleaved step by step so that a busy machine slows both
alike. A step is `GRPORun.grpo_step` as the main job runs it (rollout of Q x W completions,
rewards, advantages, update, refit); its phases are the step's own timings (`generate_s`,
`train_s`, `refit_s`). Reported per variant: the median of each phase and of the whole step,
the rollout's draft acceptance, and the ratio of the preset's median step to the twin's: compare
ratios, not milliseconds, on a shared machine. Threads as the preset sets them (tiny-cpu: 1).
`--set` overrides a field of the preset variant only (`model.X`, `train.X`, `rl.X`; JSON values).
Writes benchmarks/results/cpu_step-<preset>[-<tag>].json.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, json_args, write_result

from birkhoff.presets import Preset, get_preset
from birkhoff.rl.loop import GRPORun

PHASES = ("generate_s", "train_s", "refit_s", "step_s")


def with_overrides(preset: Preset, pairs: list[str]) -> Preset:
    """`preset` with `model.X=v`, `train.X=v`, `rl.X=v` overrides (v is JSON)."""
    parts: dict[str, dict[str, Any]] = {"model": {}, "train": {}, "rl": {}}
    for pair in pairs:
        key, value = pair.split("=", 1)
        part, _, name = key.partition(".")
        if part not in parts or not name:
            raise ValueError(f"--set {pair!r}: expected model.X=, train.X= or rl.X=")
        parts[part][name] = json.loads(value)
    assert preset.rl is not None
    return preset.replace(
        model=preset.model.replace(**parts["model"]),
        train=preset.train.replace(**parts["train"]),
        rl=dataclasses.replace(preset.rl, **parts["rl"]),
    )


def plain_twin(preset: Preset) -> Preset:
    """The same job on a plain transformer: one stream, no MTP depth, no drafts."""
    return with_overrides(
        preset, ["model.num_streams=1", "model.mtp_depth=0", "rl.num_speculative_tokens=0"]
    )


def warmed_run(preset: Preset, out: str) -> GRPORun:
    """A run after the preset's supervised warm-up, its engine refit: the first GRPO step."""
    run = GRPORun(preset, out)
    rows = run.step_rows()  # the supervised warm-up's rows come first
    for _ in range(run.rl.warmup_steps):
        next(rows)
        run.step += 1
    run.refit()
    return run


def timed_step(run: GRPORun) -> dict[str, float]:
    start = time.perf_counter()
    row = run.grpo_step()
    row["step_s"] = time.perf_counter() - start
    run.step += 1
    return row


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in PHASES}
    accepts = sorted(k for k in rows[0] if k.startswith("accept_"))
    out.update({k: statistics.mean(r[k] for r in rows) for k in accepts})
    out["steps"] = len(rows)
    return out


def profile(preset: Preset, steps: int, top: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        run = warmed_run(preset, out)
        timed_step(run)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            timed_step(run)
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-cpu")
    p.add_argument("--steps", type=int, default=30, help="timed GRPO steps per variant")
    p.add_argument("--skip", type=int, default=2, help="untimed GRPO steps first")
    p.add_argument("--set", action="append", default=[], help="override of the preset variant")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--profile", choices=("preset", "plain"), default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    base = get_preset(args.preset)
    variants = {"preset": with_overrides(base, args.set), "plain": plain_twin(base)}
    torch.set_num_threads(base.num_threads or torch.get_num_threads())
    if args.profile:
        profile(variants[args.profile], args.steps, top=45)
        return
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as out:
        runs = {name: warmed_run(v, f"{out}/{name}") for name, v in variants.items()}
        for i in range(args.skip + args.steps):
            for name, run in runs.items():
                row = timed_step(run)
                if i >= args.skip:
                    rows[name].append(row)
    result = {name: summarize(r) for name, r in rows.items()}
    ratios = {f"preset_over_plain_{k}": result["preset"][k] / result["plain"][k] for k in PHASES}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} thread(s)")  # fmt: skip
    print("| variant | step ms | rollout ms | update ms | refit ms | acceptance |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in result.items():
        acc = " ".join(f"{r[k]:.2f}" for k in r if k.startswith("accept_")) or "-"
        ms = [f"{1e3 * r[k]:.1f}" for k in ("step_s", "generate_s", "train_s", "refit_s")]
        print(f"| {name} | {' | '.join(ms)} | {acc} |")
    print(f"preset / plain: step {ratios['preset_over_plain_step_s']:.2f}x")
    record = {
        "args": json_args(args),
        "load_average": os.getloadavg()[0],
        "variants": result,
        "ratios": ratios,
    }
    name = f"cpu_step-{args.preset}" + (f"-{args.tag}" if args.tag else "")
    out_path = args.out or REPO_ROOT / "benchmarks" / "results" / f"{name}.json"
    write_result(out_path, record, device="cpu", indent=1)


if __name__ == "__main__":
    main()
