"""The HuggingFace drop-in on tiny transformers models built here (nothing downloaded).

A Llama-family model and a Mixtral MoE with router logits and the auxiliary balance loss, fp64:
loss and every gradient identical to the un-checkpointed run, hidden states readable after
backward, no tensor with a grad_fn left after several steps (gc off, so cycles would show), and
no live activation bytes after backward (census).
"""

from __future__ import annotations

import copy
import functools
import gc
import warnings

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

import birkhoff.recompute.hf as hf  # noqa: E402
from birkhoff.recompute import census, track_saved_storages  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SIZES)
    else:
        cfg = transformers.MixtralConfig(
            **SIZES, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.1,
        )  # fmt: skip
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    return transformers.AutoModelForCausalLM.from_config(cfg).double().train()


def step(model: nn.Module, ids: Tensor) -> tuple[Tensor, tuple[Tensor, ...], set[str]]:
    """Forward (tracked) + backward: the loss, the hidden states, the checkpoints that ran."""
    with track_saved_storages() as registry:
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    return out.loss.detach(), out.hidden_states, {label for _, label in registry.released.values()}


def ids_for(model: nn.Module) -> Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("reclaim", ["safe", "never"])
def test_drop_in_is_exact_and_keeps_hidden_states(kind: str, reclaim: str) -> None:
    ref_model = build(kind)
    model = copy.deepcopy(ref_model)
    hf.enable(model, reclaim=reclaim)
    assert model.model.layers[0].gradient_checkpointing
    ids = ids_for(model)
    ref_loss, ref_hidden, _ = step(ref_model, ids)
    loss, hidden, released = step(model, ids)
    assert released == ({"model.layers.0", "model.layers.1"} if reclaim == "safe" else set())
    assert torch.equal(loss, ref_loss)
    for (name, p), (_, q) in zip(
        model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    for h, r in zip(hidden, ref_hidden, strict=True):  # read after backward: all intact
        assert h.untyped_storage().nbytes() > 0 and torch.equal(h, r)


def grad_fn_tensors() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_no_graph_leak_and_no_live_activations(kind: str) -> None:
    model = build(kind)
    hf.enable(model, reclaim="safe")
    ids = ids_for(model)
    gc.collect()
    gc.disable()
    try:
        before = grad_fn_tensors()
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss, hidden, _ = step(model, ids)
            del loss, hidden
            assert grad_fn_tensors() == before
            assert census().live_bytes == 0
    finally:
        gc.enable()


def test_labels_are_layer_names_and_options_are_refused() -> None:
    model = build("llama")
    hf.enable(model, reclaim="safe")
    func = model.model.layers[1]._gradient_checkpointing_func
    layer = model.model.layers[1]
    h = torch.randn(1, 3, 32, dtype=torch.float64, requires_grad=True)

    def forward(layer: nn.Module, x: Tensor) -> Tensor:
        return x.sin()

    y = func(functools.partial(forward, layer), h * 1.0)
    with pytest.raises(ValueError, match="use_reentrant"):
        func(functools.partial(forward, layer), h, use_reentrant=False)
    with pytest.raises(ValueError, match="reclaim='maybe'"):
        hf.enable(model, reclaim="maybe")  # type: ignore[arg-type]
    assert y.requires_grad
    disable = getattr(model, "activation_checkpointing_disable", None)  # transformers >= 5.x
    (disable or model.gradient_checkpointing_disable)()  # the model's own switch undoes enable()
    assert not layer.gradient_checkpointing
