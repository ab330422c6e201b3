"""The engine's mHC sublayer entry at decode sizes: the separate fused ops against the one
launch of `mhc_decode.mix_in_norm`, in the same run.

Legend: S streams, D model dim, N tokens of a call (the batch of a decode step).

Per call, device microseconds of 33 consecutive calls (a decode step's sublayers: 16 layers x 2
+ the output contraction) captured in one CUDA graph and replayed (`common.graph_seconds`), phi
served as the engine serves it (`mhc.served_phi`), bf16 streams:
- ops: `mhc.coefficients_and_mix_in` + the fused RMSNorm (coeff_proj, coeff_tail, mix_in,
  rms_norm: 4 launches),
- fused: `mhc_decode.mix_in_norm` (1 launch),
- and each with the sublayer's mix out after it (the whole mHC cost of a decode sublayer but F).
--sweep also times the CONFIG variants of mix_in_norm below.

  python benchmarks/mhc_decode.py --rows 1,64,256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, graph_seconds, json_args

from birkhoff.kernels import mhc, mhc_configs, mhc_decode, norm_rope
from birkhoff.kernels.mhc_mix import mix_out

CALLS = 33
VARIANTS: dict[str, dict[str, int | str]] = {
    "splits4": dict(SPLITS=4),
    "splits16": dict(SPLITS=16),
    "splits48": dict(SPLITS=48, PROGRAMS=256),
    "tail8192": dict(TAIL_ELEMENTS=8192),
    "tail2048": dict(TAIL_ELEMENTS=2048),
    "BC128": dict(BC=128),
    "BC32": dict(BC=32),
    "BD512": dict(BD=512),
    "BD128": dict(BD=128),
    "warps2": dict(num_warps=2),
    "warps8": dict(num_warps=8),
    "stages2": dict(num_stages=2),
}


def entries(rows: int, S: int, D: int) -> dict[str, Any]:
    """name -> call of one sublayer entry on fixed inputs of `rows` tokens."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    P = S * S + 2 * S
    x = torch.randn(rows, S, D, device="cuda", generator=g).bfloat16()
    phi = mhc.served_phi(torch.randn(P, S * D, device="cuda", generator=g) / (S * D) ** 0.5)
    alpha = torch.tensor([0.7, 0.5, 1.3], device="cuda")
    bias = torch.randn(P, device="cuda", generator=g)
    w = torch.rand(D, device="cuda", generator=g).bfloat16() + 0.5
    f = torch.randn(rows, D, device="cuda", generator=g).bfloat16()
    kw = dict(iters=20, norm_eps=1e-6, eps=1e-6)

    def ops() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, _, post, res = mhc.coefficients_and_mix_in(x, phi, alpha, bias, **kw)
        return norm_rope.rms_norm(y, w, 1e-6), post, res

    def fused() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, _, post, res = mhc_decode.mix_in_norm(x, phi, alpha, bias, w, **kw)
        return h, post, res

    def with_mix_out(entry):  # type: ignore[no-untyped-def]
        def call() -> torch.Tensor:
            h, post, res = entry()
            return mix_out(x, f + h, post, res)  # the add stands in for F

        return call

    add = lambda: f + f  # noqa: E731  (the stand-in F's own launch, subtracted below)
    return {"ops": ops, "fused": fused, "ops+mix_out": with_mix_out(ops),
            "fused+mix_out": with_mix_out(fused), "_add": add}  # fmt: skip


def measure(rows: int, args: argparse.Namespace) -> dict[str, float]:
    with torch.no_grad():
        calls = entries(rows, args.streams, args.dim)
        us = {k: graph_seconds(fn, CALLS, replays=args.replays) * 1e6 for k, fn in calls.items()}
        for name in ("ops+mix_out", "fused+mix_out"):
            us[name] -= us["_add"]
        del us["_add"]
        if args.sweep:
            base = dict(mhc_configs.CONFIG["mix_in_norm"])
            for variant, change in VARIANTS.items():
                mhc_configs.CONFIG["mix_in_norm"] = base | change
                try:
                    us[f"fused/{variant}"] = graph_seconds(calls["fused"], CALLS) * 1e6
                finally:
                    mhc_configs.CONFIG["mix_in_norm"] = base
    return us


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,64,256", help="tokens per call")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time mix_in_norm's VARIANTS")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times the fused kernels: needs CUDA")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "us_per_call": {}}
    print(f"{'rows':>5} {'name':<24} {'us / call':>10} {'vs ops':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        us = measure(rows, args)
        result["us_per_call"][rows] = us
        for name, value in us.items():
            ref = us["ops+mix_out"] if "mix_out" in name else us["ops"]
            print(f"{rows:>5} {name:<24} {value:>10.2f} {value / ref:>7.2f}x")
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/mhc_decode-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    summary = {r: {k: round(v, 2) for k, v in us.items() if "/" not in k}
               for r, us in result["us_per_call"].items()}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
