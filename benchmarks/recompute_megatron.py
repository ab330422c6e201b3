"""megatron-core GPT + MTP under full recompute: stock backward vs birkhoff's patch.

Builds megatron-core's GPTModel (local spec, no TransformerEngine) with one MTP layer,
`recompute_granularity="full"`, `recompute_method="uniform"`, one layer per checkpoint, on one
GPU (world size 1), and runs one training step per variant from the same weights and batch:
  megatron   megatron-core's own CheckpointFunction.backward
  safe       birkhoff.recompute.megatron.patch("safe")
  always     patch("always"): the unconditional input free RL stacks install (--with-always,
             runs last; MTP's input is the decoder output the final norm saved, so this reads
             freed memory)
With --stash every transformer layer's MLP keeps its latest output on an attribute (as MoE
dispatchers do); under megatron's backward that output's graph pins the layer's recompute input
and its .grad, under the patch only the stash itself.
Reported per variant: loss, max |grad - megatron's grad|, bytes allocated after the step (outputs
dropped, gradients kept) and peak bytes during it, both above the bytes allocated before it, for
the first step of a freshly built model (so no stash of an earlier step is in the baseline).

  python benchmarks/recompute_megatron.py                    # H200: hidden 1024, 8 layers, T 2048
  python benchmarks/recompute_megatron.py --stash --with-always
  python benchmarks/recompute_megatron.py --quick            # tiny, seconds
Needs megatron-core >= 0.19 (Python >= 3.12) and CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from common import write_result
from torch import Tensor, nn

import birkhoff.recompute.megatron as bm

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {
    "full": dict(hidden=1024, layers=8, heads=16, vocab=32768, seq=2048, batch=4),
    "quick": dict(hidden=64, layers=2, heads=4, vocab=128, seq=32, batch=2),
}


def init_parallel(device: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        backend = "nccl" if device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build_gpt(size: dict[str, int], device: str) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=size["layers"], hidden_size=size["hidden"], num_attention_heads=size["heads"],
        use_cpu_initialization=True, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=size["vocab"],
        max_sequence_length=size["seq"], position_embedding_type="learned_absolute",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )  # fmt: skip
    return model.to(device).train()


def add_stashes(model: nn.Module) -> None:
    """Every decoder MLP keeps its latest output on `self.stash` (an MoE-style leak)."""

    def keep(module: nn.Module, args: Any, out: Any) -> None:
        module.stash = out[0] if isinstance(out, tuple) else out

    for name, module in model.named_modules():
        if name.startswith("decoder.layers.") and name.endswith(".mlp"):
            module.register_forward_hook(keep)


def batch(size: dict[str, int], device: str) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)
    T = size["seq"]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    pos = torch.arange(T)[None].expand(size["batch"], T)
    data = dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids)
    return {k: v.to(device) for k, v in data.items()}


def step(model: nn.Module, data: dict[str, Tensor], device: str) -> dict[str, Any]:
    """One forward + backward; loss, gradients and memory above the pre-step allocation."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    loss = model(**data).float().mean()
    loss.backward()
    value = loss.item()
    del loss
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - before if cuda else 0
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": value, "grads": grads, "after_step_bytes": after, "peak_bytes": peak}


def run_variant(variant: str, args: argparse.Namespace, size: dict[str, int]) -> dict[str, Any]:
    bm.unpatch()
    if variant != "megatron":
        bm.patch(variant)
    model = build_gpt(size, args.device)
    if args.stash:
        add_stashes(model)
    data = batch(size, args.device)
    try:  # one step from a fresh model: a stash left by an earlier step would be in "before"
        result = step(model, data, args.device)
    except RuntimeError as err:  # "always" reads freed memory
        return {"status": f"failed: {str(err).splitlines()[0][:160]}"}
    finally:
        bm.unpatch()
        del model
        gc.collect()
    return {"status": "ok", **result}


def compare(rows: dict[str, dict[str, Any]]) -> None:
    ref = rows["megatron"]
    for name, row in rows.items():
        if row["status"] != "ok":
            print(f"{name:<10}{row['status']}")
            continue
        diff = max((row["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
        row["max_grad_diff"] = diff
        row["loss_equal"] = row["loss"] == ref["loss"]
        after, peak = row["after_step_bytes"] / 2**20, row["peak_bytes"] / 2**20
        print(f"{name:<10}{row['loss']:>12.6f}{diff:>14.3e}{after:>13.1f}{peak:>11.1f}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--stash", action="store_true", help="MoE-style stash in every decoder MLP")
    p.add_argument("--with-always", action="store_true")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace, size: dict) -> None:
    """Print the table and write the JSON (gradients left out)."""
    print(f"\nmegatron-core GPT + MTP, full recompute, {size}, stash={args.stash}")
    print(f"{'variant':<10}{'loss':>12}{'max|dgrad|':>14}{'after MiB':>13}{'peak MiB':>11}")
    compare(rows)
    plain = {k: {kk: vv for kk, vv in v.items() if kk != "grads"} for k, v in rows.items()}
    result = {"device": args.device, "size": size, "stash": args.stash,
              "torch": torch.__version__, "variants": plain}  # fmt: skip
    name = f"recompute_megatron{'-stash' if args.stash else ''}{'-quick' if args.quick else ''}"
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, device=args.device, indent=2)
    print(json.dumps({"variants": plain}))
    print(f"wrote {out}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = SIZES["quick" if args.quick else "full"]
    init_parallel(args.device)
    rows = {v: run_variant(v, args, size) for v in ("megatron", "safe")}
    report(rows, args, size)
    if args.with_always:  # reads freed memory: may crash the process, so it runs after a report
        rows["always"] = run_variant("always", args, size)
        report(rows, args, size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
