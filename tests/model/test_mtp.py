"""MTP: per-depth label/mask shift on a hand-made example, loss wiring, the stream contract."""

import pytest
import torch
import torch.nn.functional as F

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.mtp import MTPDepth, combine_losses, masked_token_ce, mtp_merge, shift_targets


def test_shift_targets_hand_made() -> None:
    labels = torch.tensor([[10, 11, 12, 13, 14]])
    mask = torch.tensor([[False, True, True, True, True]])
    t1, m1 = shift_targets(labels, mask, 1)  # main head: position i predicts labels[i+1]
    assert t1[0, :4].tolist() == [11, 12, 13, 14]
    assert m1.tolist() == [[True, True, True, True, False]]
    t2, m2 = shift_targets(labels, mask, 2)  # MTP depth 1: position i predicts labels[i+2]
    assert t2[0, :3].tolist() == [12, 13, 14]
    assert m2.tolist() == [[True, True, True, False, False]]
    # the answer mask is rolled with the labels: a masked target stays masked after the shift
    _, m3 = shift_targets(labels, torch.tensor([[True, True, False, True, True]]), 2)
    assert m3.tolist() == [[False, True, True, False, False]]


def test_all_masked_batch_gives_zero_not_nan() -> None:
    loss = masked_token_ce(
        torch.randn(1, 3, 4),
        torch.randn(5, 4),
        torch.zeros(1, 3, dtype=torch.long),
        torch.zeros(1, 3, dtype=torch.bool),
    )
    assert loss.item() == 0.0


def test_combine_losses_weights_the_mean_over_depths() -> None:
    main, mtp = torch.tensor(2.0), [torch.tensor(1.0), torch.tensor(3.0)]
    assert combine_losses(main, mtp, 0.3).item() == pytest.approx(2.0 + 0.3 / 2 * 4.0)
    assert combine_losses(main, [], 0.3).item() == 2.0


def test_mtp_losses_use_shift_k_plus_one() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, dim=16, num_layers=1, num_heads=2, mtp_depth=2)
    model = Transformer(cfg).double()
    ids = torch.randint(0, 13, (2, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :3] = False
    out = model(ids, labels=ids, loss_mask=mask)
    heads = model.mtp_hidden(model.decoder(ids).multistream, ids)
    for k, h in enumerate(heads, start=1):
        logits = model.lm_head(h)
        nll, count = 0.0, 0
        for b in range(2):
            for i in range(9 - k - 1):
                if mask[b, i + k + 1]:
                    nll += F.cross_entropy(logits[b, i], ids[b, i + k + 1]).item()
                    count += 1
        assert out.mtp_losses[k - 1].item() == pytest.approx(nll / count, abs=1e-10)
    expected = out.main_loss + 0.3 / 2 * (out.mtp_losses[0] + out.mtp_losses[1])
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-12)


def test_mtp_depth_sees_embedding_of_token_i_plus_k() -> None:
    # Changing token j must not change depth-1 outputs at positions i < j - 1 (causality with
    # the t_{i+1} embedding), but must change position j - 1.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, dim=16, num_layers=1, num_heads=2, mtp_depth=1)
    model = Transformer(cfg).double()
    ids = torch.randint(0, 13, (1, 8))
    ids2 = ids.clone()
    ids2[0, 5] = (ids[0, 5] + 1) % 13
    h1 = model.mtp_hidden(model.decoder(ids).multistream, ids)[0]
    h2 = model.mtp_hidden(model.decoder(ids2).multistream, ids2)[0]
    assert torch.equal(h1[:, :4], h2[:, :4])
    assert not torch.allclose(h1[:, 4], h2[:, 4])


def test_contracted_hidden_is_rejected_with_expected_shape() -> None:
    cfg = ModelConfig(vocab_size=13, dim=16, num_layers=1, num_heads=2, num_streams=4)
    model = Transformer(cfg)
    ids = torch.zeros(2, 5, dtype=torch.long)
    hidden = model.decoder(ids).hidden
    with pytest.raises(ValueError, match=r"\[B,T,S=4,D\].*\(2, 5, 16\)"):
        model.mtp_hidden(hidden, ids)


def test_merge_is_norms_concat_projection_per_stream() -> None:
    """mtp_merge (shared by trainer and engine) against the formula written out per stream."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, dim=8, num_layers=1, num_heads=2, num_streams=3, mtp_depth=1)
    depth = MTPDepth(cfg, 0).double()
    with torch.no_grad():
        depth.hidden_norm.weight.uniform_(0.5, 1.5)
        depth.embed_norm.weight.uniform_(0.5, 1.5)
    h, emb = torch.randn(2, 4, 3, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt() * w

    W = depth.proj.weight
    expected = torch.stack([torch.cat((norm(h[:, :, s], depth.hidden_norm.weight),
                                       norm(emb, depth.embed_norm.weight)), -1) @ W.t()
                            for s in range(3)], dim=2)  # fmt: skip
    torch.testing.assert_close(depth.merge(h, emb), expected, rtol=1e-12, atol=1e-12)
    merged = mtp_merge(h, emb, depth.hidden_norm.weight, depth.embed_norm.weight,
                       eps=cfg.norm_eps, project=lambda x: x @ W.t())  # fmt: skip
    torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)


def test_v4_mtp_depths_are_sliding_top_k_moe_blocks() -> None:
    """DeepSeek-V4's MTP layer: sliding-window attention (compress ratio 0) and a top-k MoE,
    whatever the main layers are (here all compressed, the first ones hash-routed)."""
    from birkhoff.config import MoEConfig, V4AttentionConfig
    from birkhoff.model.moe import HashMoEFeedForward, MoEFeedForward

    kinds = ("compressed_sparse_attention", "heavily_compressed_attention")
    attention = V4AttentionConfig(
        q_lora_rank=8,
        head_dim=16,
        qk_rope_head_dim=8,
        layer_types=kinds,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
    )
    moe = MoEConfig(
        num_experts=4, experts_per_token=2, expert_hidden=16, num_dense_layers=0, num_hash_layers=2
    )
    cfg = ModelConfig(vocab_size=32, dim=32, num_layers=2, num_heads=4, num_kv_heads=1,
                      mtp_depth=2, attention=attention, moe=moe)  # fmt: skip
    model = Transformer(cfg)
    assert [b.attn.compressor is not None for b in model.layers] == [True, True]
    for depth in model.mtp_depths:
        assert depth.block.attn.layer_type == "sliding_attention"
        assert depth.block.attn.compressor is None
        assert isinstance(depth.block.mlp, MoEFeedForward)
        assert not isinstance(depth.block.mlp, HashMoEFeedForward)


def test_merge_is_v4s_two_projections() -> None:
    """V4's merge e_proj(enorm(emb)) + h_proj(hnorm(h)) is birkhoff's with proj = [h_proj |
    e_proj] along the input dim (the import's mapping, interop/v4_names.py)."""
    torch.manual_seed(0)
    D = 8
    h, emb = torch.randn(2, 3, 4, D, dtype=torch.float64), torch.randn(2, 3, D, dtype=torch.float64)
    h_proj, e_proj = torch.randn(D, D, dtype=torch.float64), torch.randn(D, D, dtype=torch.float64)
    hnorm, enorm = torch.rand(D, dtype=torch.float64), torch.rand(D, dtype=torch.float64)
    proj = torch.cat([h_proj, e_proj], dim=1)
    ours = mtp_merge(h, emb, hnorm, enorm, eps=1e-6, project=lambda x: x @ proj.T)
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    theirs = rms(emb, enorm)[:, :, None] @ e_proj.T + rms(h, hnorm) @ h_proj.T
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-14)
