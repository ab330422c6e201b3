"""Upcycling to S streams + M MTP depths: dense logits at init, symmetry broken by training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, hf_logits, save_hf_model

from birkhoff.interop import upcycle
from birkhoff.interop.hf import import_hf
from birkhoff.model.hyper import mhc_coefficients
from birkhoff.model.transformer import Transformer
from birkhoff.runtime.checkpoint import load_checkpoint


def upcycled(tmp_path: Path, case: str, *, num_streams: int, mtp_depth: int) -> Transformer:
    hf_dir = tmp_path / "hf"
    if not hf_dir.exists():
        save_hf_model(build_hf_model(case), hf_dir)
    out = tmp_path / f"ckpt-{num_streams}-{mtp_depth}"
    import_hf(hf_dir, out, num_streams=num_streams, mtp_depth=mtp_depth)
    return load_checkpoint(out).model


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", ["llama-gqa", "qwen3-qknorm", "qwen2-bias"])
def test_upcycled_logits_equal_dense(case: str, tmp_path: Path) -> None:
    dense = upcycled(tmp_path, case, num_streams=1, mtp_depth=0)
    wide = upcycled(tmp_path, case, num_streams=4, mtp_depth=2)
    assert wide.cfg.num_streams == 4 and len(wide.mtp_depths) == 2
    with torch.no_grad():
        dense_BTV, wide_BTV = dense(ids()).logits, wide(ids()).logits
    # the eps of H_pre / Sinkhorn: relative deviations ~1e-6 per sublayer
    torch.testing.assert_close(wide_BTV, dense_BTV, atol=2e-5, rtol=0)
    hf_model = build_hf_model(case)
    torch.testing.assert_close(wide_BTV, hf_logits(hf_model, ids()), atol=1e-4, rtol=0)


def test_coefficients_at_init_follow_the_derivation(tmp_path: Path) -> None:
    model = upcycled(tmp_path, "llama-gqa", num_streams=4, mtp_depth=1)
    x_BTSD = torch.randn(1, 3, 4, 32)
    c = upcycle.column_sum(model.cfg)
    assert 0 < 1 - c < 2e-6  # Sinkhorn's eps: columns sum to s / (s + eps)
    sublayers = [(model.blocks[0].hc_attn, 0), (model.blocks[1].hc_mlp, 3),
                 (model.mtp_depths[0].block.hc_attn, 0)]  # fmt: skip
    for hc, chain_index in sublayers:
        pre, post, res = mhc_coefficients(
            x_BTSD, hc.phi, hc.alpha, hc.bias, iters=hc.iters, norm_eps=hc.norm_eps
        )
        torch.testing.assert_close(pre.sum(-1), torch.ones(1, 3), atol=1e-6, rtol=0)
        # H_post = c^(n+1) makes up for the residual's c per sublayer (upcycle.py)
        torch.testing.assert_close(post, torch.full_like(post, c ** (chain_index + 1)),
                                   atol=1e-7, rtol=0)  # fmt: skip
        torch.testing.assert_close(res.sum(-2), torch.full((1, 3, 4), c), atol=1e-7, rtol=0)
        assert len(set(pre[0, 0].tolist())) == 2  # home stream weighted: not uniform
    with torch.no_grad():
        streams_BTSD = model.decoder(ids()).multistream
    torch.testing.assert_close(streams_BTSD, streams_BTSD[:, :, :1].expand_as(streams_BTSD))


def stream_spread(model: Transformer) -> float:
    """max |x_s - mean_s x| / max |x| of the decoder's multistream."""
    with torch.no_grad():
        x_BTSD = model.decoder(ids(1)).multistream
    return float((x_BTSD - x_BTSD.mean(2, keepdim=True)).abs().max() / x_BTSD.abs().max())


def train(model: Transformer, num_steps: int, lr: float = 0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(num_steps):
        batch = ids(100 + step % 2)
        out = model(batch, labels=batch)
        assert out.loss is not None
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append([float(loss.detach()) for loss in (out.main_loss, *out.mtp_losses)])
    return losses


def test_training_breaks_stream_symmetry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = upcycled(tmp_path, "llama-gqa", num_streams=4, mtp_depth=0)
    assert stream_spread(model) < 1e-6
    train(model, 3)
    broken = stream_spread(model)
    assert broken > 1e-4
    # control: uniform weights + a permutation-symmetric H_res keep the streams identical
    monkeypatch.setattr(upcycle, "OFF_HOME_WEIGHT", 0.25)
    symmetric = upcycled(tmp_path / "sym", "llama-gqa", num_streams=4, mtp_depth=0)
    train(symmetric, 3)
    assert stream_spread(symmetric) < 1e-6 < broken / 100


def test_mtp_depth_learns_from_its_loss(tmp_path: Path) -> None:
    model = upcycled(tmp_path, "llama-gqa", num_streams=4, mtp_depth=1)
    proj = model.mtp_depths[0].proj.weight
    torch.testing.assert_close(proj[:, :32], torch.eye(32))
    assert torch.equal(proj[:, 32:], torch.zeros(32, 32))
    losses = train(model, 12, lr=0.1)
    assert losses[-1][1] < 0.9 * losses[0][1]
    assert model.mtp_depths[0].proj.weight[:, 32:].abs().max() > 0  # the embedding half moved
