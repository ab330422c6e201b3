"""Export an S=1 birkhoff checkpoint to the HuggingFace Llama-family layout.

Design choices:
- The checkpoint is verified first (size and sha256 of every file against its manifest, the
  model file hashed in chunks), then its tensors are streamed one at a time from the
  memory-mapped model file into a single HF `model.safetensors` under HF names, in their stored
  dtype. An imported checkpoint therefore exports bit-identical tensors.
- config.json: an imported checkpoint carries the original HF config (`hf_config.json`); it is
  written back byte for byte after checking that it still describes the checkpoint's model
  (same ModelConfig up to streams, MTP depth and max_seq_len). Other checkpoints get a config
  from `hf_config_from_model`. Tokenizer files in the checkpoint are copied out unchanged.
- S > 1 has no HF equivalent and raises naming `num_streams`; MTP weights are refused unless
  `drop_mtp=True` (HF Llama models have no MTP heads).
- The output directory is written like a checkpoint: into a temp dir that is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open

from birkhoff.config import ModelConfig
from birkhoff.interop.hf_config import hf_config_from_model, model_config_from_hf
from birkhoff.interop.hf_import import HF_CONFIG_FILE, TOKENIZER_FILES, hf_name
from birkhoff.interop.streaming import SINGLE_FILE, StreamingWriter, TensorSpec, dtype_of_name
from birkhoff.runtime.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    CheckpointError,
    commit_dir,
    parse_config,
    read_manifest,
    read_verified,
)

CHUNK_BYTES = 1 << 24


def verify_streaming(path: Path, manifest: dict[str, dict[str, Any]], name: str) -> Path:
    """Check size and sha256 of a (large) checkpoint file, reading it in chunks."""
    file = path / name
    if name not in manifest or not file.is_file():
        raise CheckpointError(f"{file}: missing or not listed in the manifest")
    digest, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    if size != manifest[name].get("bytes") or digest.hexdigest() != manifest[name].get("sha256"):
        raise CheckpointError(f"{file}: truncated or corrupted (size/sha256 differ from manifest)")
    return file


def export_config(cfg: ModelConfig, original: bytes | None) -> bytes:
    """config.json bytes: the imported original when it still describes `cfg`, else generated."""
    if original is None:
        return (json.dumps(hf_config_from_model(cfg), indent=2, sort_keys=True) + "\n").encode()
    imported = model_config_from_hf(
        json.loads(original), mtp_depth=cfg.mtp_depth, max_seq_len=cfg.max_seq_len
    )
    if imported != cfg:
        raise ValueError(f"{HF_CONFIG_FILE} no longer describes the checkpoint's config {cfg}")
    return original


def export_plan(names: list[str], specs: dict[str, TensorSpec], *, drop_mtp: bool) -> list[Any]:
    """[(HF name, birkhoff name, spec)] for every stored tensor; MTP ones refused or dropped."""
    mtp = [n for n in names if n.startswith("mtp.")]
    if mtp and not drop_mtp:
        raise ValueError(
            f"mtp_depth > 0: MTP weights {mtp[:3]}... have no HF equivalent; "
            "pass drop_mtp=True to leave them out"
        )
    plan = []
    for name in names:
        if name.startswith("mtp."):
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{name}: no HuggingFace equivalent")
        plan.append((target, name, specs[name]))
    return sorted(plan)


def export_hf(
    ckpt: str | os.PathLike[str], out: str | os.PathLike[str], *, drop_mtp: bool = False
) -> Path:
    """Write the S=1 checkpoint at `ckpt` as an HF model directory at `out`."""
    path = Path(ckpt)
    manifest = read_manifest(path)
    cfg = parse_config(path / CONFIG_FILE, read_verified(path, manifest, CONFIG_FILE))
    if cfg.num_streams != 1:
        raise ValueError(f"num_streams={cfg.num_streams} is invalid: export needs S=1")
    original = read_verified(path, manifest, HF_CONFIG_FILE) if HF_CONFIG_FILE in manifest else None
    files = {CONFIG_FILE: export_config(cfg, original)}
    files |= {n: read_verified(path, manifest, n) for n in TOKENIZER_FILES if n in manifest}
    model_file = verify_streaming(path, manifest, MODEL_FILE)
    with safe_open(str(model_file), framework="pt") as handle:
        names = list(handle.keys())  # noqa: SIM118
        specs = {}
        for n in names:
            sl = handle.get_slice(n)
            specs[n] = TensorSpec(tuple(sl.get_shape()), dtype_of_name(sl.get_dtype()))
        plan = export_plan(names, specs, drop_mtp=drop_mtp)
        return write_hf_dir(Path(out), files, plan, handle)


def write_hf_dir(out: Path, files: dict[str, bytes], plan: list[Any], handle: Any) -> Path:
    """Stream the planned tensors into out/model.safetensors, add `files`, commit atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        writer = StreamingWriter(
            tmp / SINGLE_FILE, [(hf, spec) for hf, _, spec in plan], {"format": "pt"}
        )
        for hf, name, _ in plan:
            writer.write(hf, handle.get_tensor(name))
        writer.close()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
