"""The engine serves imported Llama/Mistral/Qwen2/Qwen3 models exactly as the trainer computes them.

fp32 engine greedy tokens equal the trainer's (full recompute every step) and transformers'
argmax along them, for every family option: q/k/v and o biases, q/k norm, GQA, a head dim other
than D/H, tied embeddings and the rope-scaling variants. The upcycled S = 2, M = 1 model decodes
the same tokens with and without MTP drafts. Refit carries the new tensors (fp8 quantizes neither
biases nor norms) and an fp32 refit after a change serves the changed model exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import CASES, build_hf_model, save_hf_model

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.fp8 import FP8_DTYPE
from birkhoff.interop.hf import import_hf
from birkhoff.model import Transformer
from birkhoff.refit import refit
from birkhoff.runtime.checkpoint import load_checkpoint

PROMPTS = [[5, 17, 3], [60, 2, 9, 41, 88, 7, 12], [33]]
NEW_TOKENS = 24  # reaches position 31: past the llama3 case's original context of 16


def trainer_greedy(model: Transformer, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def hf_agrees(hf_model: object, prompt: list[int], tokens: list[int]) -> bool:
    """transformers' argmax along the sequence equals `tokens` wherever its top two logits are
    more than 1e-3 apart (the two forwards agree to ~1e-5; closer calls are ties)."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt + tokens])).logits  # type: ignore[operator]
    top2 = logits[0, len(prompt) - 1 : -1].topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
    return bool(((top2.indices[:, 0] == torch.tensor(tokens)) | ~clear).all())


def imported(case: str, tmp_path: Path, **kwargs: int) -> tuple[object, Transformer]:
    hf_model = build_hf_model(case)
    save_hf_model(hf_model, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt", **kwargs)
    return hf_model, load_checkpoint(tmp_path / "ckpt").model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_engine_greedy_equals_trainer_and_transformers(case: str, tmp_path: Path) -> None:
    hf_model, model = imported(case, tmp_path)
    engine = Engine.from_model(model, max_batch_size=4)
    completions = engine.generate(PROMPTS, SamplingParams(NEW_TOKENS))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        expected = trainer_greedy(model, prompt, NEW_TOKENS)
        assert completion.tokens == expected
        assert hf_agrees(hf_model, prompt, expected)


@pytest.mark.parametrize("case", ["qwen2-bias", "qwen3-qknorm", "llama-yarn"])
def test_upcycled_engine_speculative_equals_plain(case: str, tmp_path: Path) -> None:
    _, model = imported(case, tmp_path, num_streams=2, mtp_depth=1)
    engine = Engine.from_model(model, max_batch_size=4)
    plain = engine.generate(PROMPTS, SamplingParams(12))
    spec = engine.generate(PROMPTS, SamplingParams(12, num_speculative_tokens=2))
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert [c.tokens for c in plain] == [trainer_greedy(model, p, 12) for p in PROMPTS]
    assert engine.last_stats is not None and engine.last_stats.num_steps > 0


def served_attention_extras(engine: Engine) -> dict[str, torch.Tensor]:
    keys = ("wqkv.bias", "wo.bias", "q_norm.weight", "k_norm.weight")
    return {n: t for n, t in engine.weights.items() if n.endswith(keys)}


@pytest.mark.parametrize(("case", "num_extras"), [("llama-linear-bias", 2), ("qwen3-qknorm", 2)])
def test_refit_carries_biases_and_norms_unquantized(
    case: str, num_extras: int, tmp_path: Path
) -> None:
    _, model = imported(case, tmp_path, num_streams=2, mtp_depth=1)
    fp8 = Engine.from_model(model, quantize="fp8", max_batch_size=4)
    fp32 = Engine.from_model(model, max_batch_size=4)
    extras = served_attention_extras(fp8)
    assert len(extras) == num_extras * (model.cfg.num_layers + model.cfg.mtp_depth)
    assert all(t.dtype == torch.float32 for t in extras.values())
    assert any(t.dtype == FP8_DTYPE for t in fp8.weights.values())  # matmul weights are fp8
    with torch.no_grad():  # a change only in the extra tensors
        for name, param in model.named_parameters():
            if name.endswith(("wq.bias", "wk.bias", "wo.bias", "q_norm.weight", "k_norm.weight")):
                param.add_(0.5 * torch.randn_like(param))
    refit(model, fp8, bucket_bytes=4096, quantize="fp8")
    refit(model, fp32, bucket_bytes=4096)
    direct = Engine.from_model(model, max_batch_size=4)
    for name, tensor in served_attention_extras(direct).items():
        assert torch.equal(fp8.weights[name], tensor) and torch.equal(fp32.weights[name], tensor)
    completions = fp32.generate(PROMPTS, SamplingParams(10))
    assert [c.tokens for c in completions] == [trainer_greedy(model, p, 10) for p in PROMPTS]
    assert fp32.weight_version == 1 and fp8.weight_version == 1
