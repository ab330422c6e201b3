"""DeepSeek-V4 attention, each layer kind on its own, against transformers' DeepseekV4Attention
on the same weights: fp64 values and gradients equal to the last bit, fp32 within 1e-5 of the
output scale. Plus the pieces: partial rope, the compressors' windows, the indexer's picks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from v4_helpers import KINDS, build_pair, ref, reference_fp64

from birkhoff.model.v4_attention import sliding_window_mask, v4_rope
from birkhoff.model.v4_compressor import (
    apply_partial_rope,
    overlapping_windows,
    top_entries,
    visible_entries,
)

T = 24  # 6 CSA entries (rate 4) with top-3 picks, 3 HCA entries (rate 8), window 6


def run_reference(reference, layer: int, x: Tensor) -> Tensor:
    """The reference attention of `layer` over positions 0..T-1 with its sliding mask."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    pos = torch.arange(x.shape[1])[None]
    rotary = reference.model.rotary_emb
    rope = {kind: rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=reference.config, inputs_embeds=x, attention_mask=None, cache=None,
        position_ids=pos,
    )  # fmt: skip
    attn = reference.model.layers[layer].self_attn
    return attn(x, position_embeddings=rope, position_ids=pos, attention_mask=mask)[0]


def attention_pair(layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, dict, dict]:
    """(reference out, birkhoff out, their grads by birkhoff name incl. 'x') for a cotangent."""
    reference, model, _ = build_pair(dtype=dtype)
    x = torch.randn(2, T, 32, dtype=dtype, generator=torch.Generator().manual_seed(5))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    if dtype == torch.float64:
        with reference_fp64():
            y_ref = run_reference(reference, layer, x_ref)
    else:
        y_ref = run_reference(reference, layer, x_ref)
    ours = model.blocks[layer].attn
    y_ours = ours(x_ours, v4_rope(torch.arange(T)[None], model.cfg))
    g = torch.randn(y_ref.shape, dtype=dtype, generator=torch.Generator().manual_seed(6))
    (y_ref * g).sum().backward()
    (y_ours * g).sum().backward()
    theirs = dict(reference.model.layers[layer].self_attn.named_parameters())
    grads_ref = {"x": x_ref.grad} | {n: p.grad for n, p in theirs.items()}
    grads_ours = {"x": x_ours.grad} | {n: p.grad for n, p in ours.named_parameters()}
    return y_ref, y_ours, grads_ref, grads_ours


@pytest.mark.parametrize("layer", range(3), ids=KINDS)
def test_each_kind_equals_transformers_in_fp64_to_the_last_bit(layer: int) -> None:
    y_ref, y_ours, grads_ref, grads_ours = attention_pair(layer, torch.float64)
    assert torch.equal(y_ours, y_ref)
    assert grads_ours.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        if g is None:  # the indexer: picks indices, no gradient reaches it (in either)
            assert ".indexer." in f".{name}" and grads_ours[name] is None, name
            continue
        assert torch.equal(grads_ours[name], g), name


@pytest.mark.parametrize("layer", range(3), ids=KINDS)
def test_each_kind_matches_transformers_in_fp32(layer: int) -> None:
    """fp32: the reference computes rope angles in fp32, birkhoff in fp64 (then casts)."""
    y_ref, y_ours, grads_ref, grads_ours = attention_pair(layer, torch.float32)
    assert (y_ours - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    for name, g in grads_ref.items():
        if g is not None:
            assert (grads_ours[name] - g).abs().max() <= 1e-5 * g.abs().max(), name


def test_partial_rope_is_transformers_interleaved_rope_on_the_trailing_slice() -> None:
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    angles = torch.rand(2, 5, 4, dtype=torch.float64) * 6
    ours = apply_partial_rope(x, angles.cos(), angles.sin())
    with reference_fp64():
        assert torch.equal(ours, ref.apply_rotary_pos_emb(x, angles.cos(), angles.sin()))
    assert torch.equal(ours[..., :8], x[..., :8])  # the leading channels pass unchanged
    back = apply_partial_rope(ours, angles.cos(), -angles.sin())
    torch.testing.assert_close(back, x, rtol=0, atol=1e-14)


def test_masks_sliding_window_and_complete_windows_only() -> None:
    mask = sliding_window_mask(6, 3, torch.device("cpu"))
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]
    visible = visible_entries(9, 2, 4, torch.device("cpu"))  # entry w once t >= 4w + 3
    assert visible[:, 0].tolist() == [False] * 3 + [True] * 6
    assert visible[:, 1].tolist() == [False] * 7 + [True] * 2


def test_csa_entries_pool_the_previous_windows_first_series() -> None:
    kv = torch.arange(2 * 3 * 2 * 4, dtype=torch.float64).view(2, 3, 2, 4)  # B Y m 2K, K=2
    slots, gate = overlapping_windows(kv, kv.clone(), 2)
    assert slots.shape == (2, 3, 4, 2)
    assert torch.equal(slots[:, :, 2:], kv[..., 2:])  # Cb of window w
    assert torch.equal(slots[:, 1:, :2], kv[:, :-1, :, :2])  # Ca of window w-1
    assert torch.equal(slots[:, 0, :2], torch.zeros(2, 2, 2))
    assert torch.isneginf(gate[:, 0, :2]).all()  # weight 0 in the softmax


def test_top_entries_keeps_the_best_visible_and_drops_early_picks() -> None:
    scores = torch.tensor([[[5.0, 1.0, 3.0, 9.0]] * 3])  # B=1, T=3, Y=4
    visible = torch.tensor([[False] * 4, [True, False, False, False], [True, True, True, False]])
    picked = top_entries(scores, visible, 2)
    assert picked[0].tolist() == [
        [False] * 4,  # nothing complete yet: both picks dropped
        [True, False, False, False],  # one visible entry
        [True, False, True, False],  # best two of three; entry 3 (score 9) is in the future
    ]
