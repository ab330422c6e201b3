"""Sharded checkpoints (torch.distributed.checkpoint): atomic save, exact resume on 2 ranks,
resume in one process (another world size), consolidation to the safetensors format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks

import birkhoff.runtime.dcp as dcp_module
from birkhoff.cli import main
from birkhoff.presets import tiny_cpu
from birkhoff.runtime.checkpoint import CheckpointError, load_checkpoint
from birkhoff.runtime.dcp import consolidate, load_sharded, read_sharded_meta, save_sharded
from birkhoff.runtime.distributed import rank_share, shard_model, take_rows
from birkhoff.tasks.batches import batch_for_step
from birkhoff.tasks.problems import get_task
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import train_step

PRESET = tiny_cpu()
CFG = PRESET.train.replace(lr=1e-3, warmup_steps=0)


def fresh(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(PRESET.model, CFG, device=torch.device("cpu")).double()
    if sharded:
        shard_model(model, device_type="cpu")
    return model, build_optimizer(model, CFG)


def step(model, opt, n: int, rank: int = 0, world: int = 1) -> float:
    batch = batch_for_step(get_task("addition", num_digits=1), CharTokenizer(), batch_size=6,
                           seed=0, step=n)  # fmt: skip
    return train_step(model, opt, take_rows(batch, rank_share(6, rank, world)), CFG, step=n)["loss"]


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def _save_resume_worker(rank: int, out: Path) -> None:
    model, opt = fresh(sharded=True)
    step(model, opt, 0, rank, 2)
    save_sharded(out / "ck", model, opt, step=1, extra={"note": "x"})
    continued = step(model, opt, 1, rank, 2)
    after = full_params(model)
    model, opt = fresh(sharded=True)
    ck = load_sharded(out / "ck", model, opt, restore_rng=True)
    resumed = step(model, opt, 1, rank, 2)
    resumed_params = full_params(model)  # a collective: every rank gathers
    if rank == 0:
        torch.save({"continued": continued, "resumed": resumed, "after": after,
                    "resumed_params": resumed_params, "step": ck.step}, out / "r.pt")  # fmt: skip


def test_sharded_save_resume_on_two_ranks_and_on_one(tmp_path: Path) -> None:
    run_ranks(_save_resume_worker, tmp_path)
    got = torch.load(tmp_path / "r.pt")
    assert got["step"] == 1 and got["resumed"] == got["continued"]  # exact on the same ranks
    for name, value in got["after"].items():
        assert torch.equal(got["resumed_params"][name], value), name
    assert read_sharded_meta(tmp_path / "ck").world_size == 2
    # another world size: one process, no process group; DCP reshards model and optimizer
    model, opt = fresh(sharded=False)
    load_sharded(tmp_path / "ck", model, opt)
    assert step(model, opt, 1) == pytest.approx(got["continued"], rel=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), got["after"][name], rtol=1e-10, atol=1e-12)
    # consolidation: the single-directory format that `birkhoff generate` loads
    consolidate(tmp_path / "ck", tmp_path / "single")
    loaded = load_checkpoint(tmp_path / "single")
    model, _ = fresh(sharded=False)
    load_sharded(tmp_path / "ck", model)
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name].float()), name  # fp32 trainer weights
    assert loaded.step == 1 and loaded.extra["note"] == "x"


def test_a_crash_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = fresh(sharded=False)
    save_sharded(tmp_path / "ck", model, opt, step=1)
    step(model, opt, 1)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dcp_module, "torch_bytes", crash)  # after DCP wrote the shards
    with pytest.raises(OSError, match="disk full"):
        save_sharded(tmp_path / "ck", model, opt, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp directory left
    again, opt = fresh(sharded=False)
    assert load_sharded(tmp_path / "ck", again, opt).step == 1


def test_incomplete_or_foreign_directories_are_refused(tmp_path: Path) -> None:
    model, opt = fresh(sharded=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_sharded(tmp_path / "nothing", model)
    save_sharded(tmp_path / "ck", model, opt, step=1)
    (tmp_path / "ck" / "meta.json").unlink()  # as if the save stopped before its last file
    with pytest.raises(CheckpointError, match="meta.json: missing"):
        load_sharded(tmp_path / "ck", model)
    other = build_model(PRESET.model.replace(num_layers=1), CFG, device=torch.device("cpu"))
    save_sharded(tmp_path / "ck2", model, None, step=1)
    with pytest.raises(CheckpointError, match="config"):
        load_sharded(tmp_path / "ck2", other)


def test_generate_refuses_a_sharded_checkpoint_and_consolidate_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = fresh(sharded=False)
    save_sharded(tmp_path / "ck", model.float(), None, step=3)
    args = ["--prompt", "1+2=", "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), *args]) == 2
    assert "birkhoff consolidate" in capsys.readouterr().err
    assert main(["consolidate", "--checkpoint", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "one")]) == 0  # fmt: skip
    assert main(["generate", "--checkpoint", str(tmp_path / "one"), *args]) == 0
    assert capsys.readouterr().out.count("1+2=") == 1
