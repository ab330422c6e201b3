"""Fused mHC ops vs the eager reference: time, achieved bandwidth, and the V4 alignment numbers.

Legend: B batch, T tokens, S streams, D model dim, C = S*D, P = S*S + 2S logits.

For each op (coefficients + Sinkhorn, mix in, mix out, output contraction, and one whole
hyper-connection sublayer with F = identity) the fused and the eager path are timed forward and
forward + backward (median of --repeats after warm-up). "GB/s" is the op's compulsory traffic
(every [B,T,S,D] / [B,T,D] tensor read or written once, the small coefficient tensors included)
divided by the time; it is set against a device-to-device copy (read + write) measured in the
same run. The coefficient backward reads x a second time (for g_x and g_phi after the Sinkhorn
backward), which its figure does not count. The sublayer runs as HyperConnection does: the
coefficients and the mix in as one op, then mix out. Launch parameters: see mhc_sweep.py.

  python benchmarks/mhc_kernels.py --device cuda                  # h200-small shape, bf16
  python benchmarks/mhc_kernels.py --device cuda --dtype fp32
  python benchmarks/mhc_kernels.py --device cpu --alignment       # docs/mhc.md numbers (CPU)

--alignment prints how far the previous and the current eager formulations are from an fp64
transcription of DeepSeek-V4's published one (H_res; the bf16 stream collapse) and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, sync, timed, write_result
from torch import Tensor

from birkhoff.model import hyper

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(args: argparse.Namespace) -> dict[str, Tensor]:
    B, T, S, D = args.batch, args.seq, args.streams, args.dim
    dtype, dev = DTYPES[args.dtype], args.device
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, dt: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    P = S * S + 2 * S
    return dict(
        x=randn(B, T, S, D, dt=dtype), f=randn(B, T, D, dt=dtype),
        phi=randn(P, S * D) / math.sqrt(S * D), alpha=torch.tensor([0.5, 0.5, 1.0], device=dev),
        bias=hyper.init_bias(S, home=0).to(dev), phi_c=randn(S, S * D) / math.sqrt(S * D),
        alpha_c=torch.tensor([0.5], device=dev), bias_c=hyper.init_bias(S, home=0)[:S].to(dev),
    )  # fmt: skip


def op_table(inp: dict[str, Tensor], iters: int) -> dict[str, Callable[[str], list[Tensor]]]:
    """op name -> fn(kernels) returning the op's outputs (their sum is the backward's loss)."""
    x, f = inp["x"], inp["f"]
    h = hyper.mhc_coefficients(x, inp["phi"], inp["alpha"], inp["bias"], iters=iters, norm_eps=1e-6)
    pre, post, res = (t.detach() for t in h)

    def coefficients(k: str) -> list[Tensor]:
        return list(hyper.mhc_coefficients(
            x, inp["phi"], inp["alpha"], inp["bias"], iters=iters, norm_eps=1e-6, kernels=k
        ))  # fmt: skip

    def sublayer(k: str) -> list[Tensor]:  # HyperConnection.forward's function, F = identity
        return [hyper.hyper_connection(
            x, inp["phi"], inp["alpha"], inp["bias"], lambda h: h, iters=iters, norm_eps=1e-6,
            kernels=k,
        )]  # fmt: skip

    def contraction(k: str) -> list[Tensor]:
        return [hyper.contract(x, inp["phi_c"], inp["alpha_c"], inp["bias_c"], norm_eps=1e-6,
                               kernels=k)]  # fmt: skip

    return {
        "coefficients": coefficients,
        "mix_in": lambda k: [hyper.mix_in(x, pre, kernels=k)],
        "mix_out": lambda k: [hyper.mix_out(x, f, post, res, kernels=k)],
        "contraction": contraction,
        "sublayer": sublayer,
    }


def compulsory_bytes(name: str, inp: dict[str, Tensor], backward: bool) -> int:
    """Bytes every implementation must move: big tensors once each, coefficients in fp32."""
    x = inp["x"]
    B, T, S, D = x.shape
    big, row, e = B * T * S * D, B * T * D, x.element_size()
    coeffs = B * T * (S * S + 2 * S) * 4
    fwd = {
        "coefficients": big * e + coeffs,
        "mix_in": big * e + row * e + B * T * S * 4,
        "mix_out": 2 * big * e + row * e + coeffs,
        "contraction": big * e + row * e,
        "sublayer": 2 * big * e + row * e,  # read x, write y; F's input/output stay on chip
    }[name]
    bwd = {  # read grad(s) and saved inputs, write input grads
        "coefficients": 2 * big * e + 2 * coeffs,
        "mix_in": 2 * big * e + row * e,
        "mix_out": 3 * big * e + 2 * row * e + 2 * coeffs,
        "contraction": 2 * big * e + row * e,
        "sublayer": 3 * big * e + 2 * row * e,
    }[name]
    return fwd + (bwd if backward else 0)


def time_op(fn: Callable[[str], list[Tensor]], kernels: str, args: argparse.Namespace,
            leaves: list[Tensor], backward: bool) -> float:  # fmt: skip
    def step() -> None:
        if not backward:
            with torch.no_grad():
                fn(kernels)
            return
        outs = fn(kernels)
        loss = sum(o.float().sum() for o in outs)
        torch.autograd.grad(loss, leaves, allow_unused=True)

    return timed(step, args.device, args.repeats, warmup=3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    inp = make_inputs(args)
    for t in inp.values():
        t.requires_grad_(True)
    leaves = list(inp.values())
    copy = copy_bandwidth(args.device, args.repeats)
    rows = []
    for name, fn in op_table(inp, args.iters).items():
        for backward in (False, True):
            nbytes = compulsory_bytes(name, inp, backward)
            t = {k: time_op(fn, k, args, leaves, backward) for k in ("eager", "triton")}
            rows.append(dict(
                op=name, pass_="fwd+bwd" if backward else "fwd", eager_ms=1e3 * t["eager"],
                fused_ms=1e3 * t["triton"], speedup=t["eager"] / t["triton"],
                fused_gb_s=nbytes / t["triton"] / 1e9,
                fused_of_copy=nbytes / t["triton"] / copy,
            ))  # fmt: skip
    sync(args.device)
    shape = dict(B=args.batch, T=args.seq, S=args.streams, D=args.dim, dtype=args.dtype)
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "shape": shape, "copy_gb_s": copy / 1e9, "rows": rows}  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['device']}  {result['shape']}  device copy {result['copy_gb_s']:.0f} GB/s")
    print(f"{'op':<13}{'pass':<9}{'eager ms':>10}{'fused ms':>10}{'speedup':>9}"
          f"{'GB/s':>9}{'of copy':>9}")  # fmt: skip
    for r in result["rows"]:
        times = f"{r['eager_ms']:>10.3f}{r['fused_ms']:>10.3f}{r['speedup']:>8.2f}x"
        print(
            f"{r['op']:<13}{r['pass_']:<9}{times}{r['fused_gb_s']:>9.0f}{r['fused_of_copy']:>9.2f}"
        )


def previous_sinkhorn(logits: Tensor, iters: int, eps: float = 1e-6) -> Tensor:
    """The formulation birkhoff used before aligning with V4: exp, then (row, column) x iters."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def v4_sinkhorn(logits: Tensor, iters: int, eps: float = 1e-6) -> Tensor:
    """DeepSeek-V4's published comb: row softmax + eps, columns, (rows, columns) x (iters - 1)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def alignment() -> dict[str, float]:
    """Max |difference| to the fp64 V4 reference of the previous and the current eager code."""
    g = torch.Generator().manual_seed(0)
    S, D, P = 4, 768, 24
    x = 4.0 * torch.randn(4, 256, S, D, generator=g, dtype=torch.float64)  # magnitude ~4
    phi = torch.randn(P, S * D, generator=g, dtype=torch.float64) / math.sqrt(S * D)
    bias = hyper.init_bias(S, home=0).double() + 0.5 * torch.randn(P, generator=g).double()
    out: dict[str, float] = {}
    for label, a in (("init alpha 0.01", 0.01), ("alpha 1", 1.0)):
        alpha = torch.full((3,), a, dtype=torch.float64)
        flat = x.flatten(-2) * torch.rsqrt(x.flatten(-2).square().mean(-1, keepdim=True) + 1e-6)
        logits = (a * (flat @ phi.t()) + bias)[..., 2 * S :].view(*x.shape[:2], S, S)
        ref = v4_sinkhorn(logits, 20)
        prev = previous_sinkhorn(logits, 20)
        ours = hyper.mhc_coefficients(
            x.float(), phi.float(), alpha.float(), bias.float(), iters=20, norm_eps=1e-6
        )[2]
        out[f"H_res previous fp64, {label}"] = (prev - ref).abs().max().item()
        out[f"H_res current fp32, {label}"] = (ours.double() - ref).abs().max().item()
        out[f"H_res current fp64, {label}"] = (hyper.sinkhorn(logits, 20) - ref).abs().max().item()
    x_bf = x.to(torch.bfloat16)
    pre = hyper.mhc_coefficients(
        x_bf, phi.float(), torch.full((3,), 1.0), bias.float(), iters=20, norm_eps=1e-6
    )[0]
    exact = (pre.double()[..., None] * x_bf.double()).sum(-2)
    previous = torch.einsum("btj,btjd->btd", pre.to(torch.bfloat16), x_bf)
    current = hyper.mix_in(x_bf, pre, kernels="eager")
    out["bf16 collapse previous (H_pre cast first)"] = (
        (previous.double() - exact).abs().max().item()
    )
    out["bf16 collapse current (fp32 sum, cast after)"] = (
        (current.double() - exact).abs().max().item()
    )
    return out


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The problem shape, dtype and repeats (shared with mhc_sweep.py)."""
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--iters", type=int, default=20, help="Sinkhorn iterations")
    p.add_argument("--repeats", type=int, default=20)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    add_shape_args(p)
    p.add_argument("--alignment", action="store_true", help="V4 alignment numbers only (CPU)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not args.alignment and args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if not args.alignment and args.device == "cpu":
        p.error("the fused kernels run on CUDA; on CPU use --alignment")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.alignment:
        result: dict[str, Any] = {"alignment": alignment()}
        for key, value in result["alignment"].items():
            print(f"{key:<48}{value:.3g}")
        name = "mhc_alignment-cpu.json"
    else:
        result = run(args)
        print_table(result)
        name = f"mhc_kernels-{args.device}-{args.dtype}.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_result(out, result, device=args.device, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, sort_keys=True))
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
