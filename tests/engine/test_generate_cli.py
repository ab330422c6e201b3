"""`birkhoff generate`: a checkpoint and text prompts in, completions out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.cli import main
from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer
from birkhoff.runtime.checkpoint import save_checkpoint
from birkhoff.tokenizer import CharTokenizer


def test_generate_prints_the_engine_completion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size)).eval()
    save_checkpoint(tmp_path / "ckpt", model, step=0)
    argv = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "12+3=",
            "--max-new-tokens", "6", "--speculative", "2", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    engine = Engine.from_model(model)
    ids = [tok.bos_id, *tok.encode("12+3=")]
    expected = engine.generate([ids], SamplingParams(6, stop_token_ids=(tok.eos_id,)))[0]
    assert lines[0] == "12+3=" + tok.decode(expected.tokens)
    assert lines[1].startswith("acceptance per draft position")


def test_generate_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--prompt", "1", "--device", "cpu", "--checkpoint"]
    assert main([*base, str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*base, str(tmp_path), "--temperature=-1"]) == 2
    assert "temperature" in capsys.readouterr().err
