"""HuggingFace interop entry points: `import_hf` and `export_hf` (the command line is
`birkhoff import-hf` / `birkhoff export-hf` in birkhoff/cli/hf.py). A directory whose
config.json says `model_type: deepseek_v4` goes to the DeepSeek-V4 importer (v4_checkpoint.py);
every other one to the Llama-family importer (hf_import.py), and export follows the checkpoint's
config the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

from birkhoff.interop import hf_export, hf_import, v4_checkpoint
from birkhoff.runtime.checkpoint import CONFIG_FILE, parse_config, read_manifest, read_verified


def is_v4_dir(directory: Path) -> bool:
    """Whether `directory` holds a DeepSeek-V4 checkpoint (config.json's model_type)."""
    config = directory / "config.json"
    return config.is_file() and json.loads(config.read_bytes()).get("model_type") == "deepseek_v4"


def import_hf(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    num_streams: int | None = None,
    mtp_depth: int | None = None,
    max_seq_len: int | None = None,
) -> Path:
    """Write a birkhoff checkpoint at `out` from the HF checkpoint in `directory`.

    Llama family: `num_streams` S (default 1) and `mtp_depth` M (default 0) upcycle the dense
    model. DeepSeek-V4: S is the checkpoint's `hc_mult` (a different `num_streams` raises),
    `mtp_depth` keeps the first M of its MTP depths (default: all). `max_seq_len` defaults to
    the checkpoint's context.
    """
    src = Path(directory)
    if not is_v4_dir(src):
        streams, depth = 1 if num_streams is None else num_streams, mtp_depth or 0
        return hf_import.import_hf(
            src, out, num_streams=streams, mtp_depth=depth, max_seq_len=max_seq_len
        )
    hc_mult = json.loads((src / "config.json").read_bytes()).get("hc_mult", 4)
    if num_streams not in (None, hc_mult):
        raise ValueError(
            f"num_streams={num_streams} is invalid: a DeepSeek-V4 checkpoint has its own "
            f"hc_mult={hc_mult} streams"
        )
    return v4_checkpoint.import_v4(src, out, mtp_depth=mtp_depth, max_seq_len=max_seq_len)


def export_hf(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    drop_mtp: bool = False,
    layout: str = "transformers",
    fp8: bool = False,
) -> Path:
    """Write the checkpoint at `ckpt` as an HF directory at `out`: Llama family (S = 1;
    `drop_mtp` leaves MTP weights out), or DeepSeek-V4 for a V4 config (MTP depths kept,
    `layout` "transformers" | "deepseek" names, `fp8` block-fp8 matmul weights)."""
    path = Path(ckpt)
    manifest = read_manifest(path)
    cfg = parse_config(path / CONFIG_FILE, read_verified(path, manifest, CONFIG_FILE))
    if cfg.attention is None:
        if layout != "transformers" or fp8:
            raise ValueError(f"layout={layout!r} / fp8={fp8}: DeepSeek-V4 checkpoints only")
        return hf_export.export_hf(path, out, drop_mtp=drop_mtp)
    if drop_mtp:
        raise ValueError("drop_mtp=True is invalid: a DeepSeek-V4 export keeps its MTP depths")
    return v4_checkpoint.export_v4(path, out, fp8=fp8, layout=layout)


__all__ = ["export_hf", "import_hf", "is_v4_dir"]
