"""Device ops a decode step dispatches: torch kernels and fused custom ops, per step kind.

At decode sizes a step costs its launches, not its bytes, so the number of ops a step issues is
the figure its glue (chunk building, sampling, acceptance, bookkeeping) moves. Builds an engine
with fused kernels (S=4, M=1, random weights; on CPU the Triton interpreter runs the
kernels: `TRITON_INTERPRET=1`), generates plain and speculative (k drafts), and counts what
one step dispatches (a `TorchDispatchMode` around the step function): every aten op and custom
op but views, allocations and no-op casts or copies; an op counts once however many kernels it
launches. Eager steps on the active rows (no CUDA graphs), so the count is the step's, not a
replay's. Prints a table per step kind and ends with a JSON line.

  TRITON_INTERPRET=1 python benchmarks/step_ops.py                  # CPU, tiny dims
  python benchmarks/step_ops.py --device cuda --dim 768 --layers 16 --heads 12
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from common import json_args
from torch.utils._python_dispatch import TorchDispatchMode

import birkhoff.engine.decode as decode
from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer

# ops that launch nothing (views, metadata, allocations)
FREE = {"view", "unsqueeze", "squeeze", "select", "slice", "expand", "alias", "t", "detach",
        "split", "split_with_sizes", "unbind", "_unsafe_view", "as_strided", "empty",
        "new_empty", "empty_like", "empty_strided", "lift_fresh", "reshape", "permute",
        "transpose", "_reshape_alias", "resolve_conj", "resolve_neg", "is_same_size",
        "expand_as"}  # fmt: skip


class StepOps(TorchDispatchMode):
    """Counts the ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        no_op = name in ("to", "contiguous") and out is (args[0] if args else None)
        if name not in FREE and not no_op:
            self.ops[str(func).removesuffix(".default")] += 1
        return out


def counted(fn: Callable[..., Any], kind: str, seen: dict[str, list[Counter[str]]]) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        with StepOps() as mode:
            result = fn(*args, **kwargs)
        seen[kind].append(mode.ops)
        return result

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--k", type=int, default=2, help="drafts of a speculative step")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="ops listed per step kind")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                      num_heads=args.heads, num_streams=4, mtp_depth=1, max_seq_len=64)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).eval()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = Engine.from_model(
        model, device=device, dtype=dtype, cuda_graphs=False, kernels="triton"
    )
    seen: dict[str, list[Counter[str]]] = defaultdict(list)
    for kind in ("plain_step", "speculative_step"):
        setattr(decode, kind, counted(getattr(decode, kind), kind, seen))
    prompts = [[1 + i, 2, 3, 4][: 2 + i % 3] for i in range(args.batch)]
    engine.generate(prompts, SamplingParams(6))
    engine.generate(prompts, SamplingParams(6, num_speculative_tokens=args.k))
    result: dict[str, Any] = {"args": json_args(args)}
    for kind, steps in seen.items():
        ops = steps[-1]  # a steady-state step (every row still running)
        fused = sum(n for name, n in ops.items() if name.startswith("birkhoff."))
        result[kind] = {"ops": sum(ops.values()), "fused_ops": fused, "by_op": dict(ops)}
        print(f"{kind}: {sum(ops.values())} ops a step ({fused} fused), {args.layers} layers")
        for name, n in ops.most_common(args.top):
            print(f"  {n:4d}  {name}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
