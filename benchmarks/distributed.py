"""The distributed path (torchrun, FSDP2, refit from shards, sharded checkpoints) next to the plain
single-process one, in one run.

    torchrun --nproc-per-node 1 benchmarks/distributed.py --device cuda     # one H200, minutes
    torchrun --nproc-per-node 1 benchmarks/distributed.py --device cpu --quick   # smoke, CPU

Under torchrun every rank measures the distributed path; rank 0 then runs this script again
without torchrun (`--plain`, a subprocess with no process group) for the plain figures, so both
columns come from the same machine in the same run. Measured per path:
- train step: `train_step` of the h200-small preset (bf16 autocast) on a [B,T] batch of random
  tokens, median seconds and tokens/s over all ranks, peak memory, and the loss of the first
  step (same initialisation and batch in both paths: their numeric difference);
- GRPO step: `GRPORun.grpo_step` of the h200-grpo preset (rollout, update, refit), with its
  generate / train / refit split;
- refit: `GRPORun.refit` (plain: from the Parameters; distributed: gathered from the shards);
- checkpoint: save and load (resume) seconds and bytes on disk (plain: safetensors; distributed:
  torch.distributed.checkpoint, sharded);
- the whole job (distributed only): warm-up and GRPO steps, stopped mid-run with a checkpoint,
  resumed, finished; the steps and the held-out rewards it logged.
Prints a table, writes benchmarks/results/distributed-<device>[-quick].json, ends with one JSON
line. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, json_args, sync, timed, write_result

from birkhoff.presets import Preset, get_preset
from birkhoff.rl.loop import GRPORun
from birkhoff.runtime import distributed
from birkhoff.tasks.batches import SupervisedBatch
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import train_step


def presets(quick: bool) -> tuple[Preset, Preset]:
    """(train-step preset, GRPO preset): h200-small / h200-grpo, or tiny-cpu for --quick."""
    if quick:
        tiny = get_preset("tiny-cpu")
        assert tiny.rl is not None
        rl = tiny.rl.replace(warmup_steps=4, num_steps=4, num_eval_prompts=16, eval_every=2,
                             checkpoint_every=2)  # fmt: skip
        return tiny.replace(train=tiny.train.replace(batch_size=8)), tiny.replace(rl=rl)
    grpo = get_preset("h200-grpo")
    assert grpo.rl is not None
    rl = grpo.rl.replace(warmup_steps=40, num_steps=6, eval_every=3, checkpoint_every=3)
    return get_preset("h200-small"), grpo.replace(rl=rl)


def peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def train_step_figures(preset: Preset, device: torch.device, args: argparse.Namespace) -> dict:
    ctx = distributed.current()
    torch.manual_seed(0)
    model = build_model(preset.model, preset.train, device=device)
    if ctx.enabled:
        distributed.shard_model(model, device_type=device.type, amp_dtype=preset.train.amp_dtype)
    optimizer = build_optimizer(model, preset.train)
    T = min(args.seq, preset.model.max_seq_len)
    B = max(preset.train.batch_size // ctx.world_size, 1)
    ids_BT = torch.randint(3, preset.model.vocab_size, (B, T), device=device)
    batch = SupervisedBatch(ids_BT, torch.ones_like(ids_BT, dtype=torch.bool))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # same seed, same batch in both paths: the first loss shows the numeric difference
    first_loss = train_step(model, optimizer, batch, preset.train, step=10)["loss"]
    seconds = timed(lambda: train_step(model, optimizer, batch, preset.train, step=10), device,
                    args.repeats, warmup=2)  # fmt: skip
    tokens_s = B * T * ctx.world_size / seconds
    return {"train_step_s": seconds, "train_tokens_s": tokens_s, "train_peak_mib": peak_mib(device),
            "train_first_loss": first_loss}  # fmt: skip


def grpo_figures(preset: Preset, device: torch.device, args: argparse.Namespace) -> dict:
    """GRPO step split, refit and checkpoint figures of one GRPORun (warm-up skipped)."""
    out = Path(tempfile.mkdtemp(prefix="birkhoff-dist-", dir=args.scratch))
    run = GRPORun(preset, out, device=str(device))
    assert run.rl is not None
    run.step = run.rl.warmup_steps  # straight to GRPO: timing does not need a trained policy
    rows = []
    for _ in range(args.grpo_steps):
        rows.append(run.grpo_step())
        run.step += 1
    keep = rows[1:] or rows  # the first step carries one-time costs
    figures = {k: sum(r[k] for r in keep) / len(keep) for k in ("generate_s", "train_s", "refit_s")}
    figures["grpo_step_s"] = sum(figures.values())
    figures["refit_s"] = timed(run.refit, device, args.repeats, warmup=1)
    figures.update(checkpoint_figures(run, device))
    shutil.rmtree(out, ignore_errors=True)
    return figures


def checkpoint_figures(run: GRPORun, device: torch.device) -> dict:
    sync(device)
    start = time.perf_counter()
    run.save()
    save_s = time.perf_counter() - start
    path = run.out / "checkpoint"
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    start = time.perf_counter()
    run.resume()
    sync(device)
    return {"ckpt_save_s": save_s, "ckpt_load_s": time.perf_counter() - start,
            "ckpt_mib": nbytes / 2**20}  # fmt: skip


def whole_job(preset: Preset, device: torch.device, args: argparse.Namespace) -> dict:
    """Warm-up + GRPO under torchrun, stopped after a checkpoint, resumed on the same ranks."""
    assert preset.rl is not None
    out = Path(tempfile.mkdtemp(prefix="birkhoff-job-", dir=args.scratch))
    stop = preset.rl.warmup_steps + preset.rl.checkpoint_every
    start = time.perf_counter()
    GRPORun(preset, out, device=str(device)).run(stop_after=stop, progress=False)
    resumed = GRPORun(preset, out, device=str(device))
    resumed.resume()
    resumed_at = resumed.step
    resumed.run(progress=False)
    evals = [r for r in resumed.log.rows() if r["phase"] == "eval"] if resumed.dist.is_main else []
    curve = [(r["step"], r.get("eval_sampled_reward")) for r in evals]
    result = {"job_s": time.perf_counter() - start, "job_resumed_at": resumed_at,
              "job_final_step": resumed.step, "job_eval_reward": curve}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if distributed.launched_by_torchrun():
        device = distributed.init_distributed(args.device).device
    train_preset, grpo_preset = presets(args.quick)
    figures = train_step_figures(train_preset, device, args)
    figures.update(grpo_figures(grpo_preset, device, args))
    if distributed.current().enabled and not args.no_job:
        figures.update(whole_job(grpo_preset, device, args))
    return figures


def plain_figures(args: argparse.Namespace) -> dict[str, Any]:
    """This script without torchrun: the single-process path, in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--plain", "--device", args.device,
           "--repeats", str(args.repeats), "--seq", str(args.seq),
           "--grpo-steps", str(args.grpo_steps)] + (["--quick"] if args.quick else [])  # fmt: skip
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


ROWS = (
    ("first train loss", "train_first_loss"),
    ("train step s", "train_step_s"),
    ("train tokens/s", "train_tokens_s"),
    ("train peak MiB", "train_peak_mib"),
    ("GRPO step s", "grpo_step_s"),
    ("  generate s", "generate_s"),
    ("  train s", "train_s"),
    ("refit s", "refit_s"),
    ("checkpoint save s", "ckpt_save_s"),
    ("checkpoint load s", "ckpt_load_s"),
    ("checkpoint MiB", "ckpt_mib"),
)


def print_table(plain: dict, dist: dict, world: int) -> None:
    print(f"| figure | plain (1 process) | FSDP2 ({world} rank(s)) | FSDP2 / plain |")
    print("| --- | --- | --- | --- |")
    for label, key in ROWS:
        a, b = plain.get(key), dist.get(key)
        ratio = f"{b / a:.3f}" if a and b is not None else "-"
        print(f"| {label} | {a if a is None else f'{a:.4g}'} | {b if b is None else f'{b:.4g}'} "
              f"| {ratio} |")  # fmt: skip
    if "job_s" in dist:
        print(
            f"whole job: {dist['job_s']:.1f} s, resumed at step {dist['job_resumed_at']}, "
            f"finished at {dist['job_final_step']}, eval {dist['job_eval_reward']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny-cpu presets, seconds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seq", type=int, default=2048, help="train-step tokens per row")
    p.add_argument("--grpo-steps", type=int, default=4)
    p.add_argument("--no-job", action="store_true", help="skip the whole-job run")
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scratch", type=Path, default=None, help="temp dir for checkpoints")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    try:
        report(args, measure(args))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    if args.plain:
        print(json.dumps(figures))
        return
    ctx = distributed.current()
    if not ctx.is_main:
        return
    plain = plain_figures(args) if ctx.world_size == 1 else {}
    print_table(plain, figures, ctx.world_size)
    name = f"distributed-{args.device}{'-quick' if args.quick else ''}.json"
    out = args.out or REPO_ROOT / "benchmarks" / "results" / name
    result = {"args": json_args(args), "world_size": ctx.world_size, "plain": plain,
              "distributed": figures, "torch": torch.__version__}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, device=args.device, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
