"""What a run reads before it starts: a checkpoint to start from and a JSONL or generated task.

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
    from birkhoff.config import ModelConfig
    from birkhoff.presets import Preset
    from birkhoff.tokenizer import Tokenizer


def run_inputs(
    preset: Preset,
    *,
    init: Path | None = None,
    data: Path | None = None,
    verifier: str | None = None,
    eval_data: Path | None = None,
    max_new_tokens: int | None = None,
    task: str | None = None,
    task_options: dict[str, Any] | None = None,
    out: Path | None = None,
) -> tuple[Preset, dict[str, Any]]:
    """The preset and GRPORun's keyword arguments for a start checkpoint and a JSONL task or a
    generated task (`task`, a name of birkhoff.tasks.problems.TASKS). Without `init`, the
    preset's own `init` is the start (imported into `out`/init when it is not a checkpoint)."""
    from birkhoff.tasks.problems import FREE_TEXT_TASKS

    if data is None and (verifier is not None or eval_data is not None):
        raise ValueError("--verifier and --eval-data need --data FILE.jsonl")
    if data is not None and task is not None:
        raise ValueError("--task and --data are exclusive: one task per run")
    kwargs: dict[str, Any] = {}
    if init is None and preset.init is not None:
        init = preset_init(preset, out)
    if init is not None:
        if not Path(init).exists():
            raise ValueError(f"--init {init}: no such checkpoint directory")
        chat = task in FREE_TEXT_TASKS or preset.task_options.get("style") == "chat"
        preset, kwargs = init_inputs(Path(init), preset, chat=chat)
    if task is not None:
        preset = task_inputs(
            preset,
            task,
            tokenizer=kwargs.get("tokenizer"),
            fresh_model=init is None,
            max_new_tokens=max_new_tokens,
            options=task_options or {},
        )
    if data is not None:
        preset, splits = data_inputs(
            preset,
            Path(data),
            verifier=verifier,
            eval_data=eval_data,
            max_new_tokens=max_new_tokens,
            tokenizer=kwargs.get("tokenizer"),
        )
        kwargs.update(splits)
    return preset, kwargs


def init_inputs(init: Path, preset: Preset, *, chat: bool = False) -> tuple[Preset, dict[str, Any]]:
    """--init CKPT: the checkpoint's model config and tokenizer (weights load in GRPORun);
    `chat`: prompts through the tokenizer's chat template when it has one."""
    from birkhoff.interop.tokenizer import checkpoint_tokenizer

    cfg = checkpoint_config(init)
    tokenizer = checkpoint_tokenizer(init)
    if chat and getattr(tokenizer, "chat_template", None) is not None:
        tokenizer = checkpoint_tokenizer(init, chat=True)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"--init {init}: tokenizer has {tokenizer.vocab_size} ids, "
            f"the model's vocab_size is {cfg.vocab_size}"
        )
    assert preset.rl is not None
    drafts = preset.rl.num_speculative_tokens if cfg.mtp_depth else 0  # no MTP, no drafts
    preset = preset.replace(model=cfg, rl=preset.rl.replace(num_speculative_tokens=drafts))
    return preset, {"init": init, "tokenizer": tokenizer}


INIT_DIR = "init"  # where a run keeps the checkpoint it imported from its preset's `init`


def preset_init(preset: Preset, out: Path | None) -> Path:
    """The checkpoint `preset.init` names: a birkhoff checkpoint as it is; an HF directory, a
    .gguf file or "package/file" in an installed package imported into `out`/init, upcycled
    to the preset's num_streams and mtp_depth at its max_seq_len (an earlier import there with
    those settings is reused: the import is deterministic)."""
    from birkhoff.interop.gguf import import_gguf, package_file
    from birkhoff.interop.hf import import_hf
    from birkhoff.runtime.checkpoint import MANIFEST_FILE

    assert preset.init is not None
    source = Path(preset.init)
    if (source / MANIFEST_FILE).is_file():
        return source
    if not source.exists():
        source = package_file(preset.init)
    if out is None:
        raise ValueError(f"init={preset.init!r}: importing it needs an output directory")
    target, model = out / INIT_DIR, preset.model
    shape = (model.num_streams, model.mtp_depth, model.max_seq_len)
    if (target / MANIFEST_FILE).is_file():
        cfg = checkpoint_config(target)
        if (cfg.num_streams, cfg.mtp_depth, cfg.max_seq_len) == shape:
            return target
    convert = import_gguf if source.suffix == ".gguf" else import_hf
    print(f"importing {source} -> {target} (S={shape[0]}, M={shape[1]})", flush=True)
    return convert(source, target, num_streams=shape[0], mtp_depth=shape[1], max_seq_len=shape[2])


def checkpoint_config(path: Path) -> ModelConfig:
    """The verified model config of the checkpoint at `path`."""
    from birkhoff.runtime.checkpoint import CONFIG_FILE, parse_config, read_manifest, read_verified

    return parse_config(path / CONFIG_FILE, read_verified(path, read_manifest(path), CONFIG_FILE))


FREE_TEXT_NEW_TOKENS = 256  # completion room of a chat-style task (reasoning, then the answer)


def task_inputs(
    preset: Preset,
    name: str,
    *,
    tokenizer: Tokenizer | None,
    fresh_model: bool,
    max_new_tokens: int | None,
    options: dict[str, Any] | None = None,
) -> Preset:
    """--task NAME (with the task `options` the user set): the preset with that generated task,
    its prompt style chosen for the tokenizer (tasks.problems.task_for_tokenizer); without
    --max-new-tokens, room for the longest of 64 sampled answers and its EOS, or
    FREE_TEXT_NEW_TOKENS for chat prompts. A fresh model's max_seq_len grows to fit prompt +
    completion; a checkpoint's must already."""
    import random

    from birkhoff.tasks.problems import sample_problems, task_for_tokenizer
    from birkhoff.tokenizer import CharTokenizer

    tok = tokenizer or CharTokenizer()
    chat = bool(getattr(tok, "chat", False))
    try:
        task, options = task_for_tokenizer(name, chat=chat, **(options or {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--task {name}: {err}") from None
    problems = sample_problems(task, random.Random(0), 64)
    try:
        prompt = max(len(tok.encode_prompt(p.prompt)) for p in problems)
        answer = max(len(tok.encode(p.answer)) for p in problems)
    except ValueError as err:
        raise ValueError(f"--task {name}: {err}") from err
    assert preset.rl is not None
    if max_new_tokens is None:
        room = FREE_TEXT_NEW_TOKENS if chat else answer + 1
        max_new_tokens = max(preset.rl.max_new_tokens, room)
    rl = preset.rl.replace(max_new_tokens=max_new_tokens)
    model, need = preset.model, prompt + max_new_tokens
    if model.max_seq_len < need:
        if not fresh_model:
            raise ValueError(
                f"--task {name}: prompts of up to {prompt} tokens + {max_new_tokens} new "
                f"tokens exceed the model's max_seq_len={model.max_seq_len}"
            )
        model = model.replace(max_seq_len=-(-need // 16) * 16)
    return preset.replace(task=name, task_options=options, rl=rl, model=model)


def data_inputs(
    preset: Preset,
    data: Path,
    *,
    verifier: str | None,
    eval_data: Path | None,
    max_new_tokens: int | None,
    tokenizer: Tokenizer | None,
) -> tuple[Preset, dict[str, Any]]:
    """--data FILE.jsonl: train and held-out splits; without --max-new-tokens, room for the
    longest answer and its EOS."""
    from birkhoff.tasks.jsonl import load_jsonl_tasks
    from birkhoff.tokenizer import CharTokenizer

    tok = tokenizer or CharTokenizer()
    splits = load_jsonl_tasks(
        data,
        verifier=verifier or "exact",
        eval_path=eval_data,
        seed=preset.train.seed,
        tokenizer=tok,
        max_seq_len=preset.model.max_seq_len,
    )
    assert preset.rl is not None
    if max_new_tokens is None:
        longest = max(len(tok.encode(p.answer)) for p in splits.train.problems)
        rl = preset.rl.replace(max_new_tokens=max(preset.rl.max_new_tokens, longest + 1))
        preset = preset.replace(rl=rl)
    return preset, {"task": splits.train, "eval_problems": splits.eval.problems}
