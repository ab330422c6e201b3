"""Decode throughput of the engine, next to its bounds and a peer, in one run (sections).

- shapes: the h200-small trunk (dim 768, 16 layers, 12 heads; V 256) as S=4, M=1 and as S=1, M=0,
  random weights, plain greedy decode at each batch: tokens/s; GPU busy fraction over steady-state
  decode (device time from torch.profiler / wall time, both as the difference of a long and a
  short run, so prefill and warm-up cancel); fraction of the HBM bandwidth bound (weight + KV
  bytes per step at the mean context, over the device copy bandwidth measured in this run).
- fp8: the same for the S=4 trunk with block-fp8 weights (fp8 matmuls on Hopper), vs bf16.
- spec: a small mHC + MTP model trained briefly on t_{i+1} = 5 t_i + 3 mod V (1% noise; 64-token
  training sequences, generation runs past them so drafts are sometimes rejected): plain vs
  speculative tokens/s, acceptance per draft position.
- continuous: the S=4 trunk on requests with mixed lengths (new tokens uniform in 16..512, no
  stops): one continuous-batching call vs calls of max_batch_size prompts run to completion.
- peer: HuggingFace transformers `generate` on a same-shape dense Llama (random weights): static
  cache + torch.compile "reduce-overhead" (CUDA graphs) and the eager dynamic cache, vs our S=1,
  M=0 engine at the same batches and token counts.
- moe: the S=4, M=1 trunk with MoE feed-forwards (every layer but the first and the MTP depth;
  `common.same_active_moe`: one shared + top-3 of --experts routed experts, the dense model's
  active width; stacked experts through the grouped GEMMs on CUDA) next to the dense S=4, M=1
  trunk: plain decode tokens/s at each batch and moe_over_dense. Its bound counts the routed
  expert bytes a step is expected to touch: of E experts, E * (1 - (1 - k/E)^batch) under
  uniform top-k routing (3 experts per layer at batch 1, nearly all at batch 64).
Engines use CUDA graphs on CUDA (`--no-graphs`: eager). Timings are best of `--repeats`.

    python benchmarks/decode.py --device cpu --quick                  # smoke run
    python benchmarks/decode.py --device cuda                         # everything, a few minutes
    python benchmarks/decode.py --device cuda --sections shapes,peer --batches 1,64
    python benchmarks/decode.py --device cuda --sections moe --batches 1,64   # the MoE engine
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, copy_bandwidth, json_args, same_active_moe, sync, write_result
from decode_peer import device_seconds, hf_peer

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer

HBM_BYTES_PER_S = 4.8e12  # H200 nominal
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SECTIONS = ("shapes", "fp8", "spec", "continuous", "peer")
SECTIONS = (*DEFAULT_SECTIONS, "moe")  # moe runs when asked for


def task_batch(batch: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """t_{i+1} = (5 t_i + 3) mod V, 1% random tokens."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for i in range(1, length):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % vocab
    noise = torch.rand(batch, length, generator=gen) < 0.01
    return torch.where(noise, torch.randint(0, vocab, (batch, length), generator=gen), ids)


def train(cfg: ModelConfig, steps: int, device: torch.device, lr: float = 3e-3) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
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


def bytes_per_step(engine: Engine, batch: int, context: float) -> float:
    """Main-model weight bytes + the batch's KV bytes at `context` positions: one decode step
    (routed experts: the fraction a batch touches under uniform top-k routing)."""
    cfg = engine.cfg
    touched = 1.0
    if cfg.moe is not None:
        touched = 1 - (1 - cfg.moe.experts_per_token / cfg.moe.num_experts) ** batch
    main = sum(
        t.numel() * t.element_size() * (touched if ".experts." in n else 1.0)
        for n, t in engine.weights.items()
        if not n.startswith("mtp.")
    )
    kv = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * engine.dtype.itemsize * batch * context
    return main + kv


def timed_generate(
    engine: Engine, prompts: list[list[int]], params: Any, device: torch.device, repeats: int
) -> tuple[float, int]:
    """(best wall seconds, generated tokens) of engine.generate after one warm-up call."""
    engine.generate(prompts, params)  # warm-up: captures the graphs this call needs
    seconds, tokens = float("inf"), 0
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(device)
        seconds = min(seconds, time.perf_counter() - start)
        tokens = sum(len(c.tokens) for c in out)
    return seconds, tokens


def busy_fraction(engine: Engine, prompts: list[list[int]], new_tokens: int, wall_full: float,
                  device: torch.device, repeats: int) -> float | None:  # fmt: skip
    """Device time / wall time of the steps between new_tokens/2 and new_tokens (CUDA only);
    `wall_full` is the best wall time of the full-length call, measured by the caller."""
    if device.type != "cuda":
        return None
    short, full = SamplingParams(max(new_tokens // 2, 1)), SamplingParams(new_tokens)
    wall_short, _ = timed_generate(engine, prompts, short, device, repeats)
    dev_short = device_seconds(lambda: engine.generate(prompts, short), device)
    dev_full = device_seconds(lambda: engine.generate(prompts, full), device)
    return (dev_full - dev_short) / max(wall_full - wall_short, 1e-9)


def trunk(args: argparse.Namespace, streams: int, mtp: int) -> ModelConfig:
    seq = args.prompt_len + max(args.new_tokens, args.cb_max_new) + 8
    return ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                       num_heads=args.heads, num_streams=streams, mtp_depth=mtp,
                       max_seq_len=seq)  # fmt: skip


def engine_for(cfg: ModelConfig, args: argparse.Namespace, device: torch.device,
               max_batch: int, quantize: str | None = None, **kw: Any) -> Engine:  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).eval()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = device.type == "cuda" and not args.no_graphs
    return Engine.from_model(model, device=device, dtype=dtype, quantize=quantize,
                             max_batch_size=max_batch, cuda_graphs=graphs, **kw)  # fmt: skip


def plain_rows(name: str, engine: Engine, args: argparse.Namespace, device: torch.device,
               bandwidth: float, busy: bool) -> list[dict[str, Any]]:  # fmt: skip
    rows, gen = [], torch.Generator().manual_seed(1)
    for batch in args.batch_list:
        prompts = task_batch(batch, args.prompt_len, args.vocab, gen).tolist()
        seconds, tokens = timed_generate(
            engine, prompts, SamplingParams(args.new_tokens), device, args.repeats
        )
        step_bytes = bytes_per_step(engine, batch, args.prompt_len + args.new_tokens / 2)
        tps = tokens / seconds
        row = {"model": name, "batch": batch, "tokens_per_s": tps, "seconds": seconds,
               "bytes_per_step": step_bytes,
               "bound_fraction_copy_bw": tps / batch * step_bytes / bandwidth}  # fmt: skip
        if device.type == "cuda":
            row["bound_fraction_hbm"] = tps / batch * step_bytes / HBM_BYTES_PER_S
        if busy:
            row["gpu_busy"] = busy_fraction(
                engine, prompts, args.new_tokens, seconds, device, args.repeats
            )
        rows.append(row)
        print(f"{name:>10} batch {batch:>4}: {tps:10.1f} tok/s  busy {row.get('gpu_busy')}  "
              f"bound fraction {row['bound_fraction_copy_bw']:.3f}")  # fmt: skip
    return rows


def section_shapes(args: argparse.Namespace, device: torch.device, bw: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (s, m) in (("S4-M1", (4, 1)), ("S1-M0", (1, 0))):
        engine = engine_for(trunk(args, s, m), args, device, max(args.batch_list))
        out[name] = plain_rows(name, engine, args, device, bw, busy=True)
    return out


def section_fp8(args: argparse.Namespace, device: torch.device, bw: float) -> dict[str, Any]:
    cfg, rows = trunk(args, 4, 1), {}
    for quantize in (None, "fp8"):
        engine = engine_for(cfg, args, device, max(args.batch_list), quantize)
        rows[quantize or "bf16"] = plain_rows(
            f"S4-{quantize or 'bf16'}", engine, args, device, bw, busy=False
        )
    ratio = [
        f["tokens_per_s"] / b["tokens_per_s"]
        for f, b in zip(rows["fp8"], rows["bf16"], strict=True)
    ]
    return {"rows": rows, "fp8_over_bf16": ratio}


def section_moe(args: argparse.Namespace, device: torch.device, bw: float) -> dict[str, Any]:
    """Plain decode of the MoE trunk next to the dense trunk of the same active width."""
    dense = trunk(args, 4, 1)
    rows = {}
    for name, cfg in (("dense", dense), ("moe", same_active_moe(dense, args.experts))):
        engine = engine_for(cfg, args, device, max(args.batch_list))
        rows[name] = plain_rows(f"S4-{name}", engine, args, device, bw, busy=False)
    ratio = [m["tokens_per_s"] / d["tokens_per_s"]
             for m, d in zip(rows["moe"], rows["dense"], strict=True)]  # fmt: skip
    return {"rows": rows, "moe_over_dense": ratio, "experts": args.experts}


def section_spec(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    cfg = ModelConfig(vocab_size=64, dim=args.spec_dim, num_layers=args.spec_layers,
                      num_heads=args.spec_heads, num_streams=4, mtp_depth=1,
                      max_seq_len=max(64, args.prompt_len + args.spec_new_tokens + 8))  # fmt: skip
    model = train(cfg, args.train_steps, device, args.spec_lr)
    ks = sorted({0, *(int(k) for k in args.ks.split(","))})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = device.type == "cuda" and not args.no_graphs
    engine = Engine.from_model(model, device=device, dtype=dtype, cuda_graphs=graphs,
                               max_batch_size=max(args.spec_batch_list),
                               max_speculative_tokens=max(ks))  # fmt: skip
    rows, gen = [], torch.Generator().manual_seed(1)
    for batch in args.spec_batch_list:
        prompts = task_batch(batch, args.prompt_len, cfg.vocab_size, gen).tolist()
        plain = 0.0
        for k in ks:  # k = 0 first: the baseline
            params = SamplingParams(args.spec_new_tokens, num_speculative_tokens=k)
            seconds, tokens = timed_generate(engine, prompts, params, device, args.repeats)
            plain = plain or tokens / seconds
            row = {"batch": batch, "k": k, "tokens_per_s": tokens / seconds,
                   "speedup": tokens / seconds / plain}  # fmt: skip
            if (stats := engine.last_stats) is not None:
                row["acceptance"] = [round(a, 3) for a in stats.acceptance_rate]
                row["mean_accepted_length"] = round(stats.mean_accepted_length, 3)
            rows.append(row)
            print(f"spec batch {batch:>4} k {k}: {row['tokens_per_s']:10.1f} tok/s  "
                  f"speedup {row['speedup']:.2f}  {row.get('acceptance', '')}")  # fmt: skip
    return rows


def section_continuous(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    batch = args.cb_batch
    engine = engine_for(trunk(args, 4, 1), args, device, batch)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(2)
    prompts = task_batch(args.cb_requests, args.prompt_len, args.vocab, gen).tolist()
    params = [SamplingParams(rng.randint(args.cb_min_new, args.cb_max_new))
              for _ in prompts]  # fmt: skip
    result: dict[str, Any] = {"requests": len(prompts), "max_batch_size": batch}

    def run(mode: str) -> list[Any]:
        if mode == "continuous":
            return engine.generate(prompts, params)
        out: list[Any] = []
        for i in range(0, len(prompts), batch):
            out += engine.generate(prompts[i : i + batch], params[i : i + batch])
        return out

    for mode in ("continuous", "run_to_completion"):
        run(mode)  # warm-up: captures every graph the timed call replays
        sync(device)
        start = time.perf_counter()
        out = run(mode)
        sync(device)
        seconds = time.perf_counter() - start
        result[mode] = {"seconds": seconds, "tokens": sum(len(c.tokens) for c in out),
                        "tokens_per_s": sum(len(c.tokens) for c in out) / seconds}  # fmt: skip
        print(f"{mode:>18}: {result[mode]['tokens_per_s']:10.1f} tok/s")
    result["speedup"] = (
        result["continuous"]["tokens_per_s"] / result["run_to_completion"]["tokens_per_s"]
    )
    return result


def section_peer(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    cfg = trunk(args, 1, 0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = engine_for(cfg, args, device, max(args.peer_batch_list))
    rows, gen = [], torch.Generator().manual_seed(3)
    for batch in args.peer_batch_list:
        prompts = task_batch(batch, args.prompt_len, args.vocab, gen).tolist()
        seconds, tokens = timed_generate(
            engine, prompts, SamplingParams(args.new_tokens), device, args.repeats
        )
        ours = tokens / seconds
        rows.append({"peer": "birkhoff", "batch": batch, "tokens_per_s": ours})
        for mode in args.peer_modes.split(","):
            try:
                row = hf_peer(cfg, prompts, args.new_tokens, mode, device, dtype, 2)
            except Exception as e:  # a peer that cannot run is reported, not fatal
                row = {"peer": f"hf-{mode}", "batch": batch, "error": repr(e)[:300]}
            if "tokens_per_s" in row:
                row["birkhoff_over_peer"] = ours / row["tokens_per_s"]
            rows.append(row)
        for r in rows[-1 - len(args.peer_modes.split(",")) :]:
            print(f"peer {r['peer']:>10} batch {batch:>4}: {r.get('tokens_per_s', 0):10.1f} "
                  f"tok/s  ours/peer {r.get('birkhoff_over_peer', '')}")  # fmt: skip
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma list of {SECTIONS}")
    add("--quick", action="store_true", help="CPU smoke run: tiny models, few tokens")
    add("--no-graphs", action="store_true", help="engines run eagerly on CUDA too")
    add("--dim", type=int, default=768)
    add("--layers", type=int, default=16)
    add("--heads", type=int, default=12)
    add("--vocab", type=int, default=256)
    add("--prompt-len", type=int, default=16)
    add("--new-tokens", type=int, default=128)
    add("--batches", default="1,32,256")
    add("--repeats", type=int, default=3)
    add("--spec-dim", type=int, default=256)
    add("--spec-layers", type=int, default=4)
    add("--spec-heads", type=int, default=8)
    add("--spec-batches", default="1,32")
    add("--spec-new-tokens", type=int, default=128)
    add("--ks", default="1,2", help="speculative tokens; 0 (plain, the baseline) always runs")
    add("--train-steps", type=int, default=300)
    add("--spec-lr", type=float, default=3e-3, help="AdamW lr of the spec model (1e-3 at dim 768)")
    add("--cb-requests", type=int, default=128)
    add("--cb-batch", type=int, default=32)
    add("--cb-min-new", type=int, default=16)
    add("--cb-max-new", type=int, default=512)
    add("--peer-batches", default="1,64")
    add("--experts", type=int, default=32, help="routed experts per MoE layer (section moe)")
    add("--peer-modes", default="static,eager", help="transformers generate: static,eager")
    add("--out", type=Path, help="JSON path (default benchmarks/results/decode-<device>.json)")
    args = ap.parse_args()
    if args.quick:
        for k, v in dict(dim=64, layers=2, heads=4, vocab=64, new_tokens=16, batches="1,4",
                         repeats=1, spec_dim=64, spec_layers=2, spec_heads=4, spec_batches="1,4",
                         spec_new_tokens=32, train_steps=60, cb_requests=12, cb_batch=4,
                         cb_min_new=4, cb_max_new=24, peer_batches="1,4").items():  # fmt: skip
            setattr(args, k, v)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.spec_batch_list = [int(b) for b in args.spec_batches.split(",")]
    args.peer_batch_list = [int(b) for b in args.peer_batches.split(",")]
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    bandwidth = copy_bandwidth(device, num_bytes=1 << 28)
    print(f"device {device}, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    result: dict[str, Any] = {"device": str(device), "copy_bandwidth_bytes_per_s": bandwidth,
                              "args": json_args(args)}  # fmt: skip
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    runners = {"shapes": lambda: section_shapes(args, device, bandwidth),
               "fp8": lambda: section_fp8(args, device, bandwidth),
               "spec": lambda: section_spec(args, device),
               "continuous": lambda: section_continuous(args, device),
               "peer": lambda: section_peer(args, device),
               "moe": lambda: section_moe(args, device, bandwidth)}  # fmt: skip
    for name in sections:
        start = time.perf_counter()
        print(f"\n== {name}")
        result[name] = runners[name]()
        result[f"{name}_section_seconds"] = time.perf_counter() - start
    result.update(summary(result))  # the headline figures as flat top-level keys too
    out = args.out or RESULTS / f"decode-{device.type}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    shown = out.resolve()
    print(f"wrote {shown.relative_to(REPO_ROOT) if shown.is_relative_to(REPO_ROOT) else shown}")
    print(json.dumps(summary(result)))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures under flat keys (written into the JSON, printed as one line):
    `S4-M1_b1_bound_frac`, `spec_b1_k2_speedup`, `moe_over_dense_b64`,
    `fp8_over_bf16_b1_d2048` (the trunk's dim in the key), ..."""
    s: dict[str, Any] = {"device": result["device"]}
    args = result["args"]
    for name, rows in result.get("shapes", {}).items():
        for r in rows:
            s[f"{name}_b{r['batch']}_tok_s"] = round(r["tokens_per_s"], 1)
            if r.get("gpu_busy") is not None:
                s[f"{name}_b{r['batch']}_busy"] = round(r["gpu_busy"], 3)
            s[f"{name}_b{r['batch']}_bound_frac"] = round(r["bound_fraction_copy_bw"], 4)
    if "fp8" in result:
        batches = [r["batch"] for r in result["fp8"]["rows"]["bf16"]]
        for b, x in zip(batches, result["fp8"]["fp8_over_bf16"], strict=True):
            s[f"fp8_over_bf16_b{b}_d{args['dim']}"] = round(x, 3)
    for r in result.get("moe", {}).get("rows", {}).get("moe", []):
        s[f"moe_b{r['batch']}_tok_s"] = round(r["tokens_per_s"], 1)
    if "moe" in result:
        batches = [r["batch"] for r in result["moe"]["rows"]["moe"]]
        for b, x in zip(batches, result["moe"]["moe_over_dense"], strict=True):
            s[f"moe_over_dense_b{b}"] = round(x, 3)
    for r in result.get("spec", []):
        if r["k"]:
            s[f"spec_b{r['batch']}_k{r['k']}_speedup"] = round(r["speedup"], 3)
    if "continuous" in result:
        s["continuous_speedup"] = round(result["continuous"]["speedup"], 3)
    for r in result.get("peer", []):
        if "birkhoff_over_peer" in r:
            s[f"ours_over_{r['peer']}_b{r['batch']}"] = round(r["birkhoff_over_peer"], 3)
    return s


if __name__ == "__main__":
    main()
