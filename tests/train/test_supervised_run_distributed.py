"""`birkhoff train`'s run on 2 gloo ranks: a signal that reached one rank stops both at the same
step with a sharded checkpoint, and the resumed run's log equals the uninterrupted one's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_helpers import run_ranks

from birkhoff.presets import tiny_cpu
from birkhoff.runtime.dcp import read_sharded_meta
from birkhoff.runtime.stop import StopFlag
from birkhoff.tasks.problems import get_task
from birkhoff.train.loop import SupervisedRun


def new_run(out: Path) -> SupervisedRun:
    preset = tiny_cpu()
    cfg = preset.train.replace(num_steps=4, batch_size=8, log_every=1, checkpoint_every=0)
    task = get_task(preset.task, **preset.task_options)
    return SupervisedRun(preset.model, cfg, task, out, device=torch.device("cpu"))


def _worker(rank: int, out: Path) -> None:
    assert new_run(out / "full").run(progress=False) is not None
    part, flag = new_run(out / "part"), StopFlag()
    if rank == 1:
        flag.request("SIGTERM")  # the signal reached one rank only (so far)
    assert part.run(progress=False, stop=flag) is None
    assert part.checkpoint_step == 0
    resumed = new_run(out / "part")
    resumed.resume()
    assert resumed.run(progress=False, stop_after=2) is None
    resumed = new_run(out / "part")
    resumed.resume()
    assert resumed.step == 2 and resumed.run(progress=False) is not None


def rows(path: Path) -> list[dict]:
    keep = lambda k: not k.endswith("_s") and not k.startswith("mem_") and k != "timestamp"  # noqa: E731
    return [{k: v for k, v in json.loads(line).items() if keep(k)}
            for line in path.read_text().splitlines()]  # fmt: skip


def test_two_rank_stop_and_resume_repeat_the_uninterrupted_run(tmp_path: Path) -> None:
    run_ranks(_worker, tmp_path)
    full = rows(tmp_path / "full/metrics.jsonl")
    assert [r["step"] for r in full] == [0, 1, 2, 3]
    assert rows(tmp_path / "part/metrics.jsonl") == full
    assert read_sharded_meta(tmp_path / "part/checkpoint").world_size == 2
