"""What DeepSeek-V4's compressed attention costs: the same small V4 model (mHC, V4 MoE with a
hash-routed layer first, one MTP depth) with every layer sliding-only, CSA or HCA, in one run.

- train: one forward + backward of the loss (main + MTP) on a [batch, seq] batch, best ms.
- decode: engine greedy decode (eager kernels, no CUDA graphs: the V4 attention has neither),
  tokens/s after a prefill of --prompt tokens per row.
- parts: torch.profiler ranges around the V4 attention (inclusive), its compressor (inclusive
  of the CSA indexer), the indexer and the MoE feed-forward; reported exclusive (attention =
  the rest of the attention layer: projections, sliding keys, softmax). Training parts are the
  forward's (the backward runs outside the ranges); decode parts are the engine's functions
  (`compressed_keys`, `indexer_scores`, `v4_attention`, `feed_forward`), where the indexer's
  own pooling counts as compressor.
Ratios are time ratios to sliding-only (> 1: costs more), flat keys `csa_over_sliding_train`,
`hca_over_sliding_decode`, ...

    python benchmarks/v4_cost.py --quick                 # seconds (the test)
    python benchmarks/v4_cost.py --device cpu            # benchmarks/results/v4_cost-cpu.json
    python benchmarks/v4_cost.py --device cuda --dim 256 --layers 4 --seq 1024
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import json_args, sync, timed, write_result  # noqa: E402

import birkhoff.engine.forward as engine_forward  # noqa: E402
import birkhoff.engine.v4_forward as engine_v4  # noqa: E402
from birkhoff.config import ModelConfig, MoEConfig, V4AttentionConfig  # noqa: E402
from birkhoff.engine import Engine, SamplingParams  # noqa: E402
from birkhoff.model import Transformer  # noqa: E402
from birkhoff.model.moe import RoutedFeedForward  # noqa: E402
from birkhoff.model.v4_attention import V4Attention  # noqa: E402
from birkhoff.model.v4_compressor import Compressor, Indexer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
PARTS = ("attention", "compressor", "indexer", "moe")
# size flags: cpu default (a minute on two loaded cores), quick (the test), cuda
SIZES = {
    "quick": dict(dim=32, layers=1, seq=32, batch=1, prompt=8, new_tokens=4, repeats=1,
                  window=8, hca_rate=8, topk=4),
    "cpu": dict(dim=64, layers=2, seq=128, batch=1, prompt=32, new_tokens=8, repeats=3,
                window=32, hca_rate=16, topk=8),
    "cuda": dict(dim=256, layers=4, seq=1024, batch=4, prompt=512, new_tokens=128, repeats=5,
                 window=128, hca_rate=32, topk=32),
}  # fmt: skip


def v4_config(kind: str, args: argparse.Namespace) -> ModelConfig:
    """Every layer of `kind`; heads of 64 (16 at dim < 256), half of them rope."""
    D = args.dim
    K = 64 if D >= 256 else 16
    attention = V4AttentionConfig(
        q_lora_rank=D // 2, head_dim=K, qk_rope_head_dim=K // 2,
        layer_types=(KINDS[kind],) * args.layers, sliding_window=args.window,
        compress_rate_csa=4, compress_rate_hca=args.hca_rate, index_n_heads=4,
        index_head_dim=K // 2, index_topk=args.topk, o_groups=2, o_lora_rank=D // 2,
    )  # fmt: skip
    moe = MoEConfig(
        num_experts=8, experts_per_token=2, expert_hidden=D, num_dense_layers=0,
        num_hash_layers=1, scoring="sqrtsoftplus", swiglu_limit=10.0, balance_loss="switch",
    )  # fmt: skip
    return ModelConfig(
        vocab_size=256, dim=D, num_layers=args.layers, num_heads=D // K, num_kv_heads=1,
        num_streams=4, mtp_depth=1, max_seq_len=max(args.seq, args.prompt + args.new_tokens),
        attention=attention, moe=moe,
    )  # fmt: skip


def label_modules(model: nn.Module) -> None:
    """Wrap each V4 part's forward in a profiler range named by its part."""
    for module in model.modules():
        if isinstance(module, Indexer):
            part = "indexer"
        elif isinstance(module, Compressor):
            part = "compressor"
        elif isinstance(module, V4Attention):
            part = "attention"
        elif isinstance(module, RoutedFeedForward):
            part = "moe"
        else:
            continue
        module.forward = ranged(part, module.forward)  # type: ignore[method-assign]


def ranged(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"v4:{part}"):
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def labelled_engine() -> Iterator[None]:
    """Profiler ranges around the engine's V4 functions, for the duration."""
    patches = [
        (engine_forward, "v4_attention", "attention"),
        (engine_v4, "compressed_keys", "compressor"),
        (engine_v4, "indexer_scores", "indexer"),
        (engine_forward, "feed_forward", "moe"),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, part in patches:
        setattr(mod, name, ranged(part, getattr(mod, name)))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def exclusive_parts(fn: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """ms of each part in one call of `fn` under torch.profiler, nested ranges subtracted
    (attention - compressor, compressor - indexer); device time on CUDA where recorded."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    total = {part: 0.0 for part in PARTS}
    for event in prof.key_averages():
        if event.key.startswith("v4:"):
            dev = getattr(event, "device_time_total", 0.0) if device.type == "cuda" else 0.0
            total[event.key[3:]] += (dev or event.cpu_time_total) / 1e3
    return {
        "attention": total["attention"] - total["compressor"],
        "compressor": total["compressor"] - total["indexer"],
        "indexer": total["indexer"],
        "moe": total["moe"],
    }


def train_cost(cfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Best-of-repeats ms of forward + backward (a shared, loaded CPU: the minimum is the
    least noisy), and the forward's parts."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    if not args.quick:
        step()  # warm-up
    ms = 1e3 * min(timed(step, device, 1, warmup=0) for _ in range(args.repeats))
    label_modules(model)
    return {"ms": ms, "parts_ms": exclusive_parts(step, device)}


def decode_cost(cfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Greedy decode tokens/s (best of --repeats, after a warm-up call) and one call's parts."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).eval()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = Engine.from_model(model, device=device, dtype=dtype, max_batch_size=args.batch,
                               cuda_graphs=False, kernels="eager")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=gen).tolist()
    params = SamplingParams(args.new_tokens)  # greedy, no stop tokens

    def call() -> int:
        return sum(len(c.tokens) for c in engine.generate(prompts, params))

    if not args.quick:
        call()  # warm-up
    best, tokens = float("inf"), 0
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        tokens = call()
        sync(device)
        best = min(best, time.perf_counter() - start)
    with labelled_engine():
        parts = exclusive_parts(call, device)
    return {"tokens_per_s": tokens / best, "tokens": tokens, "parts_ms": parts}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (seconds)")
    # --window: sliding window; --hca-rate (CSA's is 4); --topk: CSA indexer entries per query
    for name in SIZES["cpu"]:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    sizes = SIZES["quick" if args.quick else args.device]
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_grad_enabled(True)
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        cfg = v4_config(kind, args)
        kinds[kind] = {"train": train_cost(cfg, args, device),
                       "decode": decode_cost(cfg, args, device)}  # fmt: skip
        t, d = kinds[kind]["train"], kinds[kind]["decode"]
        print(f"{kind:8s} train {t['ms']:8.1f} ms  decode {d['tokens_per_s']:8.1f} tok/s  "
              f"train parts {fmt(t['parts_ms'])}  decode parts {fmt(d['parts_ms'])}")  # fmt: skip
    result: dict[str, Any] = {"args": json_args(args), "kinds": kinds}
    base = kinds["sliding"]
    for kind in ("csa", "hca"):
        result[f"{kind}_over_sliding_train"] = kinds[kind]["train"]["ms"] / base["train"]["ms"]
        speed = base["decode"]["tokens_per_s"] / kinds[kind]["decode"]["tokens_per_s"]
        result[f"{kind}_over_sliding_decode"] = speed
        print(f"{kind}_over_sliding: train {result[f'{kind}_over_sliding_train']:.2f}x, "
              f"decode {speed:.2f}x")  # fmt: skip
    suffix = "-quick" if args.quick else ""
    write_result(args.out_dir / f"v4_cost-{args.device}{suffix}.json", result,
                 device=args.device, indent=2)  # fmt: skip
    return result


def fmt(parts: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in parts.items())


if __name__ == "__main__":
    main()
