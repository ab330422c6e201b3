"""The engine's fused mHC sublayer entry (`mhc_decode.mix_in_norm`) on CUDA: against the eager
ops on the interpreter's cases and at decode and prefill sizes, replayed from a CUDA graph (its
counters must be zero again after every launch), as a registered op and under torch.compile."""

from __future__ import annotations

import pytest
import torch
from mhc_cases import Case, case_id, make_inputs
from mhc_decode_cases import DECODE_CASES, check_mix_in_norm, eager

from birkhoff.kernels import mhc_decode
from birkhoff.model import hyper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SIZES = [Case(S=4, D=768, B=1, T=N, iters=20) for N in (1, 64, 256, 1000)]
SIZES += [Case(S=4, D=769, B=3, T=5, iters=20), Case(S=8, D=256, B=1, T=300, iters=20)]


@pytest.mark.parametrize("case", DECODE_CASES + SIZES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_res", [True, False], ids=["sublayer", "contraction"])
def test_mix_in_norm_matches_the_eager_ops(case: Case, dtype: torch.dtype, with_res: bool) -> None:
    check_mix_in_norm(case, "cuda", dtype, with_res)


def _args(c: Case, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inp = make_inputs(c, "cuda", dtype)
    for k in ("phi", "alpha", "bias"):
        inp[k] = inp[k].float()
    return inp, torch.rand(c.D, device="cuda", dtype=dtype) + 0.5


@pytest.mark.parametrize("T", [1, 256])
def test_graph_replays_reset_the_counters(T: int) -> None:
    """Three launches of one graph per replay, new inputs before each replay: every replay
    equals the eager ops, and the counters are zero after it."""
    c = Case(S=4, D=768, B=1, T=T, iters=20)
    inp, weight = _args(c, torch.bfloat16)
    x = inp["x"]

    def calls() -> list[torch.Tensor]:
        out, h = [], x
        for _ in range(3):
            h_ATD, _, post, res = mhc_decode.mix_in_norm(
                h, inp["phi"], inp["alpha"], inp["bias"], weight, iters=20, norm_eps=1e-6,
                eps=hyper.MHC_EPS,
            )  # fmt: skip
            out.append(h_ATD)
            h = h * 0.5 + post[..., None] * h_ATD[..., None, :]  # the next call's streams
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # warm-up (compiles, allocates the counters)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    for seed in range(4):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        want = calls()
        for got, ref in zip(outs, want, strict=True):
            assert torch.equal(got, ref)
        assert not mhc_decode.counters(x, 1).any()
    first = eager(dict(inp, x=x), weight, c, True)[0]
    torch.testing.assert_close(outs[0].float(), first.float(), rtol=2**-6, atol=2**-6)


def test_custom_op_registration() -> None:
    inp, weight = _args(Case(S=4, D=24, B=2, T=3), torch.float32)
    args = (inp["x"], inp["phi"], inp["alpha"], inp["bias"], weight, 3, True, 1e-6, 1e-6)
    torch.library.opcheck(torch.ops.birkhoff.mhc_mix_in_norm.default, args)


def test_compile_keeps_it_in_one_graph() -> None:
    inp, weight = _args(Case(S=4, D=64, B=2, T=3, iters=20), torch.bfloat16)

    def entry(x, phi, alpha, bias, w):  # type: ignore[no-untyped-def]
        h, _, post, res = mhc_decode.mix_in_norm(
            x, phi, alpha, bias, w, iters=20, norm_eps=1e-6, eps=1e-6
        )
        return torch.tanh(h).float().sum() + post.sum() + res.sum()

    args = (inp["x"], inp["phi"], inp["alpha"], inp["bias"], weight)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(entry, fullgraph=True)(*args), entry(*args))
