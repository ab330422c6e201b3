"""The GRPO main job on 2 gloo ranks: resume is exact, a sharded checkpoint resumes on another
number of ranks, rank 0 writes the log, and the warm-up matches one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_helpers import run_ranks

from birkhoff.presets import Preset, tiny_cpu
from birkhoff.rl.loop import GRPORun
from birkhoff.runtime.dcp import read_sharded_meta

WARMUP, STEPS = 2, 3


def small_preset() -> Preset:
    preset = tiny_cpu()
    assert preset.rl is not None
    rl = preset.rl.replace(warmup_steps=WARMUP, num_steps=STEPS, num_prompts=4, group_size=2,
                           num_eval_prompts=4, eval_every=3, checkpoint_every=0)  # fmt: skip
    return preset.replace(rl=rl, train=preset.train.replace(batch_size=8))


def deterministic(rows: list[dict]) -> list[dict]:
    """Timing and memory figures vary between runs; nothing else."""
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "_gb_s")) and k != "timestamp"
             and not k.startswith("mem_")} for r in rows]  # fmt: skip


def _run_worker(rank: int, out: Path) -> None:
    GRPORun(small_preset(), out / "full", device="cpu").run(progress=False)
    GRPORun(small_preset(), out / "part", device="cpu").run(stop_after=WARMUP + 1, progress=False)
    if rank == 0:  # keep the mid-run checkpoint for the resume on one rank
        shutil.copytree(out / "part/checkpoint", out / "mid/checkpoint")
    dist.barrier()
    resumed = GRPORun(small_preset(), out / "part", device="cpu")
    resumed.resume()
    assert resumed.step == WARMUP + 1
    resumed.run(progress=False)


def _one_rank_worker(rank: int, out: Path) -> None:
    resumed = GRPORun(small_preset(), out / "mid", device="cpu")
    resumed.resume()  # written by 2 ranks, resumed by 1: DCP reshards
    resumed.run(progress=False)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_rank_run_resumes_exactly_and_on_one_rank(tmp_path: Path) -> None:
    run_ranks(_run_worker, tmp_path)
    full, part = rows(tmp_path / "full/metrics.jsonl"), rows(tmp_path / "part/metrics.jsonl")
    assert [r["step"] for r in full] == [r["step"] for r in part]  # one writer: no duplicates
    assert deterministic(part) == deterministic(full)
    assert {r["phase"] for r in full} == {"sft", "grpo", "eval"}
    assert read_sharded_meta(tmp_path / "part/checkpoint").world_size == 2
    # the warm-up's first step is the single-process step on the same global batch
    single = GRPORun(small_preset(), tmp_path / "single", device="cpu")
    first = single.run(stop_after=1, progress=False)[0]
    assert full[0]["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert full[0]["main_loss"] == pytest.approx(first["main_loss"], rel=1e-5)
    # a 2-rank checkpoint continues on 1 rank
    run_ranks(_one_rank_worker, tmp_path, world=1)
    steps = [r["step"] for r in rows(tmp_path / "mid/metrics.jsonl")]
    assert steps[0] == WARMUP + 1 and steps[-1] == WARMUP + STEPS


def _stop_worker(rank: int, out: Path) -> None:
    from birkhoff.runtime.stop import StopFlag

    flag = StopFlag()
    if rank == 1:  # the signal reached one rank only (so far)
        flag.request("SIGTERM")
    run = GRPORun(small_preset(), out, device="cpu")
    assert run.run(progress=False, stop=flag) == []
    assert run.stopped_by == ("SIGTERM" if rank == 1 else "a signal to another rank")
    assert run.checkpoint_step == 0


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    run_ranks(_stop_worker, tmp_path)
    assert read_sharded_meta(tmp_path / "checkpoint").step == 0
