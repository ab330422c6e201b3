"""What the benchmark scripts share: device sync and timing (also of CUDA-graph replays),
model-size flags, per-device sizes, how a result JSON records paths, and `write_result`, which
stamps every result with the command line, device, torch version and git commit that made it
(`benchmarks/report.py` turns those into docs/results.md).

Scripts run as `python benchmarks/<name>.py`, so this module is importable as `common`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from birkhoff.config import ModelConfig, MoEConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str | torch.device, repeats: int, *, warmup: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` after `warmup` calls, device work included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(
    device: str | torch.device, repeats: int = 20, num_bytes: int = 1 << 30
) -> float:
    """Bytes/s of a device-to-device copy of `num_bytes` (read + write counted), median of
    `repeats` timed copies: the rate the kernels' traffic is compared with. Twenty warm-up
    copies first: after two, one H100 gave 2.33 and 2.79 TB/s in two runs (clocks still
    rising when a script measures the copy first)."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats, warmup=20)
    return 2 * num_bytes / seconds


def graph_seconds(fn: Callable[[], Any], calls: int, *, replays: int = 3) -> float:
    """Device seconds per call of `fn` on CUDA: `calls` calls captured in one CUDA graph (after
    one warm-up call on a side stream), replayed `replays` times between two events. Unlike
    timing Python-launched calls, the host's launch cost does not enter: what a step replayed
    from a graph (the engine's) or an inductor-compiled step sees. Raises whatever the capture
    raises (an op that syncs, a CPU tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def covered_us(spans: list[tuple[float, float]]) -> float:
    """Time during which at least one of the (start, end) spans runs: GPU busy time. Kernels on
    two streams (the engine's side stream) overlap, so their summed durations can exceed it."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def add_size_args(p: argparse.ArgumentParser) -> None:
    """--device, --quick and the model-size flags; sizes left None come from `apply_sizes`."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    for name in ("dim", "layers", "heads", "vocab", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--mtp", type=int, default=1)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")


def apply_sizes(args: argparse.Namespace, sizes: dict[str, dict[str, Any]]) -> None:
    """Fill every size flag left None from `sizes["quick"]` or `sizes[args.device]`."""
    for key, value in sizes["quick" if args.quick else args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def same_active_moe(cfg: ModelConfig, num_experts: int) -> ModelConfig:
    """`cfg` with MoE feed-forwards (all layers but the first, and the MTP depths) whose active
    width equals the dense SwiGLU's: one shared + top-3 routed experts of a quarter of its width
    (rounded down to a multiple of 8, which the grouped GEMM's 16-byte rule needs for bf16)."""
    hidden = max(8, cfg.ffn_dim // 4 // 8 * 8)
    moe = MoEConfig(num_experts=num_experts, experts_per_token=min(3, num_experts),
                    expert_hidden=hidden)  # fmt: skip
    return cfg.replace(moe=moe)


def json_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as a result JSON records them: no absolute machine path.

    A path inside the repository is recorded relative to its root (`benchmarks/results/x.json`),
    one outside it (a scratch directory on a GPU machine) by its file name only.
    """

    def record(value: Any) -> Any:
        if not isinstance(value, Path):
            return value
        path = value.resolve()
        return (
            path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
        )

    return {key: record(value) for key, value in vars(args).items()}


def git_commit() -> str:
    """Short hash of the checked-out commit, `-dirty` when tracked files differ from it."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def device_name(device: str | torch.device | None = None) -> str:
    """The accelerator's name (`NVIDIA H200`), or `cpu (N threads)` without one."""
    dev = torch.device(
        device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    )
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({torch.get_num_threads()} threads)"


def run_meta(device: str | torch.device | None = None) -> dict[str, str]:
    """What made a result: the command line as typed, device, torch version, commit, date."""
    script = Path(sys.argv[0]).resolve()
    shown = (
        script.relative_to(REPO_ROOT).as_posix()
        if script.is_relative_to(REPO_ROOT)
        else script.name
    )
    launcher = ["python"]
    if "LOCAL_WORLD_SIZE" in os.environ:  # started by torchrun
        launcher = ["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
    return {
        "command": shlex.join([*launcher, shown, *sys.argv[1:]]),
        "device": device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
    }


def write_result(
    out: Path, result: dict[str, Any], *, device: str | torch.device | None = None, **dump: Any
) -> None:
    """Write `result` as JSON to `out` with a `meta` record (`run_meta`) added; `dump` goes to
    `json.dumps` (indent, sort_keys)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "meta": run_meta(device)}, **dump) + "\n")
