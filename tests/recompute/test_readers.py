"""Every reader counts: the failures of issue 11 as regression tests.

1. a tensor the caller (or a module attribute, or a hook) holds is never freed;
2. no graph leaks across steps when fn has a branch backward never reaches;
3. values leaving fn through a side channel keep their gradients;
4. labels of functools.partial name the wrapped function;
plus torch.autograd.grad, and the MoE stash leak against torch's reentrant checkpoint.
"""

from __future__ import annotations

import functools
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from birkhoff.recompute import census, checkpoint, default_label, track_saved_storages

RECLAIMS = ["never", "safe"]


@pytest.mark.parametrize("reclaim", RECLAIMS)
def test_caller_held_output_survives_backward(reclaim: str) -> None:
    """Issue 11.1: the output of one checkpoint, input of the next, kept by the caller."""
    g = torch.Generator().manual_seed(0)
    W1 = torch.randn(16, 16, generator=g, requires_grad=True)
    W2 = torch.randn(16, 16, generator=g, requires_grad=True)
    x = torch.randn(4, 16, generator=g)
    with track_saved_storages():
        h = checkpoint(lambda t: torch.tanh(t @ W1), x, reclaim=reclaim)
        y = checkpoint(lambda t: torch.tanh(t @ W2), h, reclaim=reclaim)
        y.sum().backward()
    assert h.untyped_storage().nbytes() == 4 * 16 * 4
    assert torch.equal(h, torch.tanh(x @ W1).detach())


@pytest.mark.parametrize("reclaim", RECLAIMS)
def test_attribute_and_hook_held_tensors_survive(reclaim: str) -> None:
    lin = nn.Linear(8, 8, dtype=torch.float64)
    logged: list[Tensor] = []
    lin.register_forward_hook(lambda m, args, out: logged.append(out))  # a logging hook

    def block(t: Tensor) -> Tensor:
        lin.last_input = t  # a module attribute holding the checkpoint's input
        return torch.tanh(lin(t))

    x0 = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with track_saved_storages():
        x = x0 * 2.0
        out = checkpoint(block, x, reclaim=reclaim, name="block")
    want_in = x.detach().clone()
    want_out = F.linear(want_in, lin.weight, lin.bias).detach()
    del x
    out.sum().backward()
    assert torch.equal(lin.last_input, want_in)  # the rerun's alias: same storage, intact
    assert torch.equal(logged[0], want_out)  # the forward's output, logged by the hook
    assert len(logged) == 2  # the rerun calls the hook again, like torch.utils.checkpoint


def router_block(w_gate: Tensor, w: Tensor, aux: list[Tensor]) -> functools.partial:
    """A block with a top-k router: its indices branch is never reached by backward."""

    def fn(x: Tensor) -> Tensor:
        probs = F.softmax(x @ w_gate, dim=-1)
        top_p, top_i = probs.topk(2, dim=-1)  # top_i: no gradient; top_p: used below
        aux.append(probs.mean(0).square().sum())  # side channel: a balance loss
        gate = torch.zeros_like(probs).scatter(-1, top_i, top_p)
        return x + torch.tanh(x @ w) * gate.sum(-1, keepdim=True)

    return functools.partial(fn)


def grad_fn_tensors() -> int:
    with warnings.catch_warnings():  # isinstance on some deprecated module proxies warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("reclaim", RECLAIMS)
def test_no_graph_leak_over_steps(reclaim: str) -> None:
    """Issue 11.2: with gc off, nothing with a grad_fn outlives a step (no cycles either)."""
    g = torch.Generator().manual_seed(0)
    w_gate = torch.randn(8, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, generator=g, requires_grad=True)
    x0 = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        before = grad_fn_tensors()
        for _ in range(4):
            aux: list[Tensor] = []
            with track_saved_storages():
                h = x0 * 1.0
                for _layer in range(2):
                    h = checkpoint(router_block(w_gate, w, aux), h, reclaim=reclaim)
            (h.sum() + sum(aux)).backward()
            del h, aux
            assert grad_fn_tensors() == before
            assert census().live_bytes == 0
    finally:
        gc.enable()


def test_side_channel_outputs_keep_their_gradients() -> None:
    """Issue 11.3: the router balance loss leaves fn through a list; its gradient is exact."""
    g = torch.Generator().manual_seed(0)
    w_gate = torch.randn(8, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, generator=g, requires_grad=True)
    x0 = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    grads = []
    for reclaim in (None, "never", "safe"):
        w_gate.grad = w.grad = x0.grad = None
        aux: list[Tensor] = []
        fn = router_block(w_gate, w, aux)
        h = x0 * 1.0
        for _ in range(2):
            h = fn(h) if reclaim is None else checkpoint(fn, h, reclaim=reclaim)
        assert all(a.requires_grad for a in aux)
        (h.sum() + 10.0 * sum(aux)).backward()
        grads.append((w_gate.grad.clone(), w.grad.clone(), x0.grad.clone()))
    for got in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], got, strict=True))


def test_autograd_grad_with_respect_to_parameters() -> None:
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64)
    ref = torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0]
    got = torch.autograd.grad(checkpoint(lambda t: torch.tanh(t @ w), x).sum(), w)[0]
    assert torch.equal(ref, got) and w.grad is None


def test_partial_labels_name_the_wrapped_function() -> None:
    """Issue 11.4, and the transformers form partial(Layer.forward, layer, **kwargs)."""

    def moe_layer(x: Tensor, scale: float) -> Tensor:
        return x.sin() * scale

    lin = nn.Linear(2, 2)
    assert default_label(functools.partial(moe_layer, scale=2.0)).endswith("moe_layer")
    assert default_label(functools.partial(nn.Linear.forward, lin)) == "Linear.forward"
    assert default_label(lin) == "Linear"
    x = torch.ones(2, requires_grad=True)
    h = x * 1.0
    y = checkpoint(functools.partial(moe_layer, scale=2.0), h, reclaim="safe")
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="moe_layer'"):
        y.sum().backward()


class MoEStash(nn.Module):
    """Caches its recomputed routed tokens on `self`, as MoE dispatchers do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, dtype=torch.float64)
        self.routed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        routed = x[:, :8] * 2.0  # its graph reaches the checkpoint's (detached) input
        self.routed = routed
        return torch.tanh(self.proj(x)) + routed.sum()


def stash_leak(use_torch_reentrant: bool) -> tuple[StorageWeakRef, Tensor | None, MoEStash]:
    """One step; returns the input's storage, the rerun input's .grad if any, the module."""
    torch.manual_seed(0)
    module = MoEStash()
    leaf = torch.randn(256, 64, dtype=torch.float64, requires_grad=True)
    with track_saved_storages():
        h = leaf * 1.0  # 128 KiB activation: the checkpoint's input
        if use_torch_reentrant:
            out = tuc.checkpoint(module, h, use_reentrant=True)
        else:
            out = checkpoint(module, h, reclaim="safe", name="moe")
    storage = StorageWeakRef(h.untyped_storage())
    del h
    out.sum().backward()
    del out
    node = module.routed.grad_fn  # the stash's graph: MulBackward -> Slice -> ... -> input
    while node.next_functions and node.next_functions[0][0] is not None:
        node = node.next_functions[0][0]
    grad = getattr(getattr(node, "variable", None), "grad", None)
    return storage, grad, module


def test_moe_stash_pins_neither_input_nor_grad() -> None:
    """The leak reclaim was invented for: torch's reentrant checkpoint (and Megatron's, built
    the same way) leaves the input storage and its .grad reachable from the stash; ours leaves
    only the stash itself, which the census names."""
    storage, grad, module = stash_leak(use_torch_reentrant=True)
    assert not storage.expired() and grad is not None  # 128 KiB input + 128 KiB .grad pinned
    storage, grad, module = stash_leak(use_torch_reentrant=False)
    assert storage.expired() and grad is None
    found = census(model=module)
    assert found.holders == {"routed": 256 * 8 * 8}
