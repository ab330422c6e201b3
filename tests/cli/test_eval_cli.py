"""`birkhoff eval`: a run's checkpoint gives back the run's own eval figures; an imported-style
checkpoint on a JSONL file; the files it writes; bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from birkhoff.cli import main
from birkhoff.model import Transformer
from birkhoff.presets import tiny_cpu
from birkhoff.runtime.checkpoint import save_checkpoint


def test_eval_of_a_run_checkpoint_repeats_the_runs_eval_row(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    args = [
        "run",
        "--out",
        str(run),
        "--warmup-steps",
        "20",
        "--steps",
        "0",
        "--no-progress",
        "--set",
        "rl.num_eval_prompts=16",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.batch_size=32",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in rows if r["phase"] == "eval"][-1]
    assert last_eval["eval_sampled_reward"] > 0  # partly learned: the comparison means something
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run / "checkpoint"), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "pass@1_greedy" in printed and "outputs:" in printed
    figures = json.loads((run / "eval" / "figures.json").read_text())
    for key in ("eval_reward", "eval_sampled_reward", "eval_accept_1"):
        assert figures[key] == last_eval[key], key
    assert figures["num_problems"] == 16 and figures["samples"] == 8 and figures["seed"] == 0
    lines = (run / "eval" / "completions.jsonl").read_text().splitlines()
    assert len(lines) == 16 * (1 + 8)
    assert main(["eval", "--checkpoint", str(run / "checkpoint")]) == 2  # outputs exist
    assert "--overwrite" in capsys.readouterr().err


def test_eval_of_a_checkpoint_without_settings_on_a_jsonl_file(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", Transformer(tiny_cpu().model).eval(), step=0)
    data = tmp_path / "held.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    out = tmp_path / "eval"
    args = [
        "eval",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--data",
        str(data),
        "--samples",
        "2",
        "--seed",
        "7",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    figures = json.loads((out / "figures.json").read_text())
    assert figures["num_problems"] == 5 and figures["samples"] == 2 and figures["seed"] == 7
    assert {"pass@1", "pass@2", "pass@1_greedy"} <= set(figures)
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records if r["mode"] == "greedy"] == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--samples", "1"], "--samples 1 is invalid: must be >= 2"),
        (["--task", "addition", "--data", "x.jsonl"], "--task and --data are exclusive"),
        (["--verifier", "exact"], "--verifier needs --data"),
        (["--num-problems", "0"], "--num-problems must be >= 1"),
    ],
)
def test_eval_bad_input_is_one_line(tmp_path: Path, capsys, extra, message) -> None:
    save_checkpoint(tmp_path / "ckpt", Transformer(tiny_cpu().model).eval(), step=0)
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "eval").exists()
