"""The kernel choice of a V4 model (`config.resolve_kernels`): "auto" runs it on the eager ops
in the engine and the trainer alike (no fused V4 kernels yet), "triton" is refused naming the
flag, and a run on CUDA says so in one line. Llama-shaped models keep what they asked for."""

from __future__ import annotations

import pytest
import torch

from birkhoff.cli.common import UsageError, check_kernels
from birkhoff.config import kernels_note, resolve_kernels
from birkhoff.engine import Engine
from birkhoff.model.hyper import HyperConnection
from birkhoff.presets import get_preset
from birkhoff.train.recompute import build_model


@pytest.mark.parametrize("kernels", ["auto", "eager", "triton"])
def test_llama_models_keep_their_choice_and_v4_runs_eager(kernels: str) -> None:
    llama, v4 = get_preset("tiny-cpu").model, get_preset("tiny-cpu-v4").model
    assert resolve_kernels(llama, kernels) == kernels  # type: ignore[arg-type]
    if kernels == "triton":
        with pytest.raises(ValueError, match="kernels='triton' is invalid: V4 attention"):
            resolve_kernels(v4, kernels)
    else:
        assert resolve_kernels(v4, kernels) == "eager"  # type: ignore[arg-type]


def test_engine_and_trainer_resolve_auto_to_eager_for_v4() -> None:
    preset = get_preset("tiny-cpu-v4")
    engine = Engine(preset.model, kernels="auto", max_batch_size=1, max_seq_len=8)
    assert engine.kernels == "eager"
    with pytest.raises(ValueError, match="kernels='triton'"):
        Engine(preset.model, kernels="triton", max_batch_size=1, max_seq_len=8)
    model = build_model(
        preset.model, preset.train.replace(kernels="auto"), device=torch.device("cpu")
    )
    hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert hcs and all(hc.kernels == "eager" for hc in hcs)


def test_a_v4_run_on_cuda_prints_one_note_and_refuses_triton(
    capsys: pytest.CaptureFixture[str],
) -> None:
    preset = get_preset("tiny-cpu-v4")
    assert kernels_note(preset.model, "auto", "cpu") is None
    assert kernels_note(get_preset("tiny-cpu").model, "auto", "cuda") is None
    check_kernels(preset, "cuda")
    assert capsys.readouterr().out.strip() == kernels_note(preset.model, "auto", "cuda")
    check_kernels(preset, "cpu")
    assert capsys.readouterr().out == ""
    triton = preset.replace(train=preset.train.replace(kernels="triton"))
    with pytest.raises(UsageError, match=r"--set train\.kernels='triton' is invalid"):
        check_kernels(triton, "cuda")
