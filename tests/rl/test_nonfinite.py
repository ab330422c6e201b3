"""Non-finite losses in the GRPO run: a skipped update is counted and the run goes on; several
in a row stop it with one line pointing at the last good checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_loop import small_preset

import birkhoff.rl.loop
from birkhoff.cli import main
from birkhoff.rl.loop import GRPORun
from birkhoff.train.step import NonFiniteError


def nan_at_steps(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """GRPO's loss is NaN at the given global steps (the rows' `step`)."""
    real = birkhoff.rl.loop.grpo_loss_fn
    seen = iter(range(10**6))

    def loss_fn_factory(cfg, reference=None):
        inner, step = real(cfg, reference), next(seen) + WARMUP

        def loss_fn(model, batch):
            loss, metrics = inner(model, batch)
            return (loss * float("nan") if step in steps else loss), metrics

        return loss_fn

    monkeypatch.setattr(birkhoff.rl.loop, "grpo_loss_fn", loss_fn_factory)


WARMUP = 4  # small_preset(): steps 0-3 warm-up, 4-7 GRPO


def test_an_isolated_nan_is_skipped_and_counted(tmp_path: Path, monkeypatch) -> None:
    nan_at_steps(monkeypatch, {5})
    run = GRPORun(small_preset(), tmp_path, device="cpu")
    rows = [r for r in run.run(progress=False) if r["phase"] == "grpo"]
    assert [r["skipped"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert [r["skipped_total"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert run.step == run.total_steps


def test_nans_in_a_row_stop_the_run_at_the_stated_count(tmp_path: Path, monkeypatch) -> None:
    nan_at_steps(monkeypatch, {5, 6, 7})
    preset = small_preset()
    preset = preset.replace(train=preset.train.replace(max_skipped_in_row=2))
    run = GRPORun(preset, tmp_path, device="cpu")
    with pytest.raises(NonFiniteError, match=r"steps 5-6: 2 steps in a row .*checkpoint: .*step 6"):
        run.run(progress=False)
    assert [(r["step"], r.get("skipped")) for r in run.log.rows()][-1] == (6, 1.0)


def test_cli_reports_it_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    nan_at_steps(monkeypatch, set(range(100)))
    args = ["run", "--out", str(tmp_path), "--warmup-steps", "4", "--steps", "6", "--no-progress",
            "--set", "train.max_skipped_in_row=3"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("birkhoff run: run stopped: steps 4-6: 3 steps")
    assert f"last good checkpoint: {tmp_path / 'checkpoint'} (step 4;" in err[0]
