"""Data parallel on 2 gloo CPU ranks: same numbers as one process, safe reclaim under FSDP2,
launch checks that stop every rank.

Legend: B rows, T tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks

from birkhoff.presets import tiny_cpu
from birkhoff.recompute import last_registry
from birkhoff.recompute.registry import storage_key
from birkhoff.rl.loop import grpo_loss_fn
from birkhoff.rl.rollout import RLBatch
from birkhoff.runtime import distributed
from birkhoff.runtime.distributed import rank_share, shard_model, take_rows
from birkhoff.tasks.batches import batch_for_step
from birkhoff.tasks.problems import get_task
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import train_step

PRESET = tiny_cpu()
CFG = PRESET.train.replace(lr=1e-3, warmup_steps=0)
NUM_PROMPTS, GROUP = 3, 2  # 3 GRPO groups over 2 ranks: 2 groups and 1 group


def fp64_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(PRESET.model, CFG, device=torch.device("cpu")).double()


def supervised_batch():  # 7 rows: 4 and 3 per rank, different token counts
    return batch_for_step(get_task("addition", num_digits=2), CharTokenizer(), batch_size=7,
                          seed=3, step=0)  # fmt: skip


def rl_batch() -> RLBatch:
    g = torch.Generator().manual_seed(1)
    B, T = NUM_PROMPTS * GROUP, 12
    ids_BT = torch.randint(3, PRESET.model.vocab_size, (B, T), generator=g)
    ends = torch.tensor([12, 9, 11, 7, 12, 10])
    mask_BT = (torch.arange(T)[None] >= 5) & (torch.arange(T)[None] < ends[:, None])
    logp_BT = -torch.rand(B, T, generator=g, dtype=torch.float64) * mask_BT
    adv_B = torch.randn(B, generator=g, dtype=torch.float64)
    return RLBatch(ids_BT, mask_BT, logp_BT, adv_B, [0] * B)


def two_updates(model, rank: int = 0, world: int = 1) -> list[float]:
    """A supervised step, then a GRPO step, on this rank's rows of the global batches."""
    opt = build_optimizer(model, CFG)
    sup, rl = supervised_batch(), rl_batch()
    groups = rank_share(NUM_PROMPTS, rank, world)
    sup = take_rows(sup, rank_share(len(sup.input_ids), rank, world))
    rl = take_rows(rl, range(groups.start * GROUP, groups.stop * GROUP))
    first = train_step(model, opt, sup, CFG, step=0)["loss"]
    loss_fn = grpo_loss_fn(PRESET.rl.replace(mtp_loss_weight=0.5))
    return [first, train_step(model, opt, rl, CFG, step=1, loss_fn=loss_fn)["loss"]]


def _update_worker(rank: int, out: Path) -> None:
    model = shard_model(fp64_model(), device_type="cpu")
    losses = two_updates(model, rank, 2)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)


def test_one_update_on_two_ranks_equals_one_process(tmp_path: Path) -> None:
    run_ranks(_update_worker, tmp_path / "ranks.pt")
    got = torch.load(tmp_path / "ranks.pt")
    model = fp64_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = two_updates(model)
    assert got["losses"] == pytest.approx(losses, rel=1e-12)
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]) or "alpha" in name
        torch.testing.assert_close(got["params"][name], param.detach(), rtol=1e-10, atol=1e-12)


def _reclaim_worker(rank: int, out: Path) -> None:
    """What safe reclaim released and what died after it, with and without FSDP2."""
    batch = take_rows(supervised_batch(), rank_share(7, rank, 2))
    runs = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = build_model(PRESET.model, CFG, device=torch.device("cpu"))
        owned: set[int | None] = set()  # every storage FSDP2 owns: shards and gathered params

        def note(*_: object, model=model, owned=owned) -> None:
            for p in model.parameters():
                owned.add(storage_key(p.to_local() if hasattr(p, "to_local") else p))

        if sharded:
            shard_model(model, device_type="cpu")
            for unit in [*model.blocks, *model.mtp_depths, model]:
                unit.register_forward_pre_hook(note)  # after FSDP2's: the gathered parameters
                unit.register_forward_hook(note)
                unit.register_full_backward_pre_hook(note)
        train_step(model, build_optimizer(model, CFG), batch, CFG, step=0)
        note()
        registry = last_registry()
        assert registry is not None
        released = {key: label for key, (_, label) in registry.released.items()}
        runs[sharded] = (sorted(released.values()), sorted(registry.freed.values()),
                         dict(registry.resized), sorted(set(released) & owned, key=str),
                         len(owned))  # fmt: skip
    torch.save(runs, out / f"reclaim-{rank}.pt")


def test_safe_reclaim_under_fsdp2_releases_what_it_did_and_no_fsdp_storage(tmp_path: Path) -> None:
    run_ranks(_reclaim_worker, tmp_path)
    for rank in (0, 1):
        runs = torch.load(tmp_path / f"reclaim-{rank}.pt")
        plain_released, plain_freed, _, _, _ = runs[False]
        released, freed, resized, fsdp_released, num_owned = runs[True]
        assert plain_freed, "safe reclaim freed nothing: the test would prove nothing"
        assert (released, freed) == (plain_released, plain_freed)  # the same inputs, by label
        assert num_owned > 0 and fsdp_released == [] and resized == {}


def _config_worker(rank: int, out: Path) -> None:
    for text in ("same", f"rank-{rank}"):
        try:
            distributed.check_same_config(text)
            verdict = "ok"
        except ValueError as err:
            verdict = str(err)
        (out / f"{text.split('-')[0]}-{rank}.txt").write_text(verdict)
    try:
        distributed.agree("cannot write here" if rank == 1 else None)
    except ValueError as err:
        (out / f"agree-{rank}.txt").write_text(str(err))


def test_ranks_that_disagree_all_stop_with_the_same_message(tmp_path: Path) -> None:
    run_ranks(_config_worker, tmp_path)
    for rank in (0, 1):
        assert (tmp_path / f"same-{rank}.txt").read_text() == "ok"
        assert "ranks disagree on the configuration" in (tmp_path / f"rank-{rank}.txt").read_text()
        assert (tmp_path / f"agree-{rank}.txt").read_text() == "rank 1: cannot write here"


def test_rank_share_covers_every_item_once() -> None:
    for n in (1, 5, 7, 16):
        for world in range(1, n + 1):
            shares = [rank_share(n, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--device", "cpu", "--backend", "nccl"], 2, "backend='nccl' needs --device cuda"),
        (["--device", "cpu"], 17, "17 processes but num_prompts=16"),
    ],
)
def test_bad_launches_fail_before_joining(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    argv: list[str], world: int, message: str,
) -> None:  # fmt: skip
    from birkhoff.cli import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main(["run", "--out", str(tmp_path / "r"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not torch.distributed.is_initialized()


def test_backend_flag_needs_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from birkhoff.cli import main

    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--out", str(tmp_path), "--backend", "gloo", "--device", "cpu"]) == 2
    assert "only for runs launched by torchrun" in capsys.readouterr().err


def test_single_process_has_no_process_group_and_plain_reductions() -> None:
    assert distributed.current() == distributed.DistContext()
    value = torch.tensor(2.5)
    assert distributed.global_sum(value) is value
    assert distributed.global_share(value, torch.tensor(3)) is value  # the plain loss, untouched
    assert distributed.reduce_floats({"a": 1.0}, "mean", torch.device("cpu")) == {"a": 1.0}
