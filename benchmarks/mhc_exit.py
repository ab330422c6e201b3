"""The engine's fused sublayer exit (`mhc.entry.mix_out_proj`: mix out plus the next entry's
coefficient projection) against the pair of launches it replaces (`mhc.mix_out`, then
coeff_proj), in the same run, at decode sizes.

Legend: N tokens (a decode step's rows), S streams, D model dim.

Device microseconds per call: COPIES distinct stream tensors and phis called in turn inside one
CUDA graph, replayed (`common.graph_seconds`), so each call reads its streams from HBM as a
decode step's sublayers do. Besides CONFIG's tile, `--variants` times other tiles of the fused
kernel ("BNxBDxWARPS", read from `mhc.configs.CONFIG` at each call). The entry that reads the
exit's partials (`mhc.entry.pre_mix_norm`: the coefficients' sum, mix in and RMSNorm) is timed
the same way, at CONFIG's launch and at `--entry-variants` ("PROGRAMSxWARPS").

  python benchmarks/mhc_exit.py                       # N 1, 64, 256 at the h200-small trunk
  python benchmarks/mhc_exit.py --variants 16x16x2,32x16x4 --entry-variants 256x4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, graph_seconds, json_args, write_result

from birkhoff.kernels import mhc
from birkhoff.kernels.mhc import coefficients
from birkhoff.kernels.mhc import entry as mhc_entry
from birkhoff.kernels.mhc.configs import CONFIG, padded_logits

COPIES = 8


def measure(
    N: int, S: int, D: int, variants: list[str], entries: list[str], replays: int
) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(N)
    P = S * S + 2 * S
    xs = [torch.randn(N, S, D, device="cuda", generator=g).bfloat16() for _ in range(COPIES)]
    f = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    post = torch.rand(N, S, device="cuda", generator=g)
    res = torch.rand(N, S, S, device="cuda", generator=g)
    phis = [
        mhc.served_phi(0.02 * torch.randn(P, S * D, device="cuda", generator=g))
        for _ in range(COPIES)
    ]

    def pair() -> None:
        for x, phi in zip(xs, phis, strict=True):
            y = mhc.mix_out(x, f, post, res)
            coefficients.projection(y, phi, N, padded_logits(P))

    def fused() -> None:
        for x, phi in zip(xs, phis, strict=True):
            mhc_entry.mix_out_proj(x, f, post, res, phi)

    out = {"pair_us": graph_seconds(pair, 1, replays=replays) * 1e6 / COPIES}
    out["mix_out_us"] = graph_seconds(
        lambda: [mhc.mix_out(x, f, post, res) for x in xs], 1, replays=replays
    ) * 1e6 / COPIES  # fmt: skip
    default = dict(CONFIG["mix_out_proj"])
    for name in ["config", *variants]:
        if name != "config":
            bn, bd, warps = (int(v) for v in name.split("x"))
            CONFIG["mix_out_proj"] = dict(default, BN=bn, BD=bd, num_warps=warps, PROGRAMS=1 << 30)
        try:
            out[f"{name}_us"] = graph_seconds(fused, 1, replays=replays) * 1e6 / COPIES
        finally:
            CONFIG["mix_out_proj"] = default
    exits = [mhc_entry.mix_out_proj(x, f, post, res, phi) for x, phi in zip(xs, phis, strict=True)]
    alpha, bias = torch.ones(3, device="cuda"), torch.zeros(P, device="cuda")
    weight = torch.ones(D, device="cuda", dtype=torch.bfloat16)

    def entry() -> None:
        for (y, part, sq), phi in zip(exits, phis, strict=True):
            mhc_entry.pre_mix_norm(y, phi, alpha, bias, weight, 1e-6, 1e-6, 1e-6, part, sq)

    default = dict(CONFIG["pre_mix_norm"])
    for name in ["config", *entries]:
        if name != "config":
            programs, warps = (int(v) for v in name.split("x"))
            CONFIG["pre_mix_norm"] = dict(PROGRAMS=programs, num_warps=warps)
        try:
            out[f"entry_{name}_us"] = graph_seconds(entry, 1, replays=replays) * 1e6 / COPIES
        finally:
            CONFIG["pre_mix_norm"] = default
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1,64,256")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--variants", default="16x16x2,32x16x4", help="BNxBDxWARPS exit tiles")
    p.add_argument("--entry-variants", default="256x4,64x4", help="PROGRAMSxWARPS entries")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times GPU kernels: needs CUDA")
    variants = [v for v in args.variants.split(",") if v]
    entries = [v for v in args.entry_variants.split(",") if v]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "tokens": {}}
    names = ["pair", "mix_out", "config", *variants, "entry_config"]
    names += [f"entry_{e}" for e in entries]
    print("{:>5} ".format("N") + " ".join(f"{n + ' us':>16}" for n in names) + f" {'saved':>7}")
    with torch.no_grad():
        for N in (int(n) for n in args.tokens.split(",")):
            r = measure(N, args.streams, args.dim, variants, entries, args.replays)
            r["saved_us"] = r["pair_us"] - r["config_us"]
            result["tokens"][N] = r
            cells = " ".join(f"{r[n + '_us']:>16.2f}" for n in names)
            print(f"{N:>5} {cells} {r['saved_us']:>7.2f}")
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/mhc-exit-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    summary = {N: {k: round(v, 2) for k, v in r.items()} for N, r in result["tokens"].items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
