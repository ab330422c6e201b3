"""`birkhoff train`'s run: checkpoints every `checkpoint_every` steps, stops at a step boundary
and resumes with the metrics of the uninterrupted run, row for row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import birkhoff.train.loop
from birkhoff.presets import tiny_cpu
from birkhoff.runtime.checkpoint import load_checkpoint
from birkhoff.runtime.stop import StopFlag
from birkhoff.tasks.problems import get_task
from birkhoff.train.config import TrainConfig
from birkhoff.train.loop import LossWindows, SupervisedRun, run_training
from birkhoff.train.step import train_step

CPU = torch.device("cpu")


def small_cfg(**changes: object) -> TrainConfig:
    cfg = tiny_cpu().train.replace(
        num_steps=8, batch_size=8, warmup_steps=2, log_every=1, checkpoint_every=3
    )
    return cfg.replace(**changes)


def new_run(out: Path, cfg: TrainConfig | None = None) -> SupervisedRun:
    preset = tiny_cpu()
    task = get_task(preset.task, **preset.task_options)
    return SupervisedRun(preset.model, cfg or small_cfg(), task, out, device=CPU)


def deterministic(rows: list[dict]) -> list[dict]:
    """Timing (`*_s`), memory (`mem_*`) and `timestamp` vary between runs."""

    def varies(key: str) -> bool:
        return key.endswith("_s") or key.startswith("mem_") or key == "timestamp"

    return [{k: v for k, v in r.items() if not varies(k)} for r in rows]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    """The uninterrupted run's deterministic rows and summary (one thread, as every test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    run = new_run(tmp_path_factory.mktemp("full"))
    summary = run.run(progress=False)
    torch.set_num_threads(before)
    assert summary is not None
    return deterministic(run.log.rows()), summary._asdict()


def stop_during_steps(monkeypatch: pytest.MonkeyPatch, flag: StopFlag, steps: set[int]) -> None:
    """Raise `flag` in the middle of each step in `steps`, as a signal arriving then would."""

    def train_step_then_stop(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if kwargs["step"] in steps:
            flag.request("SIGINT")
        return out

    monkeypatch.setattr(birkhoff.train.loop, "train_step", train_step_then_stop)


def test_checkpoints_every_checkpoint_every_steps(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    saved: list[int] = []
    save = run.save
    run.save = lambda **kw: saved.append(run.step) or save(**kw)  # type: ignore[method-assign]
    assert run.run(progress=False) is not None
    assert saved == [3, 6, 8]  # every 3 steps, and the final one (with its evaluation)
    loaded = load_checkpoint(tmp_path / "checkpoint")
    assert loaded.step == 8 and loaded.extra["job"] == "train"
    assert "eval_exact_match" in loaded.extra


@pytest.mark.parametrize(
    "stops",
    [(0,), (2,), (3,), (4, 5), (1, 6)],
    ids=["first-step", "at-a-checkpoint", "after-a-checkpoint", "twice", "early-and-late"],
)
def test_stop_and_resume_repeat_the_uninterrupted_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stops: tuple[int, ...],
    full: tuple[list[dict], dict],
) -> None:
    for k in stops:
        run = new_run(tmp_path)
        if (tmp_path / "checkpoint").exists():
            run.resume()
        flag = StopFlag()
        stop_during_steps(monkeypatch, flag, {k})
        assert run.run(progress=False, stop=flag) is None
        assert (run.stopped_by, run.step, run.checkpoint_step) == ("SIGINT", k + 1, k + 1)
        monkeypatch.undo()
    resumed = new_run(tmp_path)
    resumed.resume()
    assert resumed.step == stops[-1] + 1
    summary = resumed.run(progress=False)
    assert summary is not None and resumed.stopped_by is None
    assert deterministic(resumed.log.rows()) == full[0]
    assert summary._asdict() == full[1] | {"checkpoint": tmp_path / "checkpoint"}


def test_a_stop_in_the_last_step_finishes_the_run(tmp_path: Path, monkeypatch) -> None:
    flag = StopFlag()
    stop_during_steps(monkeypatch, flag, {7})
    run = new_run(tmp_path)
    assert run.run(progress=False, stop=flag) is not None  # nothing is left to stop before
    assert run.stopped_by is None and load_checkpoint(tmp_path / "checkpoint").step == 8


def test_a_stop_before_the_first_step_checkpoints_step_0(tmp_path: Path) -> None:
    flag = StopFlag()
    flag.request("SIGTERM")  # arrived while the run was being built
    run = new_run(tmp_path)
    assert run.run(progress=False, stop=flag) is None
    assert (run.stopped_by, run.checkpoint_step) == ("SIGTERM", 0)
    resumed = new_run(tmp_path)
    resumed.resume()
    assert resumed.step == 0 and resumed.eval_before == run.eval_before


def test_stop_after_and_resume_from_an_older_checkpoint(
    tmp_path: Path, full: tuple[list[dict], dict]
) -> None:
    # stopped at 5 (checkpoint at 3 and 5), then the run went on without a checkpoint to 6 and
    # died: the resumed run drops the row of step 5 and writes it again, once
    run = new_run(tmp_path, small_cfg(checkpoint_every=0))
    assert run.run(progress=False, stop_after=5) is None and run.stopped_by == "--stop-after"
    older = new_run(tmp_path, small_cfg(checkpoint_every=0))
    older.resume()
    older.run(progress=False, stop_after=6)
    import shutil

    shutil.rmtree(tmp_path / "checkpoint")
    run.save()  # the checkpoint of step 5 again
    resumed = new_run(tmp_path, small_cfg(checkpoint_every=0))
    resumed.resume()
    assert resumed.step == 5
    resumed.run(progress=False)
    assert deterministic(resumed.log.rows()) == full[0]


def test_loss_windows_keep_a_fifth_of_the_run() -> None:
    windows = LossWindows(num_steps=10)  # windows of 2
    for x in range(10):
        windows.add({"main_loss": float(x)})
    assert windows.means() == {"main_loss": (0.5, 8.5)}
    again = LossWindows(num_steps=10)
    again.restore(windows.state())
    assert again.means() == windows.means()


def test_run_training_replaces_the_previous_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 99, "phase": "sft"}\n')
    preset = tiny_cpu()
    task = get_task(preset.task, **preset.task_options)
    cfg = small_cfg(num_steps=2, checkpoint_every=0)
    summary = run_training(preset.model, cfg, task, tmp_path, device=CPU, progress=False)
    assert summary.checkpoint == tmp_path / "checkpoint"
    assert [r["step"] for r in new_run(tmp_path).log.rows()] == [0, 1]
