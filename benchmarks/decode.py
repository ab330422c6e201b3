"""Decode throughput of the engine: plain vs MTP speculative decoding, next to the bandwidth bound.

Trains a small mHC + MTP model briefly on a synthetic deterministic sequence task (the affine
recurrence t_{i+1} = 5 t_i + 3 mod V with 1% random tokens: quick to learn, so the MTP depths learn
to predict two steps ahead), builds an engine, and
measures generated tokens/s at each batch size for plain decoding and for k = 1..3
speculative tokens, with acceptance per draft position and speedup over plain in the same run.
Training sequences have 64 tokens; the default run generates up to position 144, beyond what the
model saw, so main model and drafter sometimes disagree there (acceptance < 1). Runs that stay
within 64 positions (--quick) accept nearly every greedy draft of this deterministic task.

Bandwidth bound: one plain decode step must read every main-model weight once plus the KV cache
of the batch, so tokens/s <= batch * bandwidth / (weight bytes + KV bytes at the mean context).
Bandwidth is the copy bandwidth measured in this run (read + write of a large buffer) and, on
CUDA, also the H200's nominal 4.8 TB/s HBM. Batch-1 decode of a model this small is bound by
kernel launches, not bandwidth; the bound says how far that is from the memory limit.

    python benchmarks/decode.py --device cpu --quick
    python benchmarks/decode.py --device cuda            # bf16, batch 1 and 32, k = 0..3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from common import json_args, sync

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer

HBM_BYTES_PER_S = 4.8e12  # H200 nominal


def task_batch(batch: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """t_{i+1} = (5 t_i + 3) mod V, 1% random tokens."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for i in range(1, length):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % vocab
    noise = torch.rand(batch, length, generator=gen) < 0.01
    return torch.where(noise, torch.randint(0, vocab, (batch, length), generator=gen), ids)


def train(cfg: ModelConfig, steps: int, device: torch.device) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = task_batch(32, 64, cfg.vocab_size, gen).to(device)
        out = model(ids, labels=ids)
        assert out.loss is not None
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        if step % max(steps // 5, 1) == 0 or step == steps - 1:
            mtp = [round(x.item(), 3) for x in out.mtp_losses]
            print(f"train step {step}: main {out.main_loss.item():.3f} mtp {mtp}")  # type: ignore[union-attr]
    return model.eval()


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 28) -> float:
    """Bytes/s of a device copy (counts read + write)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, reps = time.perf_counter(), 5
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * num_bytes * reps / (time.perf_counter() - start)


def bytes_per_step(engine: Engine, batch: int, context: float) -> float:
    main = sum(
        t.numel() * t.element_size() for n, t in engine.weights.items() if not n.startswith("mtp.")
    )
    cfg = engine.cfg
    kv = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * engine.dtype.itemsize * batch * context
    return main + kv


def measure(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    k: int,
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    params = SamplingParams(new_tokens, num_speculative_tokens=k)
    engine.generate(prompts, SamplingParams(4, num_speculative_tokens=k))  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = float("inf")
    for _ in range(repeats):  # best of `repeats`: the least disturbed run
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(device)
        seconds = min(seconds, time.perf_counter() - start)
    num_tokens = sum(len(c.tokens) for c in out)
    row: dict[str, Any] = {"k": k, "batch": len(prompts), "tokens": num_tokens,
                              "seconds": seconds, "tokens_per_s": num_tokens / seconds}  # fmt: skip
    stats = engine.last_stats
    if stats is not None:
        row["acceptance"] = [round(a, 3) for a in stats.acceptance_rate]
        row["mean_accepted_length"] = round(stats.mean_accepted_length, 3)
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--mtp-depth", type=int, default=1)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ks", default="0,1,2,3", help="speculative tokens; 0 = plain (the baseline)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few tokens")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.heads, args.train_steps, args.new_tokens = 64, 2, 4, 150, 32
    return args


def print_table(rows: list[dict[str, Any]], device: torch.device, bandwidth: float) -> None:
    print(f"\ndevice {device} copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    head = ("batch", "k", "tok/s", "speedup", "mean len", "bound tok/s")
    print("{:>5} {:>2} {:>10} {:>8} {:>8} {:>12}  acceptance/pos".format(*head))
    for r in rows:
        print(f"{r['batch']:>5} {r['k']:>2} {r['tokens_per_s']:>10.1f} {r['speedup']:>8.2f} "
              f"{r.get('mean_accepted_length', 1.0):>8} {r['bound_tokens_per_s_copy_bw']:>12.0f}  "
              f"{r.get('acceptance', '')}")  # fmt: skip


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                      num_heads=args.heads, num_streams=args.streams, mtp_depth=args.mtp_depth,
                      max_seq_len=max(64, args.prompt_len + args.new_tokens + 8))  # fmt: skip
    model = train(cfg, args.train_steps, device)
    ks = sorted({0, *(int(k) for k in args.ks.split(","))})  # plain always runs: the baseline
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.from_model(model, device=device, dtype=dtype, max_batch_size=max(batches),
                               max_speculative_tokens=max(ks))  # fmt: skip
    bandwidth = copy_bandwidth(device)
    gen = torch.Generator().manual_seed(1)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        prompts = task_batch(batch, args.prompt_len, cfg.vocab_size, gen).tolist()
        step_bytes = bytes_per_step(engine, batch, args.prompt_len + args.new_tokens / 2)
        plain = 0.0
        for k in ks:  # k = 0 first
            row = measure(engine, prompts, args.new_tokens, k, device, args.repeats)
            plain = plain or row["tokens_per_s"]
            row["speedup"] = row["tokens_per_s"] / plain
            row["bound_tokens_per_s_copy_bw"] = batch * bandwidth / step_bytes
            if device.type == "cuda":
                row["bound_tokens_per_s_hbm"] = batch * HBM_BYTES_PER_S / step_bytes
            rows.append(row)
    print_table(rows, device, bandwidth)
    out = Path(__file__).parent / "results" / f"decode-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": str(device), "dtype": str(dtype), "copy_bandwidth_bytes_per_s": bandwidth,
              "model": json.loads(cfg.to_json()), "args": json_args(args),
              "rows": rows}  # fmt: skip
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
