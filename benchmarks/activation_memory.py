"""What a training step saves for the backward, per token and per module kind, S=4 vs S=1.

Legend: B batch, T tokens, S streams, D model dim.

Runs one forward of `train_step.py`'s model (fused mHC ops; on CPU through the Triton
interpreter, so use a small size) under bf16 autocast with a saved-tensor hook that charges each
newly saved storage (parameters excluded, each storage once) to the innermost module running
when it was saved, and prints KiB per token for every module kind, for each variant, and the
difference S4 - S1. Scaling those to the h200-small step (B x T tokens, its layers) says what
the S=4 activations cost; the peaks themselves are measured by train_step.py on the GPU.

  TRITON_INTERPRET=1 python benchmarks/activation_memory.py              # dim 128, CPU
  python benchmarks/activation_memory.py --device cuda --dim 768 --layers 16
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import write_result
from torch import Tensor, nn
from train_step import RESULTS, model_config

from birkhoff.model import Transformer


def saved_bytes_by_module(
    model: Transformer, ids_BT: Tensor, device: torch.device
) -> dict[str, int]:
    """Bytes of the storages autograd saves in one forward, by the saving module's class."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    stack: list[str] = ["(model)"]
    charged: dict[str, int] = defaultdict(int)

    def enter(module: nn.Module, _args: Any) -> None:
        stack.append(type(module).__name__)

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            charged[stack[-1]] += t.untyped_storage().nbytes()
        return t

    handles = [m.register_forward_pre_hook(enter) for m in model.modules() if m is not model]
    handles += [m.register_forward_hook(leave) for m in model.modules() if m is not model]
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = model(ids_BT, labels=ids_BT)
        assert out.loss is not None
    finally:
        for h in handles:
            h.remove()
    return dict(charged)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--variants", default="S1_M1,S4_M1", help="first one is the baseline")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--residual-dtype", choices=("fp32", "autocast"), default="fp32")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    size = dict(dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq)
    tokens = args.batch * args.seq
    per_token: dict[str, dict[str, float]] = {}
    for name in args.variants.split(","):
        streams, mtp = (int(part[1:]) for part in name.split("_"))
        torch.manual_seed(0)
        cfg = model_config(size, streams, mtp, "triton", args.residual_dtype)
        model = Transformer(cfg).to(device)
        ids_BT = torch.randint(0, model.cfg.vocab_size, (args.batch, args.seq), device=device)
        saved = saved_bytes_by_module(model, ids_BT, device)
        per_token[name] = {k: v / tokens / 1024 for k, v in saved.items()}
    names = list(per_token)
    kinds = sorted(set().union(*per_token.values()), key=lambda k: -per_token[names[-1]].get(k, 0))
    print(f"KiB saved per token, dim {args.dim}, {args.layers} layers (+ MTP), bf16 autocast, "
          f"residual {args.residual_dtype}")  # fmt: skip
    print(f"{'module':<24}" + "".join(f"{n:>10}" for n in names) + f"{'diff':>10}")
    for k in [*kinds, "total"]:
        vals = [
            sum(per_token[n].values()) if k == "total" else per_token[n].get(k, 0.0) for n in names
        ]
        print(f"{k:<24}" + "".join(f"{v:>10.2f}" for v in vals) + f"{vals[-1] - vals[0]:>10.2f}")
    result = {"args": vars(args) | {"out": str(args.out)}, "kib_per_token": per_token}
    suffix = "" if args.residual_dtype == "fp32" else f"-residual-{args.residual_dtype}"
    out = args.out or RESULTS / f"activation_memory-{args.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, device=args.device, indent=2)
    print(json.dumps({n: round(sum(v.values()), 2) for n, v in per_token.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
