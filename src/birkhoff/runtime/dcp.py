"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), atomic, and consolidation.

A sharded checkpoint is a directory: DCP's .metadata and __*_*.distcp (model and optimizer
state, each rank writing its shards), rng-<rank>.pt, config.json and meta.json (written last).
Atomic as checkpoint.py: every rank writes into a temp directory that rank 0 renames into place.
State comes from `get_state_dict` (names, not ranks), so a checkpoint loads on another world size
(RNG states only when it matches), and in a single process. `consolidate` writes the
single-directory checkpoint `load_checkpoint` reads. Design choices in detail: docs/training.md.
Left out: asynchronous saving, keeping the last-N checkpoints.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from birkhoff.config import ModelConfig
from birkhoff.model.transformer import Transformer
from birkhoff.runtime.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    capture_rng_state,
    commit_dir,
    parse_config,
    parse_json,
    read_manifest,
    read_verified,
    restore_rng_state,
    save_checkpoint,
    torch_bytes,
)

FORMAT = "birkhoff-dcp-1"
META_FILE, CONFIG_FILE = "meta.json", "config.json"


class ShardedCheckpoint(NamedTuple):
    config: ModelConfig
    step: int
    extra: dict[str, Any]
    world_size: int  # of the run that wrote it
    optimizer_fresh: bool = False  # saved before the optimizer's first step (no state)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    meta = Path(path) / META_FILE
    return meta.is_file() and json.loads(meta.read_bytes()).get("format") == FORMAT


def _temp_dir(path: Path) -> Path:
    """A fresh temp directory beside `path`, made by rank 0, its name shared with every rank."""
    rank, _ = _rank_world()
    names: list[Any] = [None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        names[0] = tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        Path(names[0]).chmod(0o755)
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    return Path(names[0])


def save_sharded(
    path_dir: str | os.PathLike[str],
    model: Transformer,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Every rank writes its shards; the checkpoint appears at `path_dir` whole or not at all."""
    if step < 0:
        raise ValueError(f"step={step} is invalid: must be >= 0")
    path, (rank, world) = Path(path_dir), _rank_world()
    # get_state_dict gives an optimizer without state one by an lr-0 step, which counts for
    # AdamW's bias correction: one that has not stepped yet is neither saved nor loaded
    fresh = optimizer is not None and not optimizer.state
    optimizer = None if fresh else optimizer
    meta = {
        "format": FORMAT,
        "step": step,
        "extra": dict(extra or {}),
        "world_size": world,
        "has_optimizer": optimizer is not None or fresh,
        "optimizer_fresh": fresh,
        "torch": torch.__version__,
    }
    try:
        meta_json = json.dumps(meta, indent=2, sort_keys=True).encode()
    except TypeError as err:
        raise ValueError(f"extra={extra!r} is not JSON-serialisable: {err}") from err
    tmp = _temp_dir(path)
    try:
        with _single_process_quiet():
            dcp.save(
                _state(model, optimizer), checkpoint_id=str(tmp), no_dist=not dist.is_initialized()
            )
        atomic_write_bytes(tmp / f"rng-{rank}.pt", torch_bytes(capture_rng_state()))
        _barrier()  # every rank's shards and RNG file are on disk
        if rank == 0:
            atomic_write_bytes(tmp / CONFIG_FILE, model.cfg.to_json().encode())
            atomic_write_bytes(tmp / META_FILE, meta_json)  # last: marks the directory complete
            commit_dir(tmp, path)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()  # nobody reads the checkpoint before it is in place
    return path


def _state(model: Transformer, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def read_sharded_meta(path: Path) -> ShardedCheckpoint:
    """Config and meta of a complete sharded checkpoint; CheckpointError naming the file."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{meta_file}: missing (incomplete or not a checkpoint)")
    meta = parse_json(meta_file, meta_file.read_bytes())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path / CONFIG_FILE}: missing")
    cfg = parse_config(path / CONFIG_FILE, (path / CONFIG_FILE).read_bytes())
    return ShardedCheckpoint(
        cfg,
        int(meta["step"]),
        dict(meta.get("extra", {})),
        int(meta["world_size"]),
        bool(meta.get("optimizer_fresh", False)),
    )


def checkpoint_extra(path: Path) -> dict[str, Any]:
    """The `extra` metadata of a checkpoint of either format (verified), without its weights."""
    if is_sharded_checkpoint(path):
        return read_sharded_meta(path).extra
    meta = read_verified(path, read_manifest(path), META_FILE)
    return dict(parse_json(path / META_FILE, meta).get("extra", {}))


def load_sharded(
    path_dir: str | os.PathLike[str],
    model: Transformer,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = False,
) -> ShardedCheckpoint:
    """Load into `model` (and `optimizer`), resharding to this run's ranks.

    `restore_rng=True` restores this rank's RNG states when the world size is the one that
    wrote the checkpoint (another world size has other ranks; their states are not restored).
    """
    path = Path(path_dir)
    ck = read_sharded_meta(path)
    if ck.config != model.cfg:
        raise CheckpointError(
            f"{path / CONFIG_FILE}: config {ck.config} != the model's {model.cfg}"
        )
    if ck.optimizer_fresh:  # nothing to restore: the optimizer stays as built (save_sharded)
        optimizer = None
    state = _state(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as err:  # DCP wraps reader errors of every rank in its own types
        raise CheckpointError(f"{path}: sharded state does not load ({err})") from err
    set_state_dict(
        model,
        optimizer or [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    rank, world = _rank_world()
    if restore_rng and world == ck.world_size:
        data = (path / f"rng-{rank}.pt").read_bytes()
        restore_rng_state(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    return ck


def consolidate(sharded_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the model of a sharded checkpoint as a single-directory safetensors checkpoint.

    Runs in one process (no process group needed); only the model's weights are gathered.
    """
    ck = read_sharded_meta(Path(sharded_dir))
    model = Transformer(ck.config)
    state = {"model": get_state_dict(model, [])[0]}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(sharded_dir), no_dist=True)
    except Exception as err:
        raise CheckpointError(f"{sharded_dir}: sharded state does not load ({err})") from err
    set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    extra = ck.extra | {"consolidated_from": str(sharded_dir), "world_size": ck.world_size}
    return save_checkpoint(out_dir, model, step=ck.step, extra=extra)
