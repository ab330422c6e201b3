"""JSONL tasks and verifiers: errors name the line, splits are held out, rewards are verified."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from birkhoff.tasks.batches import build_supervised_batch
from birkhoff.tasks.jsonl import DataError, JsonlTask, load_jsonl_tasks
from birkhoff.tasks.problems import Problem
from birkhoff.tasks.verifiers import get_verifier, normalise, parse_number
from birkhoff.tokenizer import CharTokenizer


def write(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def good_lines(n: int) -> list[str]:
    return [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(n)]


def test_split_is_seeded_disjoint_and_covers_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, [*good_lines(10), "", json.dumps({"prompt": "x", "answer": 7})])
    splits = load_jsonl_tasks(path, eval_fraction=0.25, seed=3)
    train, held = splits.train.problems, splits.eval.problems
    assert len(held) == 3 and len(train) == 8
    assert not set(train) & set(held) and len(set(train) | set(held)) == 11
    assert Problem("x", "7") in train + held  # numbers become their JSON text
    again = load_jsonl_tasks(path, eval_fraction=0.25, seed=3)
    assert again.eval.problems == held
    assert load_jsonl_tasks(path, eval_fraction=0.25, seed=4).eval.problems != held
    rng = random.Random(0)
    assert all(splits.train.sample(rng) in train for _ in range(50))
    assert splits.train.max_length() == max(len(p.prompt) + len(p.answer) for p in train)


def test_separate_eval_file(tmp_path: Path) -> None:
    splits = load_jsonl_tasks(
        write(tmp_path, good_lines(3)), eval_path=write(tmp_path, good_lines(1), "eval.jsonl")
    )
    assert len(splits.train.problems) == 3 and splits.eval.problems == [Problem("0+0=", "0")]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "invalid JSON"),
        ('["prompt", "answer"]', "expected a JSON object, got list"),
        ('{"answer": "1"}', "no 'prompt' key"),
        ('{"prompt": "1+1="}', "no 'answer' key"),
        ('{"question": "1+1="}', "no 'prompt' and no 'answer' key"),
        ('{"prompt": "  ", "answer": "1"}', "'prompt' is empty"),
        ('{"prompt": "1+1=", "answer": null}', "'answer' must be a string or a number"),
        ('{"prompt": "1+1=", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "1+1=", "answer": " "}', "answer is empty after normalisation"),
    ],
)
def test_malformed_lines_are_named(tmp_path: Path, line: str, why: str) -> None:
    path = write(tmp_path, [*good_lines(3), "", line, *good_lines(2)])
    with pytest.raises(DataError, match=rf"data\.jsonl:5: {why}"):
        load_jsonl_tasks(path)


def test_all_bad_lines_reported_with_tokenizer_and_length_checks(tmp_path: Path) -> None:
    lines = [
        *good_lines(2),
        json.dumps({"prompt": "ÄÖ+1=", "answer": "2"}),
        json.dumps({"prompt": "1" * 40 + "=", "answer": "1"}),
        json.dumps({"prompt": "2+2=", "answer": "four"}),
    ]
    with pytest.raises(DataError) as err:
        load_jsonl_tasks(
            write(tmp_path, lines), verifier="numeric", tokenizer=CharTokenizer(), max_seq_len=32
        )
    message = str(err.value)
    assert "data.jsonl:3: character 'Ä'" in message
    assert "data.jsonl:4: 44 tokens (framed prompt, answer, eos) > max_seq_len=32" in message
    assert "data.jsonl:5: answer 'four' is not a finite number" in message
    assert ":1:" not in message and ":2:" not in message


def test_empty_file_missing_file_and_tiny_split(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no problems"):
        load_jsonl_tasks(write(tmp_path, ["", "  "]))
    with pytest.raises(DataError, match="not found"):
        load_jsonl_tasks(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="at least 2"):
        load_jsonl_tasks(write(tmp_path, good_lines(1)))
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        load_jsonl_tasks(write(tmp_path, good_lines(4)), eval_fraction=1.5)


def test_jsonl_task_feeds_the_supervised_batch(tmp_path: Path) -> None:
    task = load_jsonl_tasks(write(tmp_path, good_lines(6))).train
    batch = build_supervised_batch(task.problems, CharTokenizer())
    assert batch.input_ids.shape[0] == len(task.problems)
    assert task.reward(task.problems[0], task.problems[0].answer) == 1.0
    with pytest.raises(ValueError, match="no problems"):
        JsonlTask("x", [], get_verifier("exact"))


def test_exact_verifier_normalises() -> None:
    check = get_verifier("exact")
    problem = Problem("q", "Paris")
    assert [check(problem, c) for c in ["paris", "  PARIS. ", "Paris\n", "Par is", "Paris!"]] == [
        1.0, 1.0, 1.0, 0.0, 0.0,
    ]  # fmt: skip
    assert normalise("Ａ  b.") == "a b"


def test_numeric_verifier_tolerance() -> None:
    default, loose = get_verifier("numeric"), get_verifier("numeric:0.5")
    problem = Problem("q", "1,234.5")
    assert default(problem, " 1234.5") == 1.0 and default(problem, "1234.5000001") == 1.0
    assert default(problem, "1234.6") == 0.0 and loose(problem, "1234.9") == 1.0
    assert loose(problem, "1235.1") == 0.0
    assert default(problem, "1234.5 or 7") == 0.0  # the whole completion must be the number
    assert default(problem, "nan") == 0.0 and parse_number("inf") is None
    assert parse_number("-.5e2") == -50.0


def test_python_verifier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_checks.py").write_text(
        "def starts(problem, completion):\n    return completion.startswith(problem.answer)\n"
        "def broken(problem, completion):\n    return 'yes'\n"
        "value = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check = get_verifier("my_checks:starts")
    assert check(Problem("q", "ab"), "abc") == 1.0 and check(Problem("q", "ab"), "b") == 0.0
    broken = get_verifier("my_checks:broken")  # guarded: a bad value scores 0 and is counted
    assert broken(Problem("q", "a"), "a") == 0.0 and broken.counts()["verifier_errors"] == 1
    with pytest.raises(ValueError, match="no callable 'value'"):
        get_verifier("my_checks:value")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_verifier("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="verifier='fuzzy' is unknown"):
        get_verifier("fuzzy")
    with pytest.raises(ValueError, match="tolerance is not a number"):
        get_verifier("numeric:abc")
    sys.modules.pop("my_checks", None)
