"""metrics.jsonl's time stamps, the TensorBoard and W&B mirrors, and the plot."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from birkhoff.runtime.metrics import MetricsLog
from birkhoff.runtime.plots import PANELS, run_figure
from birkhoff.runtime.tracking import WANDB_ID_FILE, import_optional, open_trackers, scalars

ROWS = [
    {"phase": "sft", "step": 0, "main_loss": 3.0, "mem_peak_mib": 600.0},
    {"phase": "sft", "step": 1, "main_loss": 2.0, "mem_peak_mib": 610.0},
    {"phase": "eval", "step": 2, "eval_reward": 0.25},
    {"phase": "grpo", "step": 2, "reward": 0.5, "policy_loss": -0.01, "mtp_loss": 2.5},
    {"phase": "grpo", "step": 3, "reward": 0.75, "policy_loss": 0.02, "mtp_loss": 2.4},
]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rows_get_a_timestamp_and_run_time_that_a_resume_continues(tmp_path: Path) -> None:
    clock = Clock(1_700_000_000.0)
    log = MetricsLog(tmp_path / "metrics.jsonl", clock=clock)
    for row in ROWS[:4]:
        clock.now += 2.0
        log.append(row)
    rows = log.rows()
    assert rows[0]["timestamp"] == "2023-11-14T22:13:22.000+00:00"
    assert [r["elapsed_s"] for r in rows] == [2.0, 4.0, 6.0, 8.0]
    clock.now += 3600  # stopped for an hour, resumed from the checkpoint at step 2
    resumed = MetricsLog(tmp_path / "metrics.jsonl", clock=clock)
    resumed.truncate_after(2)
    clock.now += 1.5
    resumed.append(ROWS[3])
    assert [r["elapsed_s"] for r in resumed.rows()] == [2.0, 4.0, 6.0, 7.5]


def test_scalars_are_named_by_phase() -> None:
    row = {"phase": "grpo", "step": 3, "reward": 0.5, "weight_version": 4, "flag": True, "t": "x"}
    assert scalars(row) == {"grpo/reward": 0.5, "grpo/weight_version": 4.0}


def event_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_mirrors_rows_and_a_resume_replaces_the_repeated_steps(tmp_path: Path):
    log = MetricsLog(
        tmp_path / "metrics.jsonl",
        trackers=open_trackers(["tensorboard"], tmp_path, name="t", config={}),
    )
    for row in ROWS:
        log.append(row)
    log.close()
    seen = event_scalars(tmp_path / "tensorboard")
    assert seen["grpo/reward"] == [(2, 0.5), (3, 0.75)]
    assert seen["sft/main_loss"] == [(0, 3.0), (1, 2.0)] and "eval/eval_reward" in seen
    trackers = open_trackers(["tensorboard"], tmp_path, name="t", config={}, resume_step=3)
    log = MetricsLog(tmp_path / "metrics.jsonl", trackers=trackers)
    log.append(ROWS[4] | {"reward": 0.875})  # step 3 again, after a resume from step 3
    log.close()
    assert event_scalars(tmp_path / "tensorboard")["grpo/reward"] == [(2, 0.5), (3, 0.875)]


class FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.init, self.logged, self.metrics, self.finished = kwargs, [], [], False

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.metrics.append((name, kwargs))

    def log(self, data: dict[str, Any]) -> None:
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    """A `wandb` module that records what it is given (nothing is sent anywhere)."""
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> FakeRun:
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_wandb_logs_each_row_and_a_resume_continues_the_same_run(tmp_path, fake_wandb):
    config = {"rl": {"lr": 1e-4}}
    log = MetricsLog(
        tmp_path / "m.jsonl", trackers=open_trackers(["wandb"], tmp_path, name="run", config=config)
    )
    log.append(ROWS[3])
    log.close()
    (run,) = fake_wandb
    assert run.init["config"] == config and run.init["dir"] == str(tmp_path)
    assert run.init["resume"] == "allow" and run.finished
    assert run.logged[0]["step"] == 2 and run.logged[0]["grpo/reward"] == 0.5
    assert ("*", {"step_metric": "step"}) in run.metrics
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert run.init["id"] == run_id
    open_trackers(["wandb"], tmp_path, name="run", config=config, resume_step=2)
    assert fake_wandb[1].init["id"] == run_id  # the same W&B run goes on
    open_trackers(["wandb"], tmp_path, name="run", config=config)
    assert fake_wandb[2].init["id"] != run_id  # a new run starts a new one


def test_a_missing_tracker_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    # birkhoff is not on PyPI: the package itself, or the extra of a clone
    expected = "--log wandb needs the 'wandb' package: pip install wandb (in a clone of birkhoff "
    with pytest.raises(ValueError, match=re.escape(expected + "also: pip install -e '.[wandb]')")):
        import_optional("wandb", "wandb")


def test_cli_refuses_a_missing_tracker_before_writing(tmp_path, monkeypatch, capsys) -> None:
    from birkhoff.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(["run", "--out", str(tmp_path / "x"), "--log", "wandb"]) == 2
    assert "--log wandb needs the 'wandb' package: pip install wandb " in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_run_logs_to_tensorboard_and_wandb(tmp_path, fake_wandb) -> None:
    from birkhoff.cli import main

    args = ["run", "--out", str(tmp_path), "--warmup-steps", "2", "--steps", "1", "--no-progress",
            "--log", "tensorboard", "--log", "wandb"]  # fmt: skip
    assert main(args) == 0
    logged = [(r["step"], sorted(r)[:2]) for r in fake_wandb[0].logged]
    assert len(logged) == 5  # sft 0, sft 1, eval 2, grpo 2, eval 3: every metrics row
    assert fake_wandb[0].init["config"]["rl"]["warmup_steps"] == 2
    assert "grpo/reward" in event_scalars(tmp_path / "tensorboard")


def test_the_plot_speaks_words_marks_the_phases_and_separates_the_losses() -> None:
    fig = run_figure(ROWS)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert {"GRPO policy loss", "MTP loss", "supervised loss (warm-up)"} <= axes.keys()
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]
    keys = {key for panel in PANELS for key, _ in panel.curves}
    assert not keys & set(labels)  # no raw metric key as a label
    assert "warm-up ends, GRPO begins" in labels
    boundary = [line for line in axes["reward"].lines if line.get_label().startswith("warm-up")]
    assert boundary[0].get_xdata()[0] == 1.5  # between the last sft step and the first grpo one
    assert axes["peak memory, MiB"].get_ylim()[0] == 0
    assert axes["seconds per step"].get_ylim()[0] == 0


def test_real_wandb_offline_keeps_one_run_over_a_resume(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # written under tmp_path, sent nowhere
    monkeypatch.setenv("WANDB_SILENT", "true")
    for resume_step in (None, 3):
        trackers = open_trackers(["wandb"], tmp_path, name="t", config={"rl": {"lr": 1e-4}},
                                 resume_step=resume_step)  # fmt: skip
        log = MetricsLog(tmp_path / "metrics.jsonl", trackers=trackers)
        log.append(ROWS[4])
        log.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)
