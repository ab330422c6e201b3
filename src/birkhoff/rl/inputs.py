"""What a run reads before it starts: a checkpoint to start from and a JSONL task.

`run_inputs` turns a preset and `birkhoff run`'s file flags (parsed in birkhoff.cli.run) into
the preset to run and the keyword arguments of `GRPORun` (init, tokenizer, task, eval_problems
for `--init CKPT --data FILE.jsonl ...`). Every file is read and checked here, before any
training or output: the checkpoint's manifest and config (its weights load, verified, in
GRPORun), its tokenizer against the model's vocabulary, every JSONL line against the verifier,
the tokenizer and max_seq_len. Errors are ValueErrors naming the flag,
file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used
    from birkhoff.presets import Preset
    from birkhoff.tokenizer import Tokenizer


def run_inputs(
    preset: Preset, *, init: Path | None = None, data: Path | None = None,
    verifier: str | None = None, eval_data: Path | None = None, max_new_tokens: int | None = None,
) -> tuple[Preset, dict[str, Any]]:  # fmt: skip
    """The preset and GRPORun's keyword arguments for a start checkpoint and a JSONL task."""
    if data is None and (verifier is not None or eval_data is not None):
        raise ValueError("--verifier and --eval-data need --data FILE.jsonl")
    kwargs: dict[str, Any] = {}
    if init is not None:
        preset, kwargs = init_inputs(Path(init), preset)
    if data is not None:
        preset, task = data_inputs(preset, Path(data), verifier=verifier, eval_data=eval_data,
                                   max_new_tokens=max_new_tokens,
                                   tokenizer=kwargs.get("tokenizer"))  # fmt: skip
        kwargs.update(task)
    return preset, kwargs


def init_inputs(init: Path, preset: Preset) -> tuple[Preset, dict[str, Any]]:
    """--init CKPT: the checkpoint's model config and tokenizer (weights load in GRPORun)."""
    from birkhoff.interop.tokenizer import checkpoint_tokenizer
    from birkhoff.runtime.checkpoint import CONFIG_FILE, parse_config, read_manifest, read_verified

    cfg = parse_config(init / CONFIG_FILE, read_verified(init, read_manifest(init), CONFIG_FILE))
    tokenizer = checkpoint_tokenizer(init)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"--init {init}: tokenizer has {tokenizer.vocab_size} ids, "
                         f"the model's vocab_size is {cfg.vocab_size}")  # fmt: skip
    assert preset.rl is not None
    drafts = preset.rl.num_speculative_tokens if cfg.mtp_depth else 0  # no MTP, no drafts
    preset = preset.replace(model=cfg, rl=preset.rl.replace(num_speculative_tokens=drafts))
    return preset, {"init": init, "tokenizer": tokenizer}


def data_inputs(
    preset: Preset, data: Path, *, verifier: str | None, eval_data: Path | None,
    max_new_tokens: int | None, tokenizer: Tokenizer | None,
) -> tuple[Preset, dict[str, Any]]:  # fmt: skip
    """--data FILE.jsonl: train and held-out splits; without --max-new-tokens, room for the
    longest answer and its EOS."""
    from birkhoff.tasks.jsonl import load_jsonl_tasks
    from birkhoff.tokenizer import CharTokenizer

    tok = tokenizer or CharTokenizer()
    splits = load_jsonl_tasks(data, verifier=verifier or "exact", eval_path=eval_data,
                              seed=preset.train.seed, tokenizer=tok,
                              max_seq_len=preset.model.max_seq_len)  # fmt: skip
    assert preset.rl is not None
    if max_new_tokens is None:
        longest = max(len(tok.encode(p.answer)) for p in splits.train.problems)
        rl = preset.rl.replace(max_new_tokens=max(preset.rl.max_new_tokens, longest + 1))
        preset = preset.replace(rl=rl)
    return preset, {"task": splits.train, "eval_problems": splits.eval.problems}
