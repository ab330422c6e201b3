"""`birkhoff run --task NAME`: the preset's task replaced, prompt style and lengths fitted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from birkhoff.presets import get_preset
from birkhoff.rl.inputs import run_inputs, task_inputs
from birkhoff.rl.loop import GRPORun
from birkhoff.tasks.countdown import CountdownTask


@pytest.mark.parametrize("name", ["countdown", "arithmetic-words"])
def test_task_flag_fits_the_character_tokenizer(name: str) -> None:
    base = get_preset("tiny-cpu")
    preset, kwargs = run_inputs(base, task=name)
    assert kwargs == {} and preset.task == name and preset.task_options == {"style": "compact"}
    assert preset.rl is not None and base.rl is not None
    assert preset.rl.max_new_tokens > base.rl.max_new_tokens  # room for the longest answer
    assert preset.model.max_seq_len >= base.model.max_seq_len
    assert preset.model.replace(max_seq_len=base.model.max_seq_len) == base.model


def test_task_flag_errors() -> None:
    base = get_preset("tiny-cpu")
    with pytest.raises(ValueError, match="--task and --data are exclusive"):
        run_inputs(base, task="countdown", data=Path("x.jsonl"))
    with pytest.raises(ValueError, match="task='nope' is unknown"):
        run_inputs(base, task="nope")
    with pytest.raises(ValueError, match="exceed the model's max_seq_len=64"):
        task_inputs(base, "arithmetic-words", tokenizer=None, fresh_model=False,
                    max_new_tokens=60)  # fmt: skip


def test_a_grpo_step_on_countdown(tmp_path: Path) -> None:
    preset, _ = run_inputs(get_preset("tiny-cpu"), task="countdown")
    assert preset.rl is not None
    rl = preset.rl.replace(warmup_steps=1, num_steps=1, num_prompts=2, group_size=2,
                           num_eval_prompts=2)  # fmt: skip
    run = GRPORun(preset.replace(rl=rl, train=preset.train.replace(batch_size=4)), tmp_path)
    assert isinstance(run.task, CountdownTask) and run.task.style == "compact"
    rows = run.run(progress=False)
    assert [r["phase"] for r in rows] == ["sft", "eval", "grpo", "eval"]
    assert 0.0 <= rows[-1]["eval_reward"] <= 1.0


def test_cli_stops_a_run_whose_verifier_keeps_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from birkhoff.cli import main

    (tmp_path / "failing_checks.py").write_text("def check(problem, completion):\n    1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(9)))
    verifier = ["--verifier", "failing_checks:check"]
    args = ["run", "--out", str(tmp_path / "run"), "--data", str(data), *verifier,
            "--no-progress", "--warmup-steps", "1", "--steps", "3"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "run stopped at step" in err and "failing_checks:check failed on" in err
    assert "ZeroDivisionError" in err and "Traceback" not in err.splitlines()[-1]
    sys.modules.pop("failing_checks", None)


def chat_tokenizer(directory: Path):  # type: ignore[no-untyped-def]
    """A small byte-level BPE tokenizer with a ChatML template (prompts through it)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from birkhoff.interop.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["Using the numbers <answer>(1 + 2) * 3</answer>"] * 10, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")  # fmt: skip
    config = {"eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer.from_dir(directory, chat=True)


def test_chat_tokenizer_gets_chat_prompts_and_free_text_room(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from birkhoff.tasks.batches import prompt_ids
    from birkhoff.tasks.problems import get_task

    tok = chat_tokenizer(tmp_path)
    base = get_preset("tiny-cpu")
    base = base.replace(model=base.model.replace(vocab_size=tok.vocab_size, max_seq_len=1024))
    preset = task_inputs(base, "countdown", tokenizer=tok, fresh_model=False, max_new_tokens=None)
    assert preset.task_options == {"style": "chat"}
    assert preset.rl is not None and preset.rl.max_new_tokens == 256
    task = get_task(preset.task, **preset.task_options)
    assert task.stop == ("</answer>",)
    problem = task.sample(random.Random(0))
    ids = prompt_ids(problem, tok)
    assert ids == tok.encode_chat([{"role": "user", "content": problem.prompt}])
    assert ids[0] == tok.token_id("<|im_start|>", "im_start")  # the template frames the prompt


def test_task_flag_keeps_the_task_options_the_user_set() -> None:
    from birkhoff.cli.commands import build_parser
    from birkhoff.cli.run import inputs_from_args

    args = build_parser().parse_args(
        ["run", "--task", "addition", "--set", "task_options.num_digits=3"]
    )
    preset, _ = inputs_from_args(args)
    assert preset.task == "addition" and preset.task_options == {"num_digits": 3}
    bad = build_parser().parse_args(["run", "--task", "countdown", "--set", "task_options.x=3"])
    with pytest.raises(ValueError, match="--task countdown: "):
        inputs_from_args(bad)
