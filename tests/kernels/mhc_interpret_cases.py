"""Fused mHC ops under the Triton interpreter on CPU (run by test_mhc_interpret.py with
TRITON_INTERPRET=1 in a fresh process, which Triton needs before any kernel is defined)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from mhc_cases import (
    CASES,
    Case,
    case_id,
    check_bf16_streams_keep_fp32_precision,
    check_both_streams_gradients_matter,
    check_contraction,
    check_exit,
    check_hyper,
    check_hyper_entry,
    check_sublayer,
    make_inputs,
)
from mhc_model_cases import check_safe_reclaim, check_train_step

from birkhoff.kernels.common import pow2
from birkhoff.kernels.mhc.configs import CONFIG, SWEEP
from birkhoff.model import hyper

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


# CASES[-1] (300 tokens) is there for the engine entry's coeff_rest over two programs, which
# test_engine_entry_over_several_rest_programs reaches with 34 tokens; the other ops see several
# token blocks at T = 17 already
SMALL = CASES[:-1]


@pytest.mark.parametrize("case", SMALL, ids=case_id)
def test_hyper_fused_matches_eager(case: Case) -> None:
    check_hyper(case, "cpu")


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 2, 3, 4, 7, 10, 11)], ids=case_id)
def test_coefficients_and_mix_in_as_one_op_match_eager(case: Case) -> None:
    check_hyper(case, "cpu", joint=True)


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 2, 3, 4, 5, 6, 10)], ids=case_id)
def test_engine_entry_equals_the_training_ops(case: Case) -> None:
    check_hyper_entry(case, "cpu")


def test_engine_entry_over_several_rest_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """coeff_rest at one warp (32 tokens) a program: 34 tokens take two, the second masked."""
    from birkhoff.kernels.mhc import entry as mhc_entry

    monkeypatch.setattr(mhc_entry, "REST_WARPS", 1)
    case = Case(S=4, B=2, T=17, iters=2)
    assert mhc_entry._rest_launch(case.B * case.T)["BN"] == 32
    check_hyper_entry(case, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 2, 3, 4, 5, 6, 7, 10)], ids=case_id)
def test_engine_exit_projects_for_the_next_entry(case: Case, dtype: torch.dtype) -> None:
    check_exit(case, "cpu", dtype)


@pytest.mark.parametrize("case", [CASES[i] for i in (2, 4, 9)], ids=case_id)
def test_engine_exit_and_entry_at_their_large_batch_tiles(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With grid targets of 0 and 1 programs the exit takes 32 tokens a program and the entry
    several, as at large batches."""
    from birkhoff.kernels.mhc import entry as mhc_entry
    from birkhoff.kernels.mhc.configs import CONFIG

    monkeypatch.setitem(CONFIG, "mix_out_proj", dict(CONFIG["mix_out_proj"], PROGRAMS=0))
    monkeypatch.setitem(CONFIG, "pre_mix_norm", dict(CONFIG["pre_mix_norm"], PROGRAMS=1))
    assert mhc_entry._exit_launch(case.B * case.T, case.D)["BN"] == 32
    check_exit(case, "cpu", torch.bfloat16)


def test_engine_entry_takes_both_projection_partials_or_neither() -> None:
    from birkhoff.kernels.mhc import entry as mhc_entry

    inp = make_inputs(Case(S=4), "cpu", torch.float32)
    inputs = mhc_entry.op_inputs(inp["x"], inp["phi"], inp["alpha"], inp["bias"])
    part = torch.zeros(1, *inp["x"].shape[:2], 32)
    with pytest.raises(ValueError, match="both projection partials"):
        mhc_entry.pre_mix_norm(*inputs, torch.ones(5), 1e-6, 1e-6, 1e-6, part, None)


def test_engine_entry_rejects_a_norm_weight_of_another_dim() -> None:
    from birkhoff.kernels.mhc import entry as mhc_entry

    inp = make_inputs(Case(S=4), "cpu", torch.float32)
    with pytest.raises(ValueError, match="norm weight of shape"):
        mhc_entry.hyper_entry(
            inp["x"], inp["phi"], inp["alpha"], inp["bias"], torch.ones(6), iters=2,
            norm_eps=1e-6, eps=1e-6, rms_eps=1e-6, stream=None,
        )  # fmt: skip


@pytest.mark.parametrize("case", SMALL, ids=case_id)
def test_sublayer_sums_both_gradients_of_the_streams(case: Case) -> None:
    if case.B and case.kind == "random":  # where the check has the power to see a lost part
        check_both_streams_gradients_matter(case, "cpu")
    check_sublayer(case, "cpu")


def _edges_into(loss: torch.Tensor, x: torch.Tensor) -> int:
    """How many graph edges end at leaf x's gradient accumulator (> 1: autograd adds)."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            count += getattr(nxt, "variable", None) is x
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return count


def test_fused_sublayer_sends_the_streams_one_gradient() -> None:
    c = Case(S=4, iters=2)
    inp = {k: v.requires_grad_(True) for k, v in _hyper_inputs(c).items()}
    edges = {}
    for kernels in ("triton", "eager"):
        y = hyper.hyper_connection(
            *inp.values(), torch.tanh, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
        edges[kernels] = _edges_into(y.sum(), inp["x"])
    assert edges["triton"] == 1 and edges["eager"] > 1, edges  # fused: no autograd add for x


def test_partial_sums_over_several_token_and_column_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from birkhoff.kernels import mhc
    from birkhoff.kernels.mhc import coefficients

    for key in ("grad_phi", "grad_phi_fp32"):  # 34 tokens: three g_phi blocks
        monkeypatch.setitem(mhc.CONFIG, key, dict(mhc.CONFIG[key], BN=16, TOKENS=16))
    for key in ("grad_x", "grad_x_fp32"):  # 3 x 5 tiles (bf16x3: two of 16 tokens a program;
        # fma: one, whatever TOKENS says)
        monkeypatch.setitem(mhc.CONFIG, key, dict(mhc.CONFIG[key], BN=16, BC=32, TOKENS=32))
    proj = dict(mhc.CONFIG["coeff_proj"], BN=16, BC=32, PROGRAMS=12)  # 3 x 4 column splits
    monkeypatch.setitem(mhc.CONFIG, "coeff_proj", proj)
    monkeypatch.setitem(mhc.CONFIG, "mix", dict(mhc.CONFIG["mix"], BN=4, BD=16))  # several D blocks
    monkeypatch.setattr(coefficients, "TAIL_PROGRAMS", 4)  # coeff_tail: 16 tokens a program
    check_hyper(Case(S=4, D=40, B=2, T=17, iters=2), "cpu")
    check_hyper(Case(S=4, D=40, B=2, T=17, iters=2), "cpu", joint=True)
    check_sublayer(Case(S=4, D=40, B=2, T=17, iters=2), "cpu")
    check_contraction(Case(S=2, D=40, B=2, T=17), "cpu")
    check_sublayer(Case(S=4, D=40, B=2, T=17, iters=2), "cpu", torch.bfloat16)
    # one decode token (one token a program): 5 column splits, summed two per load (2 + 2 + a
    # masked 1)
    monkeypatch.setattr(coefficients, "TAIL_ELEMENTS", 2 * 1 * 32)
    check_hyper(Case(S=4, D=40, B=1, T=1, iters=3), "cpu", joint=True)


def test_served_phi_needs_no_transposing_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """phi in the engine's served layout gives the same bits as a contiguous phi, and the
    projection reads it in place (phi_pad_t never runs)."""
    from birkhoff.kernels import mhc
    from birkhoff.kernels.mhc import phi as mhc_phi

    gen = torch.Generator().manual_seed(0)
    S, D = 4, 40
    x = torch.randn(2, 3, S, D, generator=gen)
    phi, phi_c = (0.1 * torch.randn(P, S * D, generator=gen) for P in (S * S + 2 * S, S))
    alpha, bias = torch.tensor([0.5, 0.7, 0.9]), 0.1 * torch.randn(S * S + 2 * S, generator=gen)
    kw = dict(iters=3, norm_eps=1e-6, eps=1e-6)
    ref = mhc.coefficients_and_mix_in(x, phi, alpha, bias, **kw)
    ref_c = mhc.contract(x, phi_c, alpha[:1], bias[:S], norm_eps=1e-6, eps=1e-6)
    served, served_c = mhc.served_phi(phi), mhc.served_phi(phi_c)
    assert torch.equal(served, phi) and served.stride() == (1, 32) and served_c.stride() == (1, 16)

    class NoLaunch:
        def __getitem__(self, grid: object) -> None:
            raise AssertionError("phi_pad_t launched for a served phi")

    monkeypatch.setattr(mhc_phi, "phi_pad_t", NoLaunch())
    got = mhc.coefficients_and_mix_in(x, served, alpha, bias, **kw)
    got_c = mhc.contract(x, served_c, alpha[:1], bias[:S], norm_eps=1e-6, eps=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(got_c, ref_c)
    with pytest.raises(AssertionError, match="phi_pad_t launched"):  # a plain phi still copies
        mhc.contract(x, phi_c, alpha[:1], bias[:S], norm_eps=1e-6, eps=1e-6)


def test_bf16_streams_match_eager() -> None:
    check_hyper(Case(S=4, D=40, B=2, T=9, iters=3), "cpu", torch.bfloat16)
    check_hyper(Case(S=4, D=40, B=2, T=9, iters=3), "cpu", torch.bfloat16, joint=True)
    check_sublayer(Case(S=4, D=40, B=2, T=9, iters=3), "cpu", torch.bfloat16)
    check_contraction(Case(S=4, D=40, B=2, T=9), "cpu", torch.bfloat16)


@pytest.mark.parametrize("phi_in_grad_x", [False, True], ids=["grad_phi", "grad_x-phi"])
def test_bf16_streams_keep_fp32_precision(
    phi_in_grad_x: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grad_x-phi: g_phi from grad_x's pass (two blocks of 16 tokens a program, 18 tokens in two
    # programs: partials over several token blocks, one of them part-masked)
    if phi_in_grad_x:
        cfg = dict(CONFIG["grad_x"], BN=16, BC=32, TOKENS=32, PHI=True)
        monkeypatch.setitem(CONFIG, "grad_x", cfg)
    c = Case(S=4, D=40, B=2, T=9, iters=3)
    check_bf16_streams_keep_fp32_precision(c, "cpu", truncates=True)  # the interpreter's casts


SWEEP_CASE = Case(S=4, D=40, B=2, T=9, iters=3)


def interpreted(entry: dict) -> dict:
    """A CONFIG entry as the interpreter runs it on SWEEP_CASE: warps and pipeline stages
    change no result, and the mix kernels' launch clamps a D block to pow2(D) (64 here)."""
    out = {k: v for k, v in entry.items() if k not in ("num_warps", "num_stages")}
    if "BD" in out:
        out["BD"] = min(out["BD"], max(16, pow2(SWEEP_CASE.D)))
    return out


def distinct_variants() -> list[str]:
    """The SWEEP variants that change what the interpreter runs (not warps or stages alone),
    one of each."""
    seen = [(key, interpreted(entry)) for key, entry in CONFIG.items()]
    kept = []
    for variant in sorted(SWEEP):
        change = sorted((key, interpreted(entry)) for key, entry in SWEEP[variant].items())
        if all(item not in seen for item in change):
            seen += change
            kept.append(variant)
    return kept


@pytest.mark.parametrize("variant", distinct_variants())
def test_every_sweep_variant_matches_eager(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks whose streams' dtype reads the entry: fp32 streams launch a key's "_fp32"
    entry where CONFIG has one, bf16 streams the key's own."""
    for key, entry in SWEEP[variant].items():
        monkeypatch.setitem(CONFIG, key, entry)
    keys = SWEEP[variant]
    if any(not key.endswith("_fp32") for key in keys):
        check_hyper(SWEEP_CASE, "cpu", torch.bfloat16, joint=True)
    if any(key.endswith("_fp32") or f"{key}_fp32" not in CONFIG for key in keys):
        check_hyper(SWEEP_CASE, "cpu", joint=True)
        if set(keys) != {"mix"}:  # mix in / out: check_hyper ran both kernels, both directions
            check_sublayer(SWEEP_CASE, "cpu")
            check_contraction(dataclasses.replace(SWEEP_CASE, iters=6), "cpu")


@pytest.mark.parametrize("case", CASES[:5], ids=case_id)
def test_contraction_fused_matches_eager(case: Case) -> None:
    check_contraction(case, "cpu")


def _op_args(S: int = 4, D: int = 5, N: int = 3) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    P = S * S + 2 * S
    x, f = torch.randn(N, S * D, generator=g), torch.randn(N, D, generator=g)
    phi, alpha, bias = (
        torch.randn(P, S * D, generator=g),
        torch.rand(3, generator=g),
        torch.randn(P),
    )
    pre, post = torch.rand(N, S, generator=g), torch.rand(N, S, generator=g)
    res = torch.rand(N, S, S, generator=g)
    return {
        "mhc_coefficients": (x.view(N, S, D), phi, alpha, bias, 2, True, True, 1e-6, 1e-6),
        "mhc_mix_in": (x.view(N, S, D), pre),
        "mhc_mix_out": (x.view(N, S, D), f, post, res),
    }


@pytest.mark.parametrize("name", ["mhc_coefficients", "mhc_mix_in", "mhc_mix_out"])
def test_custom_op_registration(name: str) -> None:
    # schema, fake impl, autograd registration and the AOT trace of forward and backward, as
    # torch.library checks them (the trace must reach the registered backward's ops as custom
    # ops, not FusedOp's direct kernel launches on fake tensors)
    import birkhoff.kernels  # noqa: F401  (registers the ops)

    args = tuple(
        a.requires_grad_(True) if a.is_floating_point() and a.dim() else a
        for a in _op_args()[name]
        if isinstance(a, torch.Tensor)
    )
    rest = tuple(a for a in _op_args()[name] if not isinstance(a, torch.Tensor))
    torch.library.opcheck(getattr(torch.ops.birkhoff, name).default, (*args, *rest))


def test_compile_traces_the_block_without_graph_break() -> None:
    case = Case(S=4, iters=2)
    inp = {k: v.requires_grad_(True) for k, v in _hyper_inputs(case).items()}

    def block(x, phi, alpha, bias):  # type: ignore[no-untyped-def]
        pre, post, res = hyper.mhc_coefficients(
            x, phi, alpha, bias, iters=case.iters, norm_eps=1e-6, kernels="triton"
        )
        y = hyper.mix_out(
            x, torch.tanh(hyper.mix_in(x, pre, kernels="triton")), post, res, kernels="triton"
        )
        return y.square().sum()

    def sublayer(x, phi, alpha, bias):  # type: ignore[no-untyped-def]
        y = hyper.hyper_connection(
            x, phi, alpha, bias, torch.tanh, iters=case.iters, norm_eps=1e-6, kernels="triton"
        )  # the autograd node that hands mix out's g_x to the coefficient op's backward
        return y.square().sum()

    # aot_eager: AOTAutograd traces the backward too, and the node's view output of x
    for fn, backend in ((block, "eager"), (sublayer, "eager"), (sublayer, "aot_eager")):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        loss = compiled(**inp)
        grads = torch.autograd.grad(loss, list(inp.values()))
        ref = fn(**inp)
        ref_grads = torch.autograd.grad(ref, list(inp.values()))
        torch.testing.assert_close(loss, ref)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r)


def _hyper_inputs(case: Case) -> dict[str, torch.Tensor]:
    inp = make_inputs(case, "cpu", torch.float32)
    return {k: inp[k] for k in ("x", "phi", "alpha", "bias")}


def test_train_step_fused_matches_eager() -> None:
    check_train_step("cpu", autocast=False, loss_tol=1e-6, grad_tol=1e-4, shape=(1, 5))


def test_checkpointed_blocks_rerun_fused_kernels_under_safe_reclaim() -> None:
    check_safe_reclaim("cpu", shape=(1, 5))
