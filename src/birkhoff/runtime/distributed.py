"""Data-parallel training on N processes: torchrun launch, FSDP2 sharding, global reductions.

One process per device, launched by `torchrun`; a process started without it runs the plain
single-process path. Everything is `torch.distributed` and FSDP2 (`fully_shard`,
`MixedPrecisionPolicy`), with no launcher or collective layer of our own. Launch checks fail on
every rank with the same message (`agree`), never as a hang; `shard_model` makes every block,
MTP depth, MTP head and the root FSDP units (recompute is applied before); `global_share` makes
one update on N ranks equal the single-process update; a GRPO group stays on one rank
(`rank_share`). Design choices in detail: docs/training.md.
Left out: tensor/pipeline parallelism, meta-device initialisation (each rank builds the full
model once, then shards it), HSDP.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from birkhoff.model.transformer import Transformer

BACKENDS = ("auto", "nccl", "gloo")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistContext:
    """Where this process stands: rank, world size, its device, the collective backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (single process)

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher setting WORLD_SIZE) started this process."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def resolve_backend(device_type: str, backend: str) -> str:
    """The collective backend for `device_type`: NCCL on CUDA, gloo on CPU (ValueError else)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: expected one of {BACKENDS}")
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"backend='nccl' needs --device cuda; the run is on {device_type}")
    return backend


def check_world_size(world_size: int, num_items: int, what: str) -> None:
    """Every rank needs at least one of the `num_items` units a step is split into."""
    if world_size > num_items:
        raise ValueError(
            f"{world_size} processes but {what}={num_items}: every rank needs at least one; "
            f"launch at most {num_items} processes or raise {what}"
        )


def init_distributed(device_type: str, backend: str = "auto") -> DistContext:
    """Join torchrun's process group (one process per device); ValueError on a bad launch."""
    name = resolve_backend(device_type, backend)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this node has "
                f"{torch.cuda.device_count()} CUDA devices"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": device} if name == "nccl" else {}
        dist.init_process_group(name, rank=rank, world_size=world, **kwargs)
    return DistContext(
        rank=rank, world_size=world, local_rank=local_rank, device=device, backend=name
    )


def current() -> DistContext:
    """The context of an initialised process group, or the single-process default."""
    if not dist.is_initialized():
        return DistContext()
    rank = dist.get_rank()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return DistContext(
        rank=rank,
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=str(dist.get_backend()),
    )


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(error: str | None) -> None:
    """All-gather each rank's error (or None); if any rank has one, raise it on every rank."""
    if not dist.is_initialized():
        if error is not None:
            raise ValueError(error)
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if found:
        rank, message = found[0]
        raise ValueError(f"rank {rank}: {message}")


def check_same_config(text: str) -> None:
    """Every rank must run the same configuration (e.g. repr of the preset): ValueError if not."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    digests: list[Any] = [None] * world_size()
    if dist.is_initialized():
        dist.all_gather_object(digests, digest)
    else:
        digests = [digest]
    if len(set(digests)) > 1:
        raise ValueError(
            f"ranks disagree on the configuration (hash per rank: {digests}); launch every "
            "rank with the same preset and overrides"
        )


def rank_share(num_items: int, rank: int, num_ranks: int) -> range:
    """The contiguous share of `num_items` that `rank` takes (sizes differ by at most one)."""
    base, extra = divmod(num_items, num_ranks)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def take(items: Sequence[T], ctx: DistContext | None = None) -> list[T]:
    """This rank's contiguous share of `items` (all of them in one process)."""
    ctx = ctx or current()
    share = rank_share(len(items), ctx.rank, ctx.world_size)
    return list(items[share.start : share.stop])


def take_rows(batch: T, rows: range) -> T:
    """A batch NamedTuple restricted to `rows`: tensors sliced on dim 0, lists sliced alike."""
    fields = [f[rows.start : rows.stop] if isinstance(f, Tensor | list) else f for f in batch]  # type: ignore[attr-defined]
    return type(batch)(*fields)


def global_sum(value: Tensor) -> Tensor:
    """Sum of `value` over ranks (a copy; `value` itself in one process)."""
    if world_size() == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out)
    return out


def global_share(mean: Tensor, count: Tensor) -> Tensor:
    """This rank's share of a global token mean: a local `mean` over `count` tokens, times
    count / global count. Summed over ranks it is the mean over every rank's tokens."""
    if world_size() == 1:
        return mean
    count = count.to(mean.dtype)
    return mean * count / global_sum(count).clamp(min=1.0)


def reduce_floats(values: dict[str, float], op: str, device: torch.device) -> dict[str, float]:
    """Sum, mean or max of every value over ranks (the values themselves in one process)."""
    if world_size() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "mean":
        t /= world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def mixed_precision(device_type: str, amp_dtype: str) -> Any:
    """bf16 parameters with fp32 gradient reduction for a bf16 run on CUDA; else fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type == "cuda" and amp_dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: Transformer, *, device_type: str, amp_dtype: str = "none") -> Transformer:
    """`fully_shard` every block, every MTP depth (its head a unit of its own), then the root.

    `amp_dtype` is the run's `TrainConfig.amp_dtype`: "bf16" on CUDA gathers bf16 parameters.
    """
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(device_type, amp_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    for depth in model.mtp_depths:
        head: list[nn.Module] = [depth.contraction, depth.norm]
        fully_shard(head, mp_policy=policy)
        fully_shard(depth, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
