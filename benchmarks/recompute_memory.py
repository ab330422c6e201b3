"""Peak memory and step time of one training step under each recompute variant.

Variants, all on the same mHC + MTP model and batch:
  none              no recompute (every activation kept for backward)
  torch_checkpoint  torch.utils.checkpoint (non-reentrant) around every block and MTP depth
  never             birkhoff checkpoint, reclaim="never" (plain recompute, no registry)
  safe              birkhoff checkpoint, reclaim="safe" (inputs released right after the rerun)
  safe_tracked      "safe" inside track_saved_storages() (census and sanitizer bookkeeping),
                    as the training step runs it
  always            birkhoff checkpoint, reclaim="always" (the unconditional free; --with-always)
A step is forward + loss + backward + AdamW step, after one warm-up step (optimizer state exists).
Step time: the median of --repeats steps, the variants' steps interleaved one by one so that
load on the machine hits every variant alike ("always" is not timed).
Peak memory: on CPU the peak of live tensor bytes allocated during the step (a dispatch mode
that re-reads storage sizes after every op); on CUDA `torch.cuda.max_memory_allocated` minus the
bytes allocated before the step (parameters, gradients-free, optimizer state), bf16 autocast.
After-step memory: what is still allocated after the step (gradients, optimizer state and any
leak) above what was allocated before it; "leak": the after-step bytes beyond the gradients,
parameters and optimizer state (what something kept alive; 0 when nothing leaks). Ratios are
reported against "never" and "torch_checkpoint" measured in the same run.

With --moe every variant runs on an MoE model (MoE feed-forwards in every layer but the first
and in the MTP depth: --experts experts, top-3 plus one shared expert of a quarter of the dense
width, so the active width equals the dense model's; common.same_active_moe), and its memory is
measured again on the dense model of the same shape (rows `dense_*`, not timed): the MoE model's
leak must equal the dense model's (`*_moe_leak_minus_dense` = 0).

Stash leak (printed after the table): a stack of MLP blocks, each checkpointed, each keeping a
recomputed tensor on `self` (as MoE dispatchers do). Bytes still allocated after the step with
torch's reentrant checkpoint (megatron's CheckpointFunction is built the same way: the stash's
graph keeps the block's input and its .grad), torch's non-reentrant one and ours ("safe"); the
difference reentrant - safe is the memory the rerun aliases and gradient sinks recover.

  python benchmarks/recompute_memory.py --device cpu --quick
  python benchmarks/recompute_memory.py --device cpu
  python benchmarks/recompute_memory.py --device cuda          # ~120M params, S=4, M=1, T=2048
  python benchmarks/recompute_memory.py --device cuda --moe    # the same trunk with MoE layers
  compute-sanitizer --tool memcheck python benchmarks/recompute_memory.py --device cuda \
      --sanitizer-case always [--kernels eager] [--moe] [--check]      # or --sanitizer-case safe
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from common import add_size_args, apply_sizes, json_args, same_active_moe, sync, write_result
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.hyper import apply_kernels
from birkhoff.recompute import (
    PeakLiveBytes,
    UseAfterFreeError,
    checkpoint,
    sanitize,
    track_saved_storages,
)
from birkhoff.recompute.registry import storage_key
from birkhoff.train.recompute import apply_checkpoint, apply_recompute

VARIANTS = ("none", "torch_checkpoint", "never", "safe", "safe_tracked")
RESULTS = Path(__file__).resolve().parent / "results"


def model_config(args: argparse.Namespace, *, moe: bool = False) -> ModelConfig:
    cfg = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
        num_streams=args.streams, mtp_depth=args.mtp, max_seq_len=args.seq,
    )  # fmt: skip
    return same_active_moe(cfg, args.experts) if moe else cfg


def torch_checkpointed(fn: Callable[..., Tensor], *args: Tensor, name: str) -> Tensor:
    out = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    assert isinstance(out, Tensor)
    return out


def build(
    args: argparse.Namespace, variant: str, *, moe: bool | None = None
) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model (MoE if `moe`, default args.moe) with `variant`'s recompute, and its AdamW."""
    torch.manual_seed(0)
    moe = args.moe if moe is None else moe
    model = Transformer(model_config(args, moe=moe)).to(args.device)
    if variant == "torch_checkpoint":
        apply_checkpoint(model, torch_checkpointed)
    elif variant != "none":
        apply_recompute(model, reclaim={"safe_tracked": "safe"}.get(variant, variant))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model: Transformer, opt: torch.optim.Optimizer, ids: Tensor, variant: str) -> None:
    opt.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        if ids.is_cuda:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        if variant in ("safe_tracked", "always"):  # "always" needs it for the sanitizer case
            stack.enter_context(track_saved_storages())
        loss = model(ids, labels=ids).loss
    assert loss is not None
    loss.backward()
    opt.step()


@contextlib.contextmanager
def peak_meter(device: str, exclude: Collection[int] = ()) -> Iterator[dict[str, int]]:
    """Yields a dict filled with the bytes live before, the peak and the bytes left after
    ("owned_after": the same less the storages keyed in `exclude`; on CUDA they are in "before",
    on CPU in-place ops on them make the dispatch mode see them)."""
    result: dict[str, int] = {}
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield result
        gc.collect()
        sync(device)
        result["before"], result["peak"] = base, torch.cuda.max_memory_allocated() - base
        result["after"] = result["owned_after"] = torch.cuda.memory_allocated() - base
        return
    with PeakLiveBytes() as tracker:
        yield result
    gc.collect()
    result["before"], result["peak"], result["after"] = 0, tracker.peak_bytes, tracker.live_bytes()
    result["owned_after"] = tracker.live_bytes(exclude=exclude)


def owned_storages(model: Transformer, opt: torch.optim.Optimizer) -> set[int]:
    """Storage keys of parameters, buffers and optimizer state: what outlives a step by design."""
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
    keys = (storage_key(t) for t in [*model.parameters(), *model.buffers(), *state])
    return {k for k in keys if k is not None}


def measure(
    args: argparse.Namespace, variant: str, ids: Tensor, *, moe: bool | None = None
) -> dict[str, Any]:
    """Peak and after-step memory of one step (after a warm-up step), one variant at a time."""
    model, opt = build(args, variant, moe=moe)
    try:
        train_step(model, opt, ids, variant)  # warm-up: optimizer state, allocator pools
        with peak_meter(args.device, owned_storages(model, opt)) as mem:
            train_step(model, opt, ids, variant)
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    except RuntimeError as err:  # "always" may read freed storage
        return {"status": f"failed: {str(err).splitlines()[0][:160]}"}
    finally:
        del model, opt
        release_memory(args.device)
    return {"status": "ok", "peak_bytes": mem["peak"], "bytes_before_step": mem["before"],
            "after_step_bytes": mem["after"], "leak_bytes": mem["owned_after"] - grads}  # fmt: skip


def time_interleaved(
    args: argparse.Namespace, variants: list[str], ids: Tensor
) -> dict[str, float]:
    """Median step time per variant, variants interleaved step by step, so that load on the
    machine (other processes, clocks) falls on all of them alike."""
    built = {v: build(args, v) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v, (model, opt) in built.items():
        train_step(model, opt, ids, v)  # warm-up
    for _ in range(args.repeats):
        for v, (model, opt) in built.items():
            sync(args.device)
            start = time.perf_counter()
            train_step(model, opt, ids, v)
            sync(args.device)
            times[v].append(time.perf_counter() - start)
    del built
    release_memory(args.device)
    return {v: 1e3 * statistics.median(t) for v, t in times.items()}


def release_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        # After an illegal memory access (reclaim="always") the CUDA context is unusable and
        # this raises too; "always" runs last, so the other rows are already measured.
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    ok = {k: v for k, v in rows.items() if v["status"] == "ok"}
    out: dict[str, float] = {}
    if "safe" in ok and "never" in ok:
        out["safe_peak_over_never"] = ok["safe"]["peak_bytes"] / ok["never"]["peak_bytes"]
        out["safe_step_overhead"] = ok["safe"]["step_ms"] / ok["never"]["step_ms"] - 1.0
    if "safe_tracked" in ok and "never" in ok:
        tracked = ok["safe_tracked"]
        out["tracked_step_overhead"] = tracked["step_ms"] / ok["never"]["step_ms"] - 1.0
        out["tracked_peak_over_never"] = tracked["peak_bytes"] / ok["never"]["peak_bytes"]
    if "safe" in ok and "torch_checkpoint" in ok:
        torch_peak = ok["torch_checkpoint"]["peak_bytes"]
        out["safe_peak_over_torch_checkpoint"] = ok["safe"]["peak_bytes"] / torch_peak
    if "safe" in ok and "none" in ok:
        out["safe_peak_over_no_recompute"] = ok["safe"]["peak_bytes"] / ok["none"]["peak_bytes"]
    for variant in VARIANTS:  # --moe: the MoE model's leak minus the dense model's
        if variant in ok and f"dense_{variant}" in ok:
            dense = ok[f"dense_{variant}"]["leak_bytes"]
            out[f"{variant}_moe_leak_minus_dense"] = ok[variant]["leak_bytes"] - dense
    return out


def print_table(rows: dict[str, dict[str, Any]], device: str) -> None:
    ref = rows.get("never", {})
    print(f"\n{'variant':<22}{'peak MiB':>11}{'vs never':>10}{'after MiB':>11}"
          f"{'leak MiB':>10}{'step ms':>10}{'vs never':>10}")  # fmt: skip
    for name, row in rows.items():
        if row["status"] != "ok":
            print(f"{name:<22}{row['status']}")
            continue
        peak, ms, after = row["peak_bytes"], row.get("step_ms", math.nan), row["after_step_bytes"]
        rel_peak = peak / ref["peak_bytes"] if ref.get("status") == "ok" else float("nan")
        rel_ms = ms / ref["step_ms"] if ref.get("status") == "ok" else float("nan")
        print(f"{name:<22}{peak / 2**20:>11.2f}{rel_peak:>10.3f}{after / 2**20:>11.2f}"
              f"{row['leak_bytes'] / 2**20:>10.3f}{ms:>10.1f}{rel_ms:>10.3f}")  # fmt: skip
    cuda_what = "torch.cuda.max_memory_allocated above the bytes allocated before the step"
    cpu_what = "peak live bytes of tensors allocated during the step"
    print(f"(peak: {cuda_what if device == 'cuda' else cpu_what})")


class StashBlock(nn.Module):
    """An MLP block that keeps its latest hidden activation on `self` (an MoE-style stash)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.stash: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.relu(self.up(x))
        self.stash = hidden[:, :8]  # a view: keeps `hidden` (and, via its graph, the input)
        return x + self.down(hidden)


def stash_leak(args: argparse.Namespace) -> dict[str, int]:
    """Bytes left allocated after one step of a stashing block stack, per checkpoint kind."""
    tokens, dim = args.batch * args.seq, args.dim
    kinds: dict[str, Callable[..., Tensor]] = {
        "torch_reentrant": lambda f, x: tuc.checkpoint(f, x, use_reentrant=True),
        "torch_checkpoint": lambda f, x: tuc.checkpoint(f, x, use_reentrant=False),
        "safe": lambda f, x: checkpoint(f, x, reclaim="safe"),
    }
    out = {}
    for name, wrap in kinds.items():
        torch.manual_seed(0)
        blocks = nn.ModuleList(StashBlock(dim) for _ in range(args.layers)).to(args.device)
        x0 = torch.randn(tokens, dim, device=args.device, requires_grad=True)
        with peak_meter(args.device) as mem:
            h = x0 * 1.0
            for block in blocks:
                h = wrap(block, h)
            h.square().mean().backward()
            del h
        out[name] = mem["after"]
        del blocks, x0
        release_memory(args.device)
    out["recovered_vs_reentrant"] = out["torch_reentrant"] - out["safe"]
    return out


def sanitizer_steps(
    args: argparse.Namespace, reclaim: str, ids: Tensor
) -> tuple[list[float], dict[str, Tensor]]:
    """`args.sanitizer_steps` training steps with `reclaim`: the losses and the last gradients."""
    cfg = model_config(args, moe=args.moe)
    torch.manual_seed(0)
    model = apply_kernels(Transformer(cfg).to(args.device), args.kernels)
    model = apply_recompute(model, reclaim=reclaim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(args.sanitizer_steps):
        opt.zero_grad(set_to_none=True)
        with track_saved_storages():
            loss = model(ids, labels=ids).loss
        assert loss is not None
        loss.backward()
        sync(args.device)
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads


def run_sanitizer_case(args: argparse.Namespace) -> int:
    """The seed's bug ("always") and its fix ("safe") on a small mHC + MTP model, for memcheck.

    "always" must fail: with --check birkhoff's sanitizer raises UseAfterFreeError naming the
    node and the checkpoint; without it the output contraction's backward reads the storage
    MTP's checkpoint freed (memcheck counts the reads). "safe" must complete with the losses and
    gradients of "never" on the same model and inputs. Exit status 1 when a step fails.
    """
    # Without the caching allocator a freed storage goes back to the driver, so memcheck sees
    # any later read of it. Read at the first CUDA allocation, so setting it here is in time.
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    small = argparse.Namespace(**{**vars(args), "dim": 128, "layers": 2, "heads": 4,
                                  "seq": 256, "vocab": 512})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, small.vocab, (2, small.seq), generator=gen).to(args.device)
    case = args.sanitizer_case
    model = f"{'MoE' if args.moe else 'dense'} S={args.streams} M={args.mtp}"
    check = "on" if args.check else "off"
    print(
        f"sanitizer case {case}: {model}, kernels={args.kernels}, "
        f"{args.sanitizer_steps} steps, birkhoff sanitizer {check}"
    )
    try:
        with sanitize() if args.check else contextlib.nullcontext():
            losses, grads = sanitizer_steps(small, case, ids)
    except UseAfterFreeError as err:
        print(f"sanitizer case {case}: UseAfterFreeError: {err}")
        return 1
    except RuntimeError as err:  # torch.AcceleratorError is a RuntimeError
        print(f"sanitizer case {case}: step failed: {str(err).splitlines()[0]}")
        return 1
    print(f"sanitizer case {case}: {len(losses)} steps completed, losses {losses}")
    if case != "safe":
        return 0
    ref_losses, ref_grads = sanitizer_steps(small, "never", ids)
    diff = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    same = losses == ref_losses and grads.keys() == ref_grads.keys() and diff == 0.0
    print(f"sanitizer case safe: identical to reclaim='never': {same} (max |grad diff| {diff:.3g})")
    return 0 if same else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_size_args(p)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--with-always", action="store_true", help="also run reclaim='always' last")
    p.add_argument("--sanitizer-case", choices=("always", "safe"))
    p.add_argument("--sanitizer-steps", type=int, default=2, help="steps of --sanitizer-case")
    p.add_argument(
        "--check",
        action="store_true",
        help="--sanitizer-case under birkhoff's own sanitizer (UseAfterFreeError)",
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "eager", "triton"),
        default="auto",
        help="mHC kernels of --sanitizer-case",
    )
    p.add_argument("--moe", action="store_true", help="MoE model, next to the dense one")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (--moe)")
    args = p.parse_args(argv)
    sizes = {
        "cuda": dict(dim=768, layers=12, heads=12, vocab=16384, seq=2048, batch=4, repeats=10),
        "cpu": dict(dim=96, layers=3, heads=4, vocab=1024, seq=128, batch=2, repeats=3),
        "quick": dict(dim=64, layers=2, heads=4, vocab=256, seq=64, batch=2, repeats=2),
    }
    apply_sizes(args, sizes)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.sanitizer_case:
        return run_sanitizer_case(args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    with torch.device("meta"):
        model = Transformer(model_config(args, moe=args.moe))
    num_params = sum(p.numel() for p in model.parameters())
    shape = f"dim={args.dim} layers={args.layers} S={args.streams} M={args.mtp}"
    shape += f" MoE {args.experts} experts top-3 + 1 shared" if args.moe else ""
    print(
        f"device={args.device} params={num_params / 1e6:.1f}M {shape} B={args.batch} T={args.seq}"
    )
    variants = VARIANTS + (("always",) if args.with_always else ())
    rows = {}
    for variant in variants:
        rows[variant] = measure(args, variant, ids)
        print(f"  {variant}: {rows[variant]}")
    for variant in VARIANTS if args.moe else ():  # the dense model of the same shape
        rows[f"dense_{variant}"] = measure(args, variant, ids, moe=False)
        print(f"  dense_{variant}: {rows[f'dense_{variant}']}")
    timed = [v for v in variants if rows[v]["status"] == "ok" and v != "always"]
    for variant, ms in time_interleaved(args, timed, ids).items():
        rows[variant].update(step_ms=ms, num_timed_steps=args.repeats)
    print_table(rows, args.device)
    leak = stash_leak(args)
    print("stash leak, MiB left after the step: "
          + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in leak.items()))  # fmt: skip
    summary = ratios(rows)
    for key, value in summary.items():
        print(f"{key}: {value:+.4f}" if "overhead" in key else f"{key}: {value:.4f}")
    config = json_args(args)
    report = {"device": args.device, "num_params": num_params, "config": config,
              "torch": torch.__version__, "variants": rows, "ratios": summary,
              "stash_leak_after_step_bytes": leak}  # fmt: skip
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    tags = ("-moe" if args.moe else "") + ("-quick" if args.quick else "")
    out = args.out or RESULTS / f"recompute_memory-{args.device}{tags}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report, device=args.device, indent=2)
    print(json.dumps({"ratios": summary, "stash_leak_after_step_bytes": leak}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
