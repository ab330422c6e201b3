"""Whole-model checks with the fused mHC ops, shared by the interpreter and the CUDA tests.

- a train step (loss + every parameter gradient) with kernels="triton" vs "eager";
- engine greedy tokens (plain and MTP-speculative) with the fused vs the eager ops (mHC, RMSNorm,
  rope);
- full recompute with safe reclaim: checkpointed blocks rerun the fused kernels, the registry
  sees what they save (reclaim decisions as in the eager model), nothing leaks, and the sanitizer
  finds no use-after-free.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
from torch import Tensor

from birkhoff.config import Kernels, ModelConfig
from birkhoff.model import Transformer, hyper


def tiny_config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=32, dim=16, num_layers=2, num_heads=2, num_streams=4, mtp_depth=1,
        max_seq_len=24, sinkhorn_iters=4,
    )  # fmt: skip
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def build_model(cfg: ModelConfig, device: str, kernels: Kernels) -> Transformer:
    """The model with every mHC op (contractions included) on `kernels`."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    with torch.no_grad():  # move alpha away from its 0.01 init so the dynamic path matters
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.fill_(0.5)
    return hyper.apply_kernels(model, kernels)


def token_ids(cfg: ModelConfig, device: str, shape: tuple[int, int]) -> Tensor:
    ids = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    return ids.to(device)


@functools.cache  # the fused run is the reference of the train step and safe reclaim checks
def loss_and_grads(
    cfg: ModelConfig,
    device: str,
    kernels: Kernels,
    *,
    autocast: bool = False,
    shape: tuple[int, int] = (2, 12),
) -> tuple[Tensor, dict[str, Tensor]]:
    model = build_model(cfg, device, kernels)
    ids = token_ids(cfg, device, shape)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext()
    with amp:
        out = model(ids, labels=ids)
    assert out.loss is not None
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def check_train_step(
    device: str, *, autocast: bool, loss_tol: float, grad_tol: float,
    shape: tuple[int, int] = (2, 12),
) -> None:  # fmt: skip
    cfg = tiny_config()
    loss_f, grads_f = loss_and_grads(cfg, device, "triton", autocast=autocast, shape=shape)
    loss_e, grads_e = loss_and_grads(cfg, device, "eager", autocast=autocast, shape=shape)
    assert abs(loss_f.item() - loss_e.item()) <= loss_tol * abs(loss_e.item()), (loss_f, loss_e)
    assert grads_f.keys() == grads_e.keys()
    assert any("phi" in n for n in grads_f) and any("contraction.alpha" in n for n in grads_f)
    for name, g in grads_e.items():
        err = (grads_f[name] - g).abs().max().item()
        assert err <= grad_tol * max(1e-3, g.abs().max().item()), (name, err)


def check_engine_tokens(device: str, *, num_new: int = 8, num_layers: int = 2) -> None:
    """Fused and eager engines give the same greedy tokens (plain, speculative, one row), and
    the same seeded sampled tokens (speculative: the fused sampler draws as the eager one at
    every site), with close logprobs."""
    from birkhoff.engine import Engine, SamplingParams

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    tokens, sampled = {}, {}
    for kernels in ("triton", "eager"):  # the engine's mHC ops, norms and rope all follow it
        model = build_model(tiny_config(mtp_depth=2, num_layers=num_layers), device, kernels)
        engine = Engine.from_model(model, device=device, dtype=torch.float32, kernels=kernels)
        phis = [n for n in engine.committed if n.endswith(".phi")]
        assert phis and all(torch.equal(engine.weights[n], engine.committed[n]) for n in phis)
        # fused: phi served re-laid for the projection (no transposing launch per step)
        assert all((engine.weights[n] is engine.committed[n]) == (kernels == "eager") for n in phis)
        plain = engine.generate(prompts, SamplingParams(num_new))
        spec = engine.generate(prompts, SamplingParams(num_new, num_speculative_tokens=2))
        single = engine.generate(prompts[1:2], SamplingParams(num_new))  # one row: gemv
        tokens[kernels] = ([c.tokens for c in plain], [c.tokens for c in spec], single[0].tokens)
        # speculative: every sampling site (prefill's token, the drafts, the verify pass)
        params = SamplingParams(num_new, temperature=0.9, seed=5, num_speculative_tokens=2)
        sampled[kernels] = engine.generate(prompts, params)
    assert tokens["triton"] == tokens["eager"]
    fused, eager = sampled["triton"], sampled["eager"]
    assert [c.tokens for c in fused] == [c.tokens for c in eager]
    for f, e in zip(fused, eager, strict=True):
        assert max(abs(a - b) for a, b in zip(f.logprobs, e.logprobs, strict=True)) < 1e-4
    assert tokens["triton"][0] == tokens["triton"][1]  # greedy speculative == plain
    assert tokens["triton"][2] == tokens["triton"][0][1]  # alone as in a batch


def check_safe_reclaim(device: str, *, shape: tuple[int, int] = (2, 12)) -> None:
    from birkhoff.recompute import census, sanitize, track_saved_storages
    from birkhoff.train.recompute import apply_recompute

    cfg = tiny_config()
    ref_loss, ref_grads = loss_and_grads(cfg, device, "triton", autocast=False, shape=shape)
    model = apply_recompute(build_model(cfg, device, "triton"), reclaim="safe")
    ids = token_ids(cfg, device, shape)
    with sanitize():
        with track_saved_storages() as registry:
            out = model(ids, labels=ids)
        assert out.loss is not None
        out.loss.backward()
    assert torch.equal(out.loss.detach(), ref_loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, ref_grads[name]), name
    assert sorted(registry.freed.values()) == ["layers.0", "layers.1", "mtp.0", "mtp.0"], (
        registry.freed
    )
    del out
    assert census().live_bytes == 0
