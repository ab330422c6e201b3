"""`birkhoff generate`: complete prompts with a checkpoint (its tokenizer.json when it has one)."""

from __future__ import annotations

import argparse
from pathlib import Path

from birkhoff.cli.common import UsageError, resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion length")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--speculative", type=int, default=0, help="MTP draft tokens per step")
    parser.add_argument("--chat", action="store_true", help="prompts through the chat template")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda when available",
    )


def run(args: argparse.Namespace) -> int:
    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.interop.tokenizer import checkpoint_tokenizer
    from birkhoff.runtime.checkpoint import load_checkpoint
    from birkhoff.runtime.dcp import is_sharded_checkpoint

    device = resolve_device(args.device)
    if is_sharded_checkpoint(args.checkpoint):
        raise UsageError(
            f"--checkpoint {args.checkpoint}: a sharded checkpoint; run `birkhoff "
            "consolidate --checkpoint DIR --out NEW_DIR` first"
        )
    try:
        tok = checkpoint_tokenizer(args.checkpoint, chat=args.chat)
        params = SamplingParams(
            args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop_token_ids=tok.stop_ids,
            num_speculative_tokens=args.speculative,
        )
        prompts = [tok.encode_prompt(text) for text in args.prompt]
        model = load_checkpoint(args.checkpoint).model.eval()
        engine = Engine.from_model(
            model,
            device=device,
            max_batch_size=len(prompts),
            max_speculative_tokens=max(args.speculative, 1),
        )
        completions = engine.generate(prompts, params)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for text, completion in zip(args.prompt, completions, strict=True):
        print(f"{text}{tok.decode(completion.tokens)}")
    stats = engine.last_stats
    if stats is not None:
        rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_rate)
        print(
            f"acceptance per draft position: {rates}; "
            f"mean accepted length {stats.mean_accepted_length:.2f}"
        )
    return 0
