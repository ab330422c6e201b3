"""`birkhoff import-hf | export-hf`, `run --init/--data`, `generate` with an HF tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, save_hf_model
from test_hf_tokenizer import write_tokenizer

from birkhoff.cli import main
from birkhoff.engine import Engine, SamplingParams
from birkhoff.interop.tokenizer import HFTokenizer
from birkhoff.runtime.checkpoint import load_checkpoint

NO_BOS = {"eos_token": "</s>", "pad_token": "<pad>"}  # Qwen-style: prompts start without a BOS
LINES = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(6) for b in range(4)]


def hf_dir_with_tokenizer(path: Path, *, generation: dict | None = None) -> Path:
    write_tokenizer(path, NO_BOS, generation=generation)
    vocab = HFTokenizer.from_dir(path).vocab_size
    save_hf_model(build_hf_model("qwen2-bias", vocab_size=vocab), path)
    return path


def write_jsonl(path: Path, rows: list[dict], *, extra: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


def test_import_hf_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = hf_dir_with_tokenizer(tmp_path / "hf")
    argv = ["import-hf", str(hf), "--out", str(tmp_path / "ckpt"), "--streams", "2",
            "--mtp-depth", "1"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert (loaded.config.num_streams, loaded.config.mtp_depth, loaded.config.qkv_bias) == (
        2, 1, True)  # fmt: skip
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    assert main(argv) == 2  # an existing --out needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["import-hf", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_export_hf_command_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    hf = hf_dir_with_tokenizer(tmp_path / "hf")
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "s1")]) == 0
    assert main(["export-hf", str(tmp_path / "s1"), "--out", str(tmp_path / "back")]) == 0
    original, back = (
        load_file(hf / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert original.keys() == back.keys()
    assert all(torch.equal(original[n], back[n]) for n in original)
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "back" / name).read_bytes() == (hf / name).read_bytes()
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "s2"), "--streams", "2"]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "s2"), "--out", str(tmp_path / "x")]) == 2
    assert "num_streams" in capsys.readouterr().err


def test_generate_uses_the_checkpoint_tokenizer_and_its_stop_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = hf_dir_with_tokenizer(tmp_path / "hf")
    tok = HFTokenizer.from_dir(hf)
    assert tok.bos_id is None
    prompt_ids = tok.encode("12+34=")
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "a")]) == 0
    engine = Engine.from_model(load_checkpoint(tmp_path / "a").model.eval())
    tokens = engine.generate([prompt_ids], SamplingParams(8))[0].tokens  # no BOS in front
    stop = tokens[-1]  # generation_config.json's extra stop id: generation ends before it
    kept = tokens[: tokens.index(stop)]
    assert stop != tok.eos_id and tok.decode(kept) != tok.decode(tokens)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, stop]}))
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(tmp_path / "b"), "--prompt", "12+34=",
            "--max-new-tokens", "8", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == "12+34=" + tok.decode(kept)


def run_argv(out: Path, *extra: str) -> list[str]:
    return ["run", "--out", str(out), "--warmup-steps", "2", "--steps", "2", "--no-progress",
            "--device", "cpu", *extra]  # fmt: skip


def test_run_on_jsonl_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "add.jsonl", LINES)
    held_out = write_jsonl(tmp_path / "held.jsonl", LINES[:5])
    argv = run_argv(tmp_path / "run", "--data", str(data), "--eval-data", str(held_out),
                    "--verifier", "numeric")  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [2, 4]
    assert "eval_reward" in rows[-1] and (tmp_path / "run" / "checkpoint").is_dir()


def test_run_from_an_imported_checkpoint(tmp_path: Path) -> None:
    hf = hf_dir_with_tokenizer(tmp_path / "hf")
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "ckpt"), "--mtp-depth", "1"]) == 0
    data = write_jsonl(tmp_path / "add.jsonl", LINES)
    before = load_checkpoint(tmp_path / "ckpt").model
    argv = run_argv(tmp_path / "run", "--init", str(tmp_path / "ckpt"), "--data", str(data))
    assert main(argv) == 0
    after = load_checkpoint(tmp_path / "run" / "checkpoint").model
    assert after.cfg == before.cfg and after.cfg.qkv_bias and after.cfg.mtp_depth == 1
    moved = [n for n, p in after.state_dict().items() if not torch.equal(p, before.state_dict()[n])]
    assert "layers.0.attn.wq.bias" in moved  # trained from the imported weights


BAD_RUNS = [
    (["--data", "{data}"], "bad.jsonl:3: 'answer' must be a string or a number"),
    (["--data", "{data}", "--verifier", "nope"], "verifier"),
    (["--verifier", "exact"], "need --data"),
    (["--data", "{data}", "--init", "{missing}"], "missing"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_RUNS)
def test_run_refuses_bad_inputs_before_training(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(
        tmp_path / "bad.jsonl", LINES[:2], extra='{"prompt": "1+1=", "answer": []}\n'
    )
    filled = [f.format(data=data, missing=tmp_path / "missing") for f in flags]
    assert main(run_argv(tmp_path / "run", *filled)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written
