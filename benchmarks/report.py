"""Write docs/results.md from benchmarks/results/: one table of current figures per benchmark.

Each figure names the result file it is read from; each file records the command, device, torch
version and commit that made it (`meta`, written by `common.write_result`). Result files that no
figure reads (earlier variants of a change, launch-parameter sweeps) are listed as history under
their benchmark, with the note in docs/log/ that tells their story.

    python benchmarks/report.py           # rewrite docs/results.md
    python benchmarks/report.py --check   # exit 1 if docs/results.md differs (tests run this)

To make a new measurement current, point its figures at the new file in `SECTIONS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
OUT = REPO_ROOT / "docs" / "results.md"


@cache
def load(name: str) -> Any:
    """A result file: a JSON object, or the rows of a JSONL metrics file."""
    text = (RESULTS / name).read_text()
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def get(data: Any, path: str) -> Any:
    """`a/b/key=value/c`: dict keys, list indices, or the list element whose `key` is `value`."""
    for part in path.split("/"):
        if isinstance(data, list):
            if "=" in part:
                key, value = part.split("=", 1)
                data = next(row for row in data if str(row[key]) == value)
            else:
                data = data[int(part)]
        else:
            data = data[part]
    return data


# --- formatting -------------------------------------------------------------------------------


def num(path: str, fmt: str = ",.0f", *, scale: float = 1.0, unit: str = "") -> Reader:
    return lambda d: f"{get(d, path) * scale:{fmt}}{unit}"


def ratio(top: str, bottom: str, fmt: str = ".2f") -> Reader:
    return lambda d: f"{get(d, top) / get(d, bottom):{fmt}}x"


def joined(*readers: Reader, sep: str = " / ") -> Reader:
    return lambda d: sep.join(r(d) for r in readers)


def evals(key: str) -> Reader:
    """A run's held-out figure at the end of the warm-up -> at the end."""

    def read(rows: list[dict[str, Any]]) -> str:
        values = [row[key] for row in rows if row.get("phase") == "eval"]
        return f"{values[0]:.3f} -> {values[-1]:.3f}"

    return read


def grpo_median(key: str, fmt: str, *, scale: float = 1.0, unit: str = "") -> Reader:
    """The median over a run's GRPO steps of `key`."""

    def read(rows: list[dict[str, Any]]) -> str:
        median = statistics.median(row[key] for row in rows if row.get("phase") == "grpo")
        return f"{median * scale:{fmt}}{unit}"

    return read


def update_peaks(vocab: int) -> Reader:
    """grpo_memory.py's peak of one update, before -> after (GiB), and their ratio."""

    def read(data: dict[str, Any]) -> str:
        rows = {r["path"]: r for r in data["rows"] if r["vocab"] == vocab}
        peaks = [rows[p].get("peak_bytes") for p in ("before", "after")]
        text = " -> ".join(
            rows[p]["status"] if b is None else f"{b * GiB:.2f} GiB"
            for p, b in zip(("before", "after"), peaks, strict=True)
        )
        return text if None in peaks else f"{text} ({peaks[0] / peaks[1]:.2f}x)"

    return read


Reader = Callable[[Any], str]


@dataclass(frozen=True)
class Figure:
    label: str
    file: str
    read: Reader


@dataclass(frozen=True)
class Run:
    """A `birkhoff run` whose metrics file has no `meta` record: its command and device."""

    file: str
    command: str
    device: str
    commit: str


@dataclass(frozen=True)
class Section:
    title: str
    script: str
    log: str
    prefixes: tuple[str, ...]
    figures: list[Figure]
    runs: list[Run] = field(default_factory=list)
    notes: str = ""


GiB = 1 / 2**30
tok = ",.0f"
MAIN_RUN = "birkhoff run --preset tiny-cpu --out runs/default --overwrite"

SECTIONS = [
    Section(
        "Main job",
        "`birkhoff run`",
        "grpo.md",
        ("run-", "grpo_variants"),
        [
            Figure(
                "tiny-cpu: held-out greedy reward, warm-up end -> end",
                "run-tiny-cpu.jsonl",
                evals("eval_reward"),
            ),
            Figure(
                "tiny-cpu: held-out sampled reward",
                "run-tiny-cpu.jsonl",
                evals("eval_sampled_reward"),
            ),
            Figure(
                "tiny-cpu: draft-1 acceptance (median GRPO step)",
                "run-tiny-cpu.jsonl",
                grpo_median("accept_1", ".2f"),
            ),
            Figure(
                "tiny-cpu: generate / train s per GRPO step",
                "run-tiny-cpu.jsonl",
                joined(grpo_median("generate_s", ".3f"), grpo_median("train_s", ".3f")),
            ),
            Figure(
                "smollm2-grpo (SmolLM2-135M, S=4 M=1): held-out greedy accuracy",
                "run-smollm2-grpo-cuda.jsonl",
                evals("eval_reward"),
            ),
            Figure(
                "smollm2-grpo: held-out sampled accuracy (temperature 0.7)",
                "run-smollm2-grpo-cuda.jsonl",
                evals("eval_sampled_reward"),
            ),
            Figure(
                "smollm2-grpo: generate / train / refit s per GRPO step",
                "run-smollm2-grpo-cuda.jsonl",
                joined(
                    grpo_median("generate_s", ".3f"),
                    grpo_median("train_s", ".3f"),
                    grpo_median("refit_s", ".4f"),
                ),
            ),
            Figure(
                "smollm2-grpo: rollout completion tokens/s / mean completion tokens",
                "run-smollm2-grpo-tokens-cuda.jsonl",
                joined(
                    grpo_median("rollout_tok_s", ",.0f"), grpo_median("completion_tokens", ".1f")
                ),
            ),
            Figure(
                "smollm2-grpo: draft-1 acceptance in rollouts (median GRPO step)",
                "run-smollm2-grpo-cuda.jsonl",
                grpo_median("accept_1", ".2f"),
            ),
            Figure(
                "smollm2-grpo: peak memory in a GRPO step",
                "run-smollm2-grpo-cuda.jsonl",
                grpo_median("mem_peak_mib", ".1f", scale=1 / 1024, unit=" GiB"),
            ),
            Figure(
                "smollm2-grpo-dense (S=1 M=0): held-out greedy accuracy",
                "run-smollm2-grpo-dense-cuda.jsonl",
                evals("eval_reward"),
            ),
            Figure(
                "smollm2-grpo-dense: generate / train / refit s per GRPO step",
                "run-smollm2-grpo-dense-cuda.jsonl",
                joined(
                    grpo_median("generate_s", ".3f"),
                    grpo_median("train_s", ".3f"),
                    grpo_median("refit_s", ".4f"),
                ),
            ),
            Figure(
                "smollm2-grpo-dense: peak memory in a GRPO step",
                "run-smollm2-grpo-dense-cuda.jsonl",
                grpo_median("mem_peak_mib", ".1f", scale=1 / 1024, unit=" GiB"),
            ),
            Figure(
                "h200-learn (CPU): held-out greedy reward",
                "run-h200-learn-cpu.jsonl",
                evals("eval_reward"),
            ),
            Figure(
                "h200-learn (CPU): held-out sampled reward",
                "run-h200-learn-cpu.jsonl",
                evals("eval_sampled_reward"),
            ),
            Figure(
                "h200-learn: held-out greedy reward",
                "run-h200-learn-cuda.jsonl",
                evals("eval_reward"),
            ),
            Figure(
                "h200-learn: held-out sampled reward",
                "run-h200-learn-cuda.jsonl",
                evals("eval_sampled_reward"),
            ),
            Figure(
                "h200-learn: generate / train s per GRPO step",
                "run-h200-learn-cuda.jsonl",
                joined(grpo_median("generate_s", ".3f"), grpo_median("train_s", ".3f")),
            ),
            Figure(
                "h200-grpo: GRPO step s (generate + train)",
                "run-h200-grpo-cuda.jsonl",
                joined(grpo_median("generate_s", ".3f"), grpo_median("train_s", ".3f")),
            ),
            Figure(
                "h200-grpo: draft-1 / draft-2 acceptance",
                "run-h200-grpo-cuda.jsonl",
                joined(grpo_median("accept_1", ".3f"), grpo_median("accept_2", ".2f")),
            ),
            Figure(
                "h200-grpo: peak memory in a GRPO step",
                "run-h200-grpo-cuda.jsonl",
                grpo_median("mem_peak_mib", ".1f", scale=1 / 1024, unit=" GiB"),
            ),
            Figure(
                "tiny-cpu-v4 (DeepSeek-V4 attention + MoE, eager): generate / train / refit s "
                "per GRPO step, draft-1 acceptance",
                "run-tiny-cpu-v4-cuda.jsonl",
                joined(
                    grpo_median("generate_s", ".3f"),
                    grpo_median("train_s", ".3f"),
                    grpo_median("refit_s", ".4f"),
                    grpo_median("accept_1", ".2f"),
                ),
            ),
        ],
        runs=[
            Run(
                "run-tiny-cpu-v4-cuda.jsonl",
                "birkhoff run --preset tiny-cpu-v4 --device cuda --steps 6 "
                "--set train.kernels=eager --out /tmp/v4",
                "NVIDIA H100 80GB HBM3",
                "e971e6a",
            ),
            Run("run-tiny-cpu.jsonl", MAIN_RUN, "cpu (2 cores)", "49dd2d0"),
            Run(
                "run-smollm2-grpo-cuda.jsonl",
                "birkhoff run --preset smollm2-grpo --device cuda --out /tmp/smollm2-grpo",
                "NVIDIA H100 80GB HBM3 (shared with the dense run)",
                "d4c2abc",
            ),
            Run(
                "run-smollm2-grpo-tokens-cuda.jsonl",
                "birkhoff run --preset smollm2-grpo --device cuda --out /tmp/s4 (stopped by "
                "SIGTERM at step 78: 58 GRPO steps)",
                "NVIDIA H100 80GB HBM3",
                "ea904fe",
            ),
            Run(
                "run-smollm2-grpo-dense-cuda.jsonl",
                "birkhoff run --preset smollm2-grpo-dense --device cuda --out /tmp/smollm2-dense",
                "NVIDIA H100 80GB HBM3 (shared with the S=4 run)",
                "d4c2abc",
            ),
            Run(
                "run-h200-learn-cpu.jsonl",
                "birkhoff run --preset h200-learn --device cpu --out runs/h200-learn-cpu",
                "cpu (2 cores)",
                "6cc7b19",
            ),
            Run(
                "run-h200-learn-cuda.jsonl",
                "birkhoff run --preset h200-learn --device cuda --out runs/h200-learn",
                "NVIDIA H200",
                "27eeac5",
            ),
            Run(
                "run-h200-grpo-cuda.jsonl",
                "birkhoff run --preset h200-grpo --device cuda",
                "NVIDIA H200",
                "de05873",
            ),
            Run(
                "run-h200-grpo-3digit-cuda.jsonl",
                "birkhoff run --preset h200-grpo --device cuda (3-digit addition, an older preset)",
                "NVIDIA H200",
                "de05873",
            ),
        ],
        notes="Rewards are held-out (128 fixed problems): greedy exact match and the sampled "
        "reward at temperature 1 that GRPO optimises. `make run` is the first row's command. "
        "The figures move with the host's float rounding (docs/log/grpo.md).",
    ),
    Section(
        "Training step",
        "`benchmarks/train_step.py`",
        "training.md",
        ("train_step", "train_profile", "activation_memory", "stream_dtype", "mhc_layer"),
        [
            Figure(
                "S=4 M=1 step (124M, T 2048, B 8, compiled, CUDA graph, bf16 streams)",
                "train_step-cuda-compile-autocast-graph-sinkhorn-layout.json",
                num("variants/S4_M1/step_ms", ".1f", unit=" ms"),
            ),
            Figure(
                "S=4 M=1 MFU",
                "train_step-cuda-compile-autocast-graph-sinkhorn-layout.json",
                num("variants/S4_M1/mfu/measured", ".1%"),
            ),
            Figure(
                "S=1 M=1 step, MFU",
                "train_step-cuda-compile-autocast-graph-sinkhorn-layout.json",
                joined(
                    num("variants/S1_M1/step_ms", ".1f", unit=" ms"),
                    num("variants/S1_M1/mfu/measured", ".1%"),
                    sep=", ",
                ),
            ),
            Figure(
                "S4 / S1 step time",
                "train_step-cuda-compile-autocast-graph-sinkhorn-layout.json",
                num("ratios/mhc_S4_over_S1_M1", ".2f", unit="x"),
            ),
            Figure(
                "S=4 M=1 peak memory",
                "train_step-cuda-compile-autocast-graph-sinkhorn-layout.json",
                num("variants/S4_M1/peak_gib", ".1f", unit=" GiB"),
            ),
            Figure(
                "S4 / S1 step time at dim 2048",
                "train_step-cuda-compile-autocast-graph-d2048.json",
                num("ratios/mhc_S4_over_S1_M1", ".2f", unit="x"),
            ),
            Figure(
                "S=4 M=1 step, compiled, no CUDA graph",
                "train_step-cuda-compile-autocast-nograph.json",
                num("variants/S4_M1/step_ms", ".1f", unit=" ms"),
            ),
            Figure(
                "S=4 M=1 step, eager mHC reference (fp32 streams)",
                "train_step-cuda-eager.json",
                num("variants/S4_M1/step_ms", ".1f", unit=" ms"),
            ),
            *(
                Figure(
                    f"two blocks at dim {dim} (T 2048 x B 8, bf16 streams): S4 / S1 per layer, "
                    "per step; folded mixes (fold_gemms) S4 / S1 per layer, per step",
                    f"mhc_layer-cuda-h100-d{dim}-bf16-fold-rows.json",
                    joined(
                        num("ratios/mhc_S4_over_S1_layer", ".3f", unit="x"),
                        num("ratios/mhc_S4_over_S1_step", ".3f", unit="x"),
                        num("ratios/mhc_S4_over_S1_layer_fold", ".3f", unit="x"),
                        num("ratios/mhc_S4_over_S1_step_fold", ".3f", unit="x"),
                    ),
                )
                for dim in (768, 2048, 4096)
            ),
            Figure(
                "h200-small, 2,000 steps: final main loss, fp32 / bf16 streams",
                "stream_dtype-cuda-h100.json",
                joined(num("runs/0/final_main_loss", ".3f"), num("runs/1/final_main_loss", ".3f")),
            ),
            Figure(
                "h200-small, 2,000 steps: max |H_res row sum - 1|, fp32 / bf16 streams",
                "stream_dtype-cuda-h100.json",
                joined(
                    num("runs/0/max_h_res_row_dev", ".3f"), num("runs/1/max_h_res_row_dev", ".3f")
                ),
            ),
        ],
    ),
    Section(
        "GRPO update memory at real vocabularies",
        "`benchmarks/grpo_memory.py`",
        "training.md",
        ("grpo_memory",),
        [
            Figure(
                f"V = {vocab:,}: peak of one update, unchunked -> chunked (small CPU trunk)",
                "grpo_memory-cpu.json",
                update_peaks(vocab),
            )
            for vocab in (49152, 151936)
        ]
        + [
            Figure(
                f"V = {vocab:,}: peak of one update, unchunked -> chunked "
                "(SmolLM2-135M trunk, S=4 M=1, 64 x 512 tokens)",
                "grpo_memory-cuda.json",
                update_peaks(vocab),
            )
            for vocab in (49152, 151936)
        ],
    ),
    Section(
        "Recompute and safe reclaim",
        "`benchmarks/recompute_memory.py`, `benchmarks/recompute_megatron.py`",
        "recompute.md",
        ("recompute_",),
        [
            Figure(
                "peak memory, safe reclaim (120M, S=4, M=1)",
                "recompute_memory-cuda.json",
                num("variants/safe/peak_bytes", ",.0f", scale=1 / 2**20, unit=" MiB"),
            ),
            Figure(
                "peak: safe / torch.utils.checkpoint",
                "recompute_memory-cuda.json",
                num("ratios/safe_peak_over_torch_checkpoint", ".3f", unit="x"),
            ),
            Figure(
                "peak: safe / no recompute",
                "recompute_memory-cuda.json",
                num("ratios/safe_peak_over_no_recompute", ".2f", unit="x"),
            ),
            Figure(
                "step time: safe vs never reclaim",
                "recompute_memory-cuda.json",
                num("ratios/safe_step_overhead", "+.1%"),
            ),
            Figure(
                "step time: census tracking on",
                "recompute_memory-cuda.json",
                num("ratios/tracked_step_overhead", "+.1%"),
            ),
            Figure(
                "megatron-core GPT + MTP: allocated after the step, stock / patched",
                "recompute_megatron.json",
                joined(
                    num("variants/megatron/after_step_bytes", ".2f", scale=GiB, unit=" GiB"),
                    num("variants/safe/after_step_bytes", ".2f", scale=GiB, unit=" GiB"),
                ),
            ),
        ],
    ),
    Section(
        "Decode and speculative decoding",
        "`benchmarks/decode.py`, `benchmarks/decode_profile.py`",
        "decode.md",
        ("decode", "gemv", "fp8-matmul", "matmul", "mhc-exit", "mhc_decode", "decode_real"),
        [
            Figure(
                "S=4 M=1 tokens/s, batch 1 / 64 / 256",
                "decode-cuda-shapes-heads-rope.json",
                joined(*(num(f"shapes/S4-M1/batch={b}/tokens_per_s", tok) for b in (1, 64, 256))),
            ),
            Figure(
                "S=4 M=1 batch 256: fraction of the bandwidth bound",
                "decode-cuda-shapes-heads-rope.json",
                num("shapes/S4-M1/batch=256/bound_fraction_copy_bw", ".3f"),
            ),
            Figure(
                "S=1 M=0 tokens/s, batch 1 / 64 / 256",
                "decode-cuda-shapes-heads-rope.json",
                joined(*(num(f"shapes/S1-M0/batch={b}/tokens_per_s", tok) for b in (1, 64, 256))),
            ),
            Figure(
                "spec model (dim 256, 4 layers): speculative k=2 / plain, batch 1 / 32",
                "decode-cuda-h100-spec-depth-inputs.json",
                joined(
                    num("spec_b1_k2_speedup", ".2f", unit="x"),
                    num("spec_b32_k2_speedup", ".2f", unit="x"),
                ),
            ),
            Figure(
                "speculative k=2 / plain at acceptance 1.0 (the dim-768 trunk), batch 1 / 32",
                "decode-cuda-spec-768.json",
                joined(
                    num("spec/1/speedup", ".2f", unit="x"), num("spec/3/speedup", ".2f", unit="x")
                ),
            ),
            Figure(
                "spec model: k=2 acceptance of drafts 1 / 2, batch 1",
                "decode-cuda-h100-spec-depth-inputs.json",
                joined(num("spec/2/acceptance/0", ".2f"), num("spec/2/acceptance/1", ".2f")),
            ),
            Figure(
                "SmolLM2-135M decode tokens/s, dense, batch 1 / 64",
                "decode_real-cuda-h100.json",
                joined(num("smollm2_dense_b1_tok_s", tok), num("smollm2_dense_b64_tok_s", tok)),
            ),
            Figure(
                "SmolLM2-135M upcycled S=4 M=1 decode tokens/s, batch 1 / 64",
                "decode_real-cuda-h100.json",
                joined(num("smollm2_s4_b1_tok_s", tok), num("smollm2_s4_b64_tok_s", tok)),
            ),
            Figure(
                "SmolLM2 S=4: speculative k=2 / plain, batch 1 / 32 (draft-1 acceptance)",
                "decode_real-cuda-h100.json",
                joined(
                    num("smollm2_spec_b1_k2_speedup", ".2f", unit="x"),
                    num("smollm2_spec_b32_k2_speedup", ".2f", unit="x"),
                    num("smollm2_spec_b1_k2_acceptance/0", ".3f"),
                ),
            ),
            Figure(
                "continuous batching / run to completion",
                "decode-cuda-continuous.json",
                num("continuous/speedup", ".2f", unit="x"),
            ),
            Figure(
                "S=1: birkhoff / transformers static-cache generate, batch 1 / 64",
                "decode-cuda-peer.json",
                joined(
                    num("peer/1/birkhoff_over_peer", ".2f", unit="x"),
                    num("peer/3/birkhoff_over_peer", ".2f", unit="x"),
                ),
            ),
            Figure(
                "fp8 weights / bf16, batch 1 / 64 / 256",
                "decode-cuda-fp8.json",
                joined(*(num(f"fp8/fp8_over_bf16/{i}", ".2f", unit="x") for i in range(3))),
            ),
            Figure(
                "S=4 M=1 tokens/s, batch 1 / 64 / 256",
                "decode-cuda-h100-fp8.json",
                joined(*(num(f"fp8/rows/bf16/{i}/tokens_per_s", tok) for i in range(3))),
            ),
            Figure(
                "fp8 weights / bf16, batch 1 / 64 / 256",
                "decode-cuda-h100-fp8.json",
                joined(*(num(f"fp8/fp8_over_bf16/{i}", ".3f", unit="x") for i in range(3))),
            ),
            Figure(
                "fp8 weights / bf16 at dim 2048, 24 layers, batch 1 / 64",
                "decode-cuda-h100-fp8-d2048-l24.json",
                joined(
                    num("fp8_over_bf16_b1_d2048", ".2f", unit="x"),
                    num("fp8_over_bf16_b64_d2048", ".2f", unit="x"),
                ),
            ),
            Figure(
                "plain step at batch 256: device busy us, busy fraction",
                "decode-profile-cuda-h100-glue.json",
                joined(
                    num("results/S4-M1/batch=256/busy_us", ",.0f", unit=" us"),
                    num("results/S4-M1/batch=256/busy", ".3f"),
                    sep=", ",
                ),
            ),
            Figure(
                "k=2 speculative step, batch 1 / 32: wall us, launches",
                "decode-profile-cuda-h100-k2-depth-inputs.json",
                joined(
                    *(num(f"results/S4-M1/batch={b}/wall_us", ",.0f", unit=" us") for b in (1, 32)),
                    num("results/S4-M1/batch=1/launches", ",.0f"),
                ),
            ),
            Figure(
                "k=2 speculative step before the depth inputs op, batch 1 / 32: wall us",
                "decode-profile-cuda-h100-k2-glue.json",
                joined(
                    *(num(f"results/S4-M1/batch={b}/wall_us", ",.0f", unit=" us") for b in (1, 32))
                ),
            ),
        ],
        notes="The h200-small trunk (dim 768, 16 layers), whole steps replayed from CUDA graphs; "
        "speculative decoding on the same trunk after 300 training steps.",
    ),
    Section(
        "Fused mHC kernels",
        "`benchmarks/mhc_kernels.py`",
        "training.md",
        ("mhc_kernels", "mhc_profile", "mhc_sweep", "mhc_alignment"),
        [
            Figure(
                f"{op} {pass_}: fused vs eager",
                "mhc_kernels-cuda-bf16.json",
                lambda d, op=op, pass_=pass_: next(
                    f"{r['fused_ms'] * 1e3:,.0f} us vs {r['eager_ms'] * 1e3:,.0f} us "
                    f"({r['speedup']:.2f}x, {r['fused_of_copy']:.2f} of copy rate)"
                    for r in d["rows"]
                    if r["op"] == op and r["pass_"] == pass_
                ),
            )
            for op in ("coefficients", "mix_in", "mix_out", "contraction", "sublayer")
            for pass_ in ("fwd", "fwd+bwd")
        ],
        notes="B 8, T 2048, S 4, D 768, bf16.",
    ),
    Section(
        "Refit",
        "`benchmarks/refit.py`, `benchmarks/refit_dist.py`",
        "refit.md",
        ("refit",),
        [
            Figure(
                "bf16 refit, 256 MB buckets (1.1B params, fp32 trainer)",
                "refit-cuda.json",
                joined(
                    num("rows/refit_bf16@256MB/seconds", ".1f", scale=1e3, unit=" ms"),
                    num("rows/refit_bf16@256MB/gb_per_s", ",.0f", unit=" GB/s"),
                    sep=", ",
                ),
            ),
            Figure(
                "bf16 refit / device copy bandwidth",
                "refit-cuda.json",
                num("rows/refit_bf16@256MB/ratio_to_copy", ".2f", unit="x"),
            ),
            Figure(
                "fp8 refit (fused quantization), 256 MB buckets",
                "refit-cuda.json",
                num("rows/refit_fp8@256MB/seconds", ".1f", scale=1e3, unit=" ms"),
            ),
            Figure(
                "bf16 refit from a bf16 trainer / device copy",
                "refit-cuda-bf16-trainer.json",
                num("rows/refit_bf16/ratio_to_copy", ".2f", unit="x"),
            ),
            Figure(
                "`Engine.from_model` (bf16 trainer)",
                "refit-cuda-bf16-trainer.json",
                num("rows/from_model/seconds", ".1f", scale=1e3, unit=" ms"),
            ),
            Figure(
                "across two GPUs (NCCL), bf16, 256 MB: GB/s, / one broadcast",
                "refit-dist-cuda.json",
                joined(
                    num("rows/refit_bf16@256MB/gb_per_s", ",.0f", unit=" GB/s"),
                    num("rows/refit_bf16@256MB/ratio_to_nccl_broadcast", ".2f", unit="x"),
                    sep=", ",
                ),
            ),
        ],
        notes="The run with an fp32 trainer after the refit's redesign (bf16 2.6 ms = 0.41x of "
        "device copy at 256 MB buckets, fp8 6.4 ms, `Engine.from_model` 5.7 ms) left no result "
        "file; its table is in docs/log/refit.md. `refit-cuda.json` is the design before it, "
        "`refit-cuda-bf16-trainer.json` the redesign with a bf16 trainer.",
    ),
    Section(
        "Distributed path (torchrun, FSDP2)",
        "`benchmarks/distributed.py`",
        "distributed.md",
        ("distributed",),
        [
            Figure(
                "FSDP2 train step / plain train step (h200-grpo)",
                "distributed-cuda.json",
                ratio("distributed/train_step_s", "plain/train_step_s"),
            ),
            Figure(
                "GRPO step, plain / FSDP2",
                "distributed-cuda.json",
                joined(
                    num("plain/grpo_step_s", ".2f", unit=" s"),
                    num("distributed/grpo_step_s", ".2f", unit=" s"),
                ),
            ),
            Figure(
                "checkpoint save, plain / sharded",
                "distributed-cuda.json",
                joined(
                    num("plain/ckpt_save_s", ".1f", unit=" s"),
                    num("distributed/ckpt_save_s", ".1f", unit=" s"),
                ),
            ),
        ],
    ),
    Section(
        "Mixture of experts",
        "`benchmarks/moe_experts.py`, `--moe` of the others",
        "moe.md",
        ("moe_experts",),
        [
            Figure(
                "train step, MoE (32 experts) / dense of equal active parameters",
                "train_step-cuda-moe.json",
                num("ratios/moe_over_dense_S4_M1", ".2f", unit="x"),
            ),
            Figure(
                "decode tokens/s, MoE (gather-and-gemv at few rows), batch 1 / 64",
                "decode-cuda-h100-moe-gather.json",
                joined(num("moe_b1_tok_s", tok), num("moe_b64_tok_s", tok)),
            ),
            Figure(
                "decode, MoE / dense of equal active parameters, batch 1 / 64",
                "decode-cuda-h100-moe-gather.json",
                joined(
                    num("moe_over_dense_b1", ".2f", unit="x"),
                    num("moe_over_dense_b64", ".2f", unit="x"),
                ),
            ),
            Figure(
                "bf16 refit of the MoE model (3.1B params)",
                "refit-cuda-moe.json",
                joined(
                    num("rows/refit_bf16/seconds", ".1f", scale=1e3, unit=" ms"),
                    num("rows/refit_bf16/gb_per_s", ",.0f", unit=" GB/s"),
                    sep=", ",
                ),
            ),
            Figure(
                "routed experts: grouped GEMM / loop (CPU, tiny)",
                "moe_experts-cpu-quick.json",
                num("grouped_over_loop_speedup", ".1f", unit="x"),
            ),
        ],
    ),
]


# --- rendering --------------------------------------------------------------------------------


def meta(name: str, runs: dict[str, Run]) -> dict[str, str]:
    if name in runs:
        run = runs[name]
        return {"command": run.command, "device": run.device, "commit": run.commit}
    data = load(name)
    return data.get("meta", {}) if isinstance(data, dict) else {}


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_section(section: Section, history: list[str]) -> list[str]:
    runs = {run.file: run for run in section.runs}
    lines = [f"## {section.title}: {section.script}", ""]
    if section.notes:
        lines += [section.notes, ""]
    lines += ["| figure | value | device | JSON |", "| --- | --- | --- | --- |"]
    files: list[str] = []
    for fig in section.figures:
        if fig.file not in files:
            files.append(fig.file)
        device = meta(fig.file, runs).get("device", "")
        lines.append(
            f"| {cell(fig.label)} | {cell(fig.read(load(fig.file)))} | {device} | "
            f"[{fig.file}](../benchmarks/results/{fig.file}) |"
        )
    lines += ["", "Commands (commit):", ""]
    for name in files:
        m = meta(name, runs)
        commit = f" ({m['commit']})" if m.get("commit") else ""
        lines.append(f"- `{name}`: `{m.get('command', '?')}`{commit}")
    if history:
        lines += [
            "",
            f"History ([docs/log/{section.log}](log/{section.log})): "
            + ", ".join(f"`{name}`" for name in history)
            + ".",
        ]
    return [*lines, ""]


def render() -> str:
    current = {fig.file for s in SECTIONS for fig in s.figures}
    everything = sorted(p.name for p in RESULTS.iterdir() if p.suffix in (".json", ".jsonl"))
    claimed: set[str] = set(current)
    lines = [
        "# Results",
        "",
        "<!-- Generated by benchmarks/report.py from benchmarks/results/; do not edit. -->",
        "",
        "The current figure of every benchmark, read from the result file it names; each file",
        "records the command, device, torch version and commit that made it (files recorded",
        "before that field existed carry the command rebuilt from their arguments and the commit",
        "that added them). Earlier variants and launch-parameter sweeps are listed as history",
        "under their benchmark; their story is in docs/log/. Ratios from one run are the figures",
        "to trust; timings on the shared 2-core CPU machine vary by tens of percent. Tests never",
        "assert on any of this.",
        "",
    ]
    for section in SECTIONS:
        history = [
            name for name in everything if name not in claimed and name.startswith(section.prefixes)
        ]
        claimed.update(history)
        lines += render_section(section, history)
    rest = [name for name in everything if name not in claimed]
    if rest:
        lines += ["## Other results", "", ", ".join(f"`{name}`" for name in rest) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if docs/results.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/results.md is stale: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
