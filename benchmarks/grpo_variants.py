"""GRPO runs of a preset with overrides, side by side: held-out greedy and sampled reward.

python benchmarks/grpo_variants.py --variant "wu100 warmup_steps=100" \
    --variant "lr1e-4 warmup_steps=100 lr=1e-4" --variant "kl warmup_steps=100 loss.kl_weight=0.1"

Each variant is `NAME key=value ...`: RLConfig fields, `loss.FIELD` (GRPOLossConfig) and
`train.FIELD` (TrainConfig); values are JSON. Runs are sequential, one CPU thread each by
default (deterministic on CPU). Prints one row per variant (first eval, range, last eval), ends
with one JSON line and writes it to benchmarks/results/grpo_variants-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, json_args, write_result

from birkhoff.presets import Preset, get_preset
from birkhoff.rl.loop import GRPORun


def apply_overrides(preset: Preset, pairs: list[str]) -> Preset:
    """The preset with `key=value` overrides of its RL, GRPO loss and training configs."""
    assert preset.rl is not None
    rl: dict[str, Any] = {}
    loss: dict[str, Any] = {}
    train: dict[str, Any] = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        target, name = (loss, key[5:]) if key.startswith("loss.") else (rl, key)
        target, name = (train, key[6:]) if key.startswith("train.") else (target, name)
        target[name] = json.loads(value)
    new_rl = preset.rl.replace(loss=dataclasses.replace(preset.rl.loss, **loss), **rl)
    return preset.replace(rl=new_rl, train=preset.train.replace(**train))


def run_variant(preset: Preset, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run = GRPORun(preset, out, device=device)
        run.run(progress=False)
        evals = [r for r in run.log.rows() if r["phase"] == "eval"]
    greedy = [r["eval_reward"] for r in evals]
    return {
        "seconds": time.perf_counter() - start,
        "steps": [r["step"] for r in evals],
        "greedy": greedy,
        "sampled": [r["eval_sampled_reward"] for r in evals],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-cpu")
    p.add_argument("--variant", action="append", required=True, help="NAME key=value ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    print("| variant | greedy first -> last (min-max) | sampled first -> last | s |")
    print("| --- | --- | --- | --- |")
    for spec in args.variant:
        name, *pairs = spec.split()
        r = run_variant(apply_overrides(get_preset(args.preset), pairs), args.device)
        results[name] = {"overrides": pairs, **r}
        g, s = r["greedy"], r["sampled"]
        print(f"| {name} | {g[0]:.3f} -> {g[-1]:.3f} ({min(g):.3f}-{max(g):.3f}) | "
              f"{s[0]:.3f} -> {s[-1]:.3f} | {r['seconds']:.0f} |")  # fmt: skip
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"grpo_variants-{args.device}.json"
    record = {"args": json_args(args), "variants": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, record, device=args.device, indent=1)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
