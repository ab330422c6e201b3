"""Atomic, verified checkpoints: safetensors weights + config JSON + optimizer + RNG + manifest.

A checkpoint is a directory: model.safetensors (trainer-layout weights, each shared tensor once,
see `aliases`), config.json, optimizer.pt, rng.pt, meta.json and manifest.json (sha256 and size
of every file, written last). Files are written atomically into a fresh temp directory that is
renamed into place, so a reader sees no checkpoint or a complete one; `load_checkpoint` verifies
every file before parsing any and raises `CheckpointError` naming it. The round trip is
bit-identical. Design choices in detail: docs/training.md.
Left out: sharded/distributed checkpoints (dcp.py), async saving, keeping the last-N
checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.model.transformer import Transformer

FORMAT_VERSION = 1
MODEL_FILE, CONFIG_FILE, OPTIMIZER_FILE = "model.safetensors", "config.json", "optimizer.pt"
RNG_FILE, META_FILE, MANIFEST_FILE = "rng.pt", "meta.json", "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


class LoadedCheckpoint(NamedTuple):
    model: Transformer
    config: ModelConfig
    step: int
    extra: dict[str, Any]


# ---------------------------------------------------------------------------- file primitives


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def commit_dir(tmp: Path, path: Path) -> None:
    """Rename the finished temp directory to `path`, moving an existing checkpoint aside first."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)


def torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------------- state capture


def split_aliases(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(unique tensors, alias name -> stored name): each shared tensor is kept once."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if key in first and tensor.numel() > 0:
            aliases[name] = first[key]
            continue
        first[key] = name
        unique[name] = tensor.detach().cpu().contiguous()
    return unique, aliases


def capture_rng_state() -> dict[str, Any]:
    """Raw states of the python, torch CPU and (when present) torch CUDA generators."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_files(
    model: Transformer, optimizer: torch.optim.Optimizer | None, step: int, extra: dict[str, Any]
) -> dict[str, bytes]:
    tensors, aliases = split_aliases(model.state_dict())
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "extra": extra,
        "aliases": aliases,
        "torch": torch.__version__,
        "has_optimizer": optimizer is not None,
    }
    try:
        meta_json = json.dumps(meta, indent=2, sort_keys=True)
    except TypeError as err:
        raise ValueError(f"extra={extra!r} is not JSON-serialisable: {err}") from err
    files = {
        MODEL_FILE: save_safetensors(tensors),
        CONFIG_FILE: model.cfg.to_json().encode(),
        RNG_FILE: torch_bytes(capture_rng_state()),
        META_FILE: meta_json.encode(),
    }
    if optimizer is not None:
        files[OPTIMIZER_FILE] = torch_bytes(optimizer.state_dict())
    return files


def save_checkpoint(
    path_dir: str | os.PathLike[str],
    model: Transformer,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint to `path_dir` atomically (replacing one that is there)."""
    if step < 0:
        raise ValueError(f"step={step} is invalid: must be >= 0")
    path = Path(path_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(model, optimizer, step, dict(extra or {}))
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes 0700; a checkpoint is meant to be shared
        manifest: dict[str, Any] = {"format": FORMAT_VERSION, "files": {}}
        for name, data in files.items():
            atomic_write_bytes(tmp / name, data)
            manifest["files"][name] = {
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        atomic_write_bytes(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2).encode())
        commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ---------------------------------------------------------------------------- loading


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing (incomplete or not a checkpoint)")
    try:
        files = json.loads(manifest_path.read_bytes())["files"]
        assert isinstance(files, dict)
        return files
    except (ValueError, KeyError, TypeError, AssertionError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err!r})") from err


def read_verified(path: Path, manifest: dict[str, dict[str, Any]], name: str) -> bytes:
    """The bytes of file `name`, after checking presence, size and sha256 against the manifest."""
    file = path / name
    if name not in manifest:
        raise CheckpointError(f"{file}: not listed in {MANIFEST_FILE}")
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    data = file.read_bytes()
    expected = manifest[name]
    if len(data) != expected.get("bytes"):
        raise CheckpointError(
            f"{file}: truncated or padded: {len(data)} bytes, expected {expected.get('bytes')}"
        )
    if hashlib.sha256(data).hexdigest() != expected.get("sha256"):
        raise CheckpointError(f"{file}: corrupted (sha256 does not match {MANIFEST_FILE})")
    return data


def parse_json(file: Path, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as err:
        raise CheckpointError(f"{file}: invalid JSON ({err})") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


# Checkpoints written while the recompute policy was part of ModelConfig carry these keys. They say
# how a run trained (TrainConfig.recompute / .reclaim now), not what the model is, so they are
# dropped on load and such a checkpoint loads as the same model.
TRAINING_ONLY_KEYS = ("recompute", "reclaim")


def parse_config(file: Path, data: bytes) -> ModelConfig:
    fields = parse_json(file, data)
    for key in TRAINING_ONLY_KEYS:
        fields.pop(key, None)
    try:
        return ModelConfig.from_dict(fields)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{file}: invalid model config ({err})") from err


def load_weights(model: Transformer, file: Path, data: bytes, aliases: dict[str, str]) -> None:
    try:
        state = load_safetensors(data)
        state.update({alias: state[target] for alias, target in aliases.items()})
        model.load_state_dict(state, strict=True)
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(f"{file}: weights do not fit the model ({err})") from err


def load_torch(file: Path, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle raises many types; all mean "not a valid state"
        raise CheckpointError(f"{file}: unreadable ({err})") from err


def load_checkpoint(
    path_dir: str | os.PathLike[str],
    *,
    model: Transformer | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = False,
) -> LoadedCheckpoint:
    """Verify and load a checkpoint into `model` (built from config.json when None).

    `optimizer`, when given, gets its state restored (the checkpoint must have one);
    `restore_rng=True` also restores the global RNG states.
    """
    path = Path(path_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    manifest = read_manifest(path)
    cfg = parse_config(path / CONFIG_FILE, read_verified(path, manifest, CONFIG_FILE))
    meta = parse_json(path / META_FILE, read_verified(path, manifest, META_FILE))
    if model is None:
        model = Transformer(cfg)
    elif model.cfg != cfg:
        raise CheckpointError(f"{path / CONFIG_FILE}: config {cfg} != the model's {model.cfg}")
    weights = read_verified(path, manifest, MODEL_FILE)
    load_weights(model, path / MODEL_FILE, weights, dict(meta.get("aliases", {})))
    if optimizer is not None:
        if OPTIMIZER_FILE not in manifest:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: missing (saved without optimizer)")
        data = read_verified(path, manifest, OPTIMIZER_FILE)
        try:
            optimizer.load_state_dict(load_torch(path / OPTIMIZER_FILE, data))
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: does not fit ({err})") from err
    rng_state = load_torch(path / RNG_FILE, read_verified(path, manifest, RNG_FILE))
    if restore_rng:
        restore_rng_state(rng_state)
    return LoadedCheckpoint(model, cfg, int(meta["step"]), dict(meta.get("extra", {})))
