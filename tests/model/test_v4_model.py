"""The whole DeepSeek-V4 model (every attention kind, mHC; dense or V4 MoE feed-forward)
against transformers' DeepseekV4ForCausalLM on the same weights; its config; recompute.

Dense, fp64: logits and every parameter gradient (of one cross-entropy applied to both models'
logits) equal to the last bit; birkhoff's own loss path within 1e-15 relative of transformers'.
MoE (hash + top-k layers), fp64: within 1e-14 of scale (the expert sums are ordered otherwise).
fp32: within 1e-5 of scale (the reference's rope angles are fp32, birkhoff's fp64).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from v4_helpers import build_pair, reference_fp64, reference_logits

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.model import Transformer
from birkhoff.recompute import census, sanitize, track_saved_storages
from birkhoff.train.recompute import apply_recompute

T = 24


def ids_BT(vocab: int = 61) -> Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


def next_token_ce(logits_BTV: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def reference_grad(params: dict[str, Tensor], names: tuple[str, ...]) -> Tensor | None:
    grads = [params[n].grad for n in names]
    return None if grads[0] is None else torch.cat(grads)  # type: ignore[arg-type]


def compare(
    dtype: torch.dtype, *, moe: bool = False
) -> tuple[Tensor, Tensor, list[tuple[str, Tensor | None, Tensor | None]]]:
    """(reference logits, ours, [(name, our grad, reference grad)]) after one backward each."""
    reference, model, names = build_pair(dtype=dtype, moe=moe)
    ids = ids_BT()
    logits_ref = reference_logits(reference, ids)
    logits = model(ids).logits
    next_token_ce(logits_ref, ids).backward()
    next_token_ce(logits, ids).backward()
    theirs = dict(reference.named_parameters())
    grads = [(n, p.grad, reference_grad(theirs, names[n])) for n, p in model.named_parameters()]
    return logits_ref, logits, grads


def test_model_equals_transformers_in_fp64_to_the_last_bit() -> None:
    logits_ref, logits, grads = compare(torch.float64)
    assert torch.equal(logits, logits_ref)
    assert any(".compressor.indexer." in n for n, _, _ in grads)
    for name, ours, theirs in grads:
        if ".indexer." in name:  # picks indices only: the LM loss trains no indexer weight
            assert ours is None and theirs is None, name
            continue
        assert ours is not None and theirs is not None and torch.equal(ours, theirs), name


def test_model_loss_equals_transformers_in_fp64() -> None:
    reference, model, _ = build_pair(dtype=torch.float64)
    ids = ids_BT()
    with reference_fp64():
        loss_ref = reference(input_ids=ids, labels=ids).loss
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, loss_ref, rtol=1e-15, atol=0)
    assert out.mtp_losses == []


@pytest.mark.parametrize(
    ("dtype", "moe", "tol"),
    [(torch.float32, False, 1e-5), (torch.float64, True, 1e-14), (torch.float32, True, 1e-5)],
    ids=["fp32-dense", "fp64-moe", "fp32-moe"],
)
def test_model_matches_transformers_within_tolerance(
    dtype: torch.dtype, moe: bool, tol: float
) -> None:
    logits_ref, logits, grads = compare(dtype, moe=moe)
    assert (logits - logits_ref).abs().max() <= tol * logits_ref.abs().max()
    assert not moe or any(".mlp.tid2eid" in n for n in build_pair(moe=True)[2])
    for name, ours, theirs in grads:
        assert (ours is None) == (theirs is None), name
        if ours is not None and theirs is not None:
            assert (ours - theirs).abs().max() <= tol * theirs.abs().max(), name


def loss_and_grads(model: Transformer, ids: Tensor) -> tuple[Tensor, dict[str, Tensor | None]]:
    with track_saved_storages():
        out = model(ids, labels=ids)
    out.loss.backward()
    loss = out.loss.detach().clone()
    del out
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_safe_recompute_over_v4_blocks_is_identical_and_leaks_nothing(moe: bool) -> None:
    _, model, _ = build_pair(dtype=torch.float64, moe=moe)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = ids_BT()
    loss_ref, grads_ref = loss_and_grads(model, ids)
    again = Transformer(model.cfg).double()
    again.load_state_dict(state)
    apply_recompute(again, reclaim="safe")
    with sanitize():
        loss, grads = loss_and_grads(again, ids)
    assert torch.equal(loss, loss_ref)
    for name, g in grads_ref.items():
        ours = grads[name]
        assert (g is None and ours is None) or (
            g is not None and ours is not None and torch.equal(ours, g)
        ), name
    assert census().live_bytes == 0


V4 = V4AttentionConfig(
    q_lora_rank=8, head_dim=16, qk_rope_head_dim=8, index_head_dim=8, index_n_heads=2,
    index_topk=4, o_groups=2, o_lora_rank=8,
    layer_types=("sliding_attention", "compressed_sparse_attention"),
)  # fmt: skip
BASE = ModelConfig(vocab_size=32, dim=24, num_layers=2, num_heads=4, num_kv_heads=1, attention=V4)


def test_v4_config_round_trips_through_json_and_picks_the_head_dim() -> None:
    assert ModelConfig.from_dict(json.loads(BASE.to_json())) == BASE
    assert BASE.head_dim == 16  # the V4 head dim, not dim // num_heads
    assert V4.layer_type(1) == "compressed_sparse_attention"
    assert V4.layer_type(2) == "sliding_attention"  # past the decoder (MTP depths)
    with pytest.raises(ValueError, match="unknown field"):
        V4AttentionConfig.from_dict({"colour": 1})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(num_kv_heads=None), "num_kv_heads"),
        (dict(num_layers=3), "attention.layer_types"),
        (dict(num_heads=5), "attention.o_groups"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(rope_scaling="linear", rope_factor=2.0), "rope_scaling"),
    ],
)
def test_v4_model_config_rejects_what_v4_attention_has_not(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BASE.replace(**change)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("qk_rope_head_dim", 18),
        ("qk_rope_head_dim", 3),
        ("index_head_dim", 4),
        ("layer_types", ("sliding_attention", "full_attention")),
        ("q_lora_rank", 0),
        ("compress_rope_theta", float("inf")),
    ],
)
def test_v4_attention_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        V4AttentionConfig(**{**{f: getattr(V4, f) for f in V4.__slots__}, field: value})
