"""Rollout batches: token alignment with the engine's logprobs, staleness bound."""

import pytest
import torch

from birkhoff.engine.decode import Completion
from birkhoff.rl.rollout import Rollout, StaleRolloutError, build_rl_batch, check_staleness


def test_build_rl_batch_aligns_completion_tokens_and_logprobs() -> None:
    prompts = [[1, 5, 6], [1, 7]]
    completions = [
        Completion([8, 2], [-0.5, -0.1], 3, "stop"),
        Completion([9, 9, 2], [-1.0, -2.0, -0.3], 3, "stop"),
    ]
    ro = Rollout(prompts, completions, torch.zeros(1, 2), [], 0, 0.0)
    batch = build_rl_batch(ro, torch.tensor([[1.0, -1.0]]), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert batch.completion_mask.tolist() == [
        [False, False, False, True, True],
        [False, False, True, True, True],
    ]
    expected = torch.tensor([[0, 0, 0, -0.5, -0.1], [0, 0, -1.0, -2.0, -0.3]])
    assert torch.equal(batch.rollout_logp, expected)
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.weight_versions == [3, 3]


def test_staleness_bound() -> None:
    check_staleness([4, 5], trainer_version=6, max_staleness=2)
    with pytest.raises(StaleRolloutError, match="weight_version 4 are 3 updates behind"):
        check_staleness([4, 5], trainer_version=7, max_staleness=2)


class RecordingTask:
    """A task that stops at any digit and records the text each completion is scored on."""

    name = "recording"
    stop = tuple("0123456789")

    def __init__(self) -> None:
        self.scored: list[str] = []

    def sample(self, rng: object) -> object:
        raise NotImplementedError

    def reward(self, problem: object, completion: str) -> float:
        self.scored.append(completion)
        return 0.0

    def max_length(self) -> int:
        return 8


def test_rollout_stops_at_the_task_stop_strings_and_scores_the_text() -> None:
    from birkhoff.config import ModelConfig
    from birkhoff.engine import Engine
    from birkhoff.model import Transformer
    from birkhoff.rl.config import RLConfig
    from birkhoff.rl.rollout import rollout
    from birkhoff.tasks.problems import Problem
    from birkhoff.tokenizer import CharTokenizer

    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, num_layers=1, num_heads=2,
                      num_streams=1, mtp_depth=0, max_seq_len=32)  # fmt: skip
    engine = Engine.from_model(Transformer(cfg).eval(), max_batch_size=8)
    task = RecordingTask()
    rl = RLConfig(num_prompts=2, group_size=4, max_new_tokens=20, num_speculative_tokens=0)
    ro = rollout(engine, [Problem("1+2=", "3")] * 2, task, tok, rl, seed=0)  # type: ignore[arg-type]
    assert len(task.scored) == 8
    for text, c in zip(task.scored, ro.completions, strict=True):
        assert text == tok.decode(c.tokens) == c.text
        digits = [i for i, ch in enumerate(text) if ch.isdigit()]
        assert digits in ([], [len(text) - 1])  # nothing after the first digit
        assert (c.finish_reason == "stop") == bool(digits) or c.tokens[-1] in tok.stop_ids
    assert any(c.text and c.text[-1].isdigit() for c in ro.completions)


def test_rollout_counts_a_guarded_verifier_failures(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    from birkhoff.config import ModelConfig
    from birkhoff.engine import Engine
    from birkhoff.model import Transformer
    from birkhoff.rl.config import RLConfig
    from birkhoff.rl.reduce import rollout_metrics
    from birkhoff.rl.rollout import rollout
    from birkhoff.tasks.jsonl import JsonlTask
    from birkhoff.tasks.problems import Problem
    from birkhoff.tasks.verifiers import get_verifier
    from birkhoff.tokenizer import CharTokenizer

    (tmp_path / "odd_checks.py").write_text(
        "calls = 0\ndef odd(problem, completion):\n    global calls\n    calls += 1\n"
        "    if calls % 2:\n        raise ValueError('odd call')\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, num_layers=1, num_heads=2,
                      num_streams=1, mtp_depth=0, max_seq_len=32)  # fmt: skip
    engine = Engine.from_model(Transformer(cfg).eval(), max_batch_size=8)
    verifier = get_verifier("odd_checks:odd", max_failure_rate=0.6)
    task = JsonlTask("odd", [Problem("1+2=", "3")], verifier)
    rl = RLConfig(num_prompts=2, group_size=4, max_new_tokens=4, num_speculative_tokens=0)
    ro = rollout(engine, task.problems * 2, task, tok, rl, seed=0)
    assert dict(ro.verifier_counts) == {"verifier_calls": 8, "verifier_errors": 4,
                                        "verifier_timeouts": 0}  # fmt: skip
    assert sorted(ro.rewards_QW.flatten().tolist()) == [0.0] * 4 + [1.0] * 4
    metrics = rollout_metrics(ro, torch.device("cpu"))
    assert metrics["verifier_errors"] == 4.0 and metrics["verifier_calls"] == 8.0
    num_tokens = sum(len(c.tokens) for c in ro.completions)
    assert metrics["completion_tokens"] == num_tokens / 8
    assert metrics["rollout_tok_s"] == num_tokens / ro.seconds
    sys.modules.pop("odd_checks", None)
