"""Peak memory of one GRPO update, chunked token logprobs ("after") against the unchunked
reference path ("before", `logprob_path(unchunked=True)`: the [B*T, V] logits and their fp32
log-softmax), at the real vocabularies V = 49,152 (SmolLM2) and V = 151,936 (Qwen2.5).

Legend: B batch, T tokens, V vocab.

    python benchmarks/grpo_memory.py --device cuda         # SmolLM2-135M's trunk, 64 x 512 tokens
    python benchmarks/grpo_memory.py                       # CPU: a small trunk, 8 x 128 tokens

One update is `train_step` with the GRPO loss of the RL loop (`grpo_loss_fn`: policy loss on
the completion tokens + the MTP loss, optional KL to a frozen copy) on a synthetic batch of B
completions of T tokens whose first `--prompt` tokens are the prompt, with the trunk the
smollm2 GRPO run uses (dim 576, 30 layers, 9 / 3 heads, S = 4, M = 1, tied embeddings; bf16
autocast and full recompute on CUDA). Each (V, path) runs in a fresh process, so one that runs
out of memory is reported as "oom" and the others still run:
- cuda: `torch.cuda.max_memory_allocated` of the second update (the first allocates AdamW's
  state and warms cuBLAS; `max_memory_reserved` is kept as `peak_reserved_bytes`); `base` is
  what is allocated before it (weights and optimizer state).
- cpu: the process's peak RSS (`ru_maxrss`) over one update; `base` is the RSS before it
  (weights and the interpreter; AdamW's state is part of the update here).
The "before" path computes each head's logprobs once (the main loss and the GRPO ratio share
them); the code it replaces also ran a second fp32 log-softmax for the main loss, so the figure
understates what that code held. The SmolLM2 trunk is run at V = 151,936 too: only the head
changes with the vocabulary. Prints a table and writes benchmarks/results/grpo_memory-
<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, json_args, write_result

from birkhoff.config import ModelConfig
from birkhoff.model.logprobs import logprob_path
from birkhoff.rl.config import RLConfig
from birkhoff.rl.loop import grpo_loss_fn
from birkhoff.rl.loss import GRPOLossConfig
from birkhoff.rl.rollout import RLBatch
from birkhoff.train.config import TrainConfig
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import train_step

VOCABS = (49152, 151936)
PATHS = ("before", "after")
SIZES: dict[str, dict[str, Any]] = {
    "cuda": dict(dim=576, layers=30, heads=9, kv_heads=3, mlp=1536, batch=64, seq=512, prompt=64),
    "cpu": dict(dim=64, layers=2, heads=4, kv_heads=2, mlp=176, batch=8, seq=128, prompt=16),
}
MARK = "GRPO_MEMORY_RESULT "


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="comma-separated V")
    p.add_argument("--paths", default=",".join(PATHS), help="before and/or after")
    for name in ("dim", "layers", "heads", "kv_heads", "mlp", "batch", "seq", "prompt"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: by device")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--mtp", type=int, default=1)
    p.add_argument("--chunk-tokens", type=int, help="tokens a chunk (default: by vocabulary)")
    p.add_argument("--kl-weight", type=float, default=0.0, help="> 0: KL to a frozen copy")
    p.add_argument("--recompute", choices=("none", "full"), help="default: full on CUDA")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per (V, path)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # "V:path": one measurement, in-process
    args = p.parse_args(argv)
    for key, value in SIZES[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.recompute is None:
        args.recompute = "full" if args.device == "cuda" else "none"
    if not 0 < args.prompt < args.seq:
        p.error(f"--prompt {args.prompt} must be in (0, --seq {args.seq})")
    return args


def grpo_batch(args: argparse.Namespace, vocab: int, device: torch.device) -> RLBatch:
    """B completions of T tokens: ids, the completion mask after the prompt, rollout logprobs
    near the policy's (log 1/V), advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.seq
    ids_BT = torch.randint(0, vocab, (B, T), generator=g)
    mask_BT = (torch.arange(T) >= args.prompt)[None, :].expand(B, T).clone()
    logp_BT = torch.full((B, T), -math.log(vocab)) * mask_BT
    adv_B = torch.randn(B, generator=g)
    return RLBatch(ids_BT, mask_BT, logp_BT, adv_B, [0] * B).to(device)


def current_rss() -> int:
    """Resident bytes of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args: argparse.Namespace, vocab: int, path: str) -> dict[str, Any]:
    """One (V, path) in this process: peak and base bytes of one GRPO update."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        mlp_hidden=args.mlp,
        num_streams=args.streams,
        mtp_depth=args.mtp,
        max_seq_len=args.seq,
        tie_embeddings=True,
        rope_theta=100000.0,
    )
    train = TrainConfig(
        lr=1e-5,
        warmup_steps=0,
        num_steps=10,
        amp_dtype="bf16" if cuda else "none",
        recompute=args.recompute,
        reclaim="safe",
    )
    model = build_model(cfg, train, device=device)
    optimizer = build_optimizer(model, train)
    reference = None
    if args.kl_weight > 0:
        reference = build_model(cfg, train, device=device).requires_grad_(False)
    rl = RLConfig(temperature=1.0, loss=GRPOLossConfig(kl_weight=args.kl_weight))
    loss_fn = grpo_loss_fn(rl, reference)
    batch = grpo_batch(args, vocab, device)
    with logprob_path(chunk_tokens=args.chunk_tokens, unchunked=path == "before"):
        if cuda:  # the first update allocates AdamW's state and initialises cuBLAS
            train_step(model, optimizer, batch, train, step=0, loss_fn=loss_fn)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            base = current_rss()
        start = time.perf_counter()
        metrics = train_step(model, optimizer, batch, train, step=1, loss_fn=loss_fn)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    extra: dict[str, int] = {}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        extra["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:  # ru_maxrss is in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "vocab": vocab,
        "path": path,
        "status": "ok",
        "peak_bytes": int(peak),
        "base_bytes": int(base),
        "update_bytes": int(peak - base),
        "update_s": round(seconds, 3),
        "loss": metrics["loss"],
        **extra,
    }


def run_worker(argv: list[str], vocab: int, path: str, timeout: float) -> dict[str, Any]:
    """`measure` in a fresh process; an out-of-memory or a crash becomes the row's status."""
    cmd = [sys.executable, __file__, *argv, "--worker", f"{vocab}:{path}"]
    row: dict[str, Any] = {"vocab": vocab, "path": path}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return row | {"status": "timeout"}
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    err = done.stderr.strip().splitlines()
    oom = "out of memory" in done.stderr.lower() or done.returncode == -9
    status = "oom" if oom else f"error (exit {done.returncode})"
    return row | {"status": status, "detail": err[-1][:300] if err else ""}


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """before / after of the peak and of the update's own bytes, per vocabulary (ok rows)."""
    out: dict[str, Any] = {}
    for vocab in sorted({r["vocab"] for r in rows}):
        by = {r["path"]: r for r in rows if r["vocab"] == vocab and r["status"] == "ok"}
        if {"before", "after"} <= by.keys():
            b, a = by["before"], by["after"]
            out[str(vocab)] = {
                "peak_ratio": b["peak_bytes"] / a["peak_bytes"],
                "update_ratio": b["update_bytes"] / max(a["update_bytes"], 1),
            }
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker:
        vocab, path = args.worker.split(":")
        print(MARK + json.dumps(measure(args, int(vocab), path)), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    vocabs = [int(v) for v in args.vocabs.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= set(PATHS):
        raise ValueError(f"--paths {args.paths!r}: expected a subset of {PATHS}")
    tokens = args.batch * args.seq
    print(
        f"GRPO update on {args.device}: B={args.batch} x T={args.seq} ({tokens:,} tokens), "
        f"dim {args.dim}, {args.layers} layers, S={args.streams}, M={args.mtp}, "
        f"recompute {args.recompute}"
    )
    print(
        f"{'V':>8} {'path':>7} {'status':>8} {'peak GiB':>9} {'base GiB':>9} {'update GiB':>11}"
        f" {'[B*T,V] fp32 GiB':>17}"
    )
    rows = []
    for vocab in vocabs:
        for path in paths:
            row = run_worker(argv, vocab, path, args.timeout)
            rows.append(row)
            print(
                f"{vocab:>8,} {path:>7} {row['status']:>8} {gib(row.get('peak_bytes')):>9} "
                f"{gib(row.get('base_bytes')):>9} {gib(row.get('update_bytes')):>11} "
                f"{gib(tokens * vocab * 4):>17}",
                flush=True,
            )
    ratios = summarize(rows)
    for vocab, r in ratios.items():
        print(
            f"V={int(vocab):,}: peak before / after {r['peak_ratio']:.2f}x, the update's own "
            f"bytes {r['update_ratio']:.2f}x"
        )
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"grpo_memory-{args.device}.json"
    result = {"args": json_args(args), "tokens": tokens, "rows": rows, "ratios": ratios}
    write_result(out, result, device=args.device, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
