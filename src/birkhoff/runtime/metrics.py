"""The one metrics log of every job: metrics.jsonl and the memory figures.

Each line of metrics.jsonl is one JSON object with `step` and `phase` ("sft" | "grpo" | "eval"),
written by `birkhoff train` and `birkhoff run` alike, flushed and fsynced as written, so a crashed
run keeps its history. Every row is stamped with `timestamp` (UTC, ISO 8601) and `elapsed_s`
(seconds of run time: a resumed run goes on from the last kept row's figure, the time it was
stopped not counted). Those, timing (`*_s`, `*_gb_s`) and memory (`mem_*`) keys vary between
runs; every other value is deterministic on CPU for a fixed seed, which the resume tests rely on.
Trackers (runtime/tracking.py: TensorBoard, W&B) get each row as written; the plot is plots.py.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from birkhoff.runtime.checkpoint import atomic_write_bytes

if TYPE_CHECKING:
    from birkhoff.runtime.tracking import Tracker


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak memory figure afresh (CUDA; the CPU figure is the process's peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak GPU bytes since `reset_peak_memory` (CUDA) or the process's peak RSS (CPU), in MiB.

    CUDA also reports the bytes the caching allocator holds (`mem_reserved_mib`): a step replayed
    from a CUDA graph (TrainConfig.cuda_graph) allocates nothing while it runs, its activations
    live in the graph's pool, which counts there and not in the peak."""
    if device.type == "cuda":
        return {
            "mem_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "mem_reserved_mib": torch.cuda.memory_reserved(device) / 2**20,
        }
    return {"mem_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class MetricsLog:
    """Append-only JSON lines, flushed per line; `truncate_after` rewrites atomically.

    `last` holds the floats of the latest row plus those of the latest eval, for the progress
    display.
    """

    def __init__(
        self,
        path: Path,
        *,
        trackers: Sequence[Tracker] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path, self.trackers, self.clock = path, list(trackers), clock
        self.last: dict[str, Any] = {}
        self.started, self.elapsed_before = clock(), 0.0

    def append(self, row: dict[str, Any]) -> None:
        """Write `row`, stamped with the time, and hand it to the trackers."""
        now = self.clock()
        row = row | {
            "timestamp": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"),
            "elapsed_s": round(self.elapsed_before + now - self.started, 3),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for tracker in self.trackers:
            tracker.log(row)
        floats = {k: v for k, v in row.items() if isinstance(v, float)}
        if row.get("phase") != "eval":  # keep the latest eval, drop the other phase's keys
            self.last = {k: v for k, v in self.last.items() if k.startswith("eval_")}
        self.last.update(floats)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Keep the rows of the first `step` steps, which a checkpoint at `step` holds (a resumed
        run rewrites what follows): train rows count from 0 (the row of step k is the (k+1)-th
        step), eval rows count steps completed."""
        kept = [r for r in self.rows() if r["step"] < step + (r.get("phase") == "eval")]
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
        atomic_write_bytes(self.path, text.encode())
        self.started = self.clock()  # run time goes on from the last kept row's
        self.elapsed_before = float(kept[-1].get("elapsed_s", 0.0)) if kept else 0.0

    def close(self) -> None:
        """Close the trackers (metrics.jsonl itself is closed after every row)."""
        for tracker in self.trackers:
            tracker.close()

    def postfix(self) -> dict[str, str]:
        """The figures the progress display shows, three decimals each."""
        keys = ("main_loss", "mtp_loss", "seq_acc", "reward", "eval_reward", "accept_1")
        return {k: f"{self.last[k]:.3f}" for k in keys if k in self.last}
