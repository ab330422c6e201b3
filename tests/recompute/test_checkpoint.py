"""checkpoint(): numerics against the plain function, RNG and autocast replay, contract errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.recompute import checkpoint, track_saved_storages

RECLAIMS = ["never", "safe", "always"]


def two_outputs(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    h = torch.tanh(x @ w)
    return h.sin(), (h * x).sum(dim=-1)


def loss_and_grads(fn, x0: Tensor, w: Tensor, reclaim: str | None) -> tuple[Tensor, ...]:
    x0.grad, w.grad = None, None
    with track_saved_storages():
        x = x0 * 1.5  # an activation: allocated during the tracked forward
        a, b = two_outputs(x, w) if reclaim is None else checkpoint(fn, x, w, reclaim=reclaim)
        loss = a.square().sum() + b.sum()
    loss.backward()
    return loss.detach(), x0.grad, w.grad


@pytest.mark.parametrize("reclaim", RECLAIMS)
def test_matches_plain_function_fp64(reclaim: str) -> None:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 6, dtype=torch.float64, generator=g, requires_grad=True)
    ref = loss_and_grads(two_outputs, x0, w, None)
    got = loss_and_grads(two_outputs, x0, w, reclaim)
    for r, o in zip(ref, got, strict=True):
        assert torch.equal(r, o)


def test_rng_state_is_replayed() -> None:
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def noisy(x: Tensor) -> Tensor:
        return F.dropout(x @ w, p=0.5, training=True) + torch.rand_like(x)

    grads = []
    for use_checkpoint in (False, True):
        w.grad = None
        torch.manual_seed(3)
        with track_saved_storages():
            x = torch.ones(4, 8, dtype=torch.float64) * 2.0
            y = checkpoint(noisy, x, reclaim="safe") if use_checkpoint else noisy(x)
        (y * torch.arange(8.0, dtype=torch.float64)).sum().backward()
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_cpu_autocast_is_replayed() -> None:
    w = torch.randn(16, 16, requires_grad=True)
    x0 = torch.randn(4, 16, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        w.grad = x0.grad = None
        with track_saved_storages(), torch.autocast("cpu", dtype=torch.bfloat16):
            x = x0 * 1.0
            fn = lambda x: torch.tanh(x @ w)  # noqa: E731
            y = checkpoint(fn, x, reclaim="safe") if use_checkpoint else fn(x)
            assert y.dtype == torch.bfloat16
        y.float().sum().backward()  # backward outside autocast: the rerun must re-enter it
        grads.append((w.grad.clone(), x0.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("reclaim", RECLAIMS)
def test_works_without_tracking(reclaim: str) -> None:
    """Tracking only feeds the census and the sanitizer; the checkpoint does not need it."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(3, dtype=torch.float64, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        w.grad = x0.grad = None
        x = x0 * 2.0
        y = (
            checkpoint(lambda t: (t * w).sin(), x, reclaim=reclaim)
            if use_checkpoint
            else (x * w).sin()
        )
        y.sum().backward()
        grads.append((w.grad.clone(), x0.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_no_grad_runs_fn_directly() -> None:
    x = torch.randn(3)
    with torch.no_grad():
        assert torch.equal(checkpoint(torch.sin, x, reclaim="safe"), x.sin())


def test_invalid_reclaim_names_the_value() -> None:
    with pytest.raises(ValueError, match="reclaim='sometimes'"):
        checkpoint(torch.sin, torch.randn(2), reclaim="sometimes")  # type: ignore[arg-type]


def test_any_return_structure() -> None:
    """Like torch.utils.checkpoint, fn may return lists, dicts and non-tensors."""
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = checkpoint(lambda t: {"y": [t.sin()], "n": 3}, x, reclaim="safe")
    assert out["n"] == 3
    out["y"][0].sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_in_place_change_of_an_input_is_detected() -> None:
    w = torch.randn(3, requires_grad=True)
    with track_saved_storages():
        x = torch.ones(3) * 2.0
        y = checkpoint(lambda t: t * w, x, reclaim="safe", name="scale")
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="'scale': input 0 was modified in place"):
        y.sum().backward()


def test_retain_graph_reruns_with_never_and_is_refused_clearly_with_safe() -> None:
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = checkpoint(lambda t: (t * w).sin().sum(), torch.ones(3, dtype=torch.float64),
                   reclaim="never", name="twice")  # fmt: skip
    y.backward(retain_graph=True)
    first = w.grad.clone()
    y.backward()
    assert torch.equal(w.grad, 2 * first)
    y = checkpoint(lambda t: (t * w).sin().sum(), torch.ones(3, dtype=torch.float64),
                   reclaim="safe", name="once")  # fmt: skip
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="'once': backward reached it a second time"):
        y.backward()


def test_safe_never_frees_what_someone_holds() -> None:
    lin = torch.nn.Linear(4, 4)
    lin.register_buffer("scale", torch.full((4,), 2.0))
    user = torch.randn(3, 4, requires_grad=True)
    with track_saved_storages():
        lazy = torch.zeros(4, requires_grad=True)  # a leaf created inside the forward
        act = user * 3.0
        outs = [
            checkpoint(lambda t: lin(t), user, reclaim="safe"),
            checkpoint(lambda t: t * user, lin.weight.view(16)[:4], reclaim="safe"),
            checkpoint(lambda t: t * user, lin.scale.detach(), reclaim="safe"),
            checkpoint(lambda t: t * user, lazy, reclaim="safe"),
            checkpoint(lambda t: lin(t), act, reclaim="safe"),
        ]
    sum(o.sum() for o in outs).backward()
    for kept in (user, lin.weight, lin.scale, lazy, act):  # act: the caller still holds it
        assert kept.untyped_storage().nbytes() > 0
    assert torch.equal(act, user.detach() * 3.0)


def test_always_frees_when_its_backward_is_done_not_when_python_drops_it() -> None:
    """The seed's free happens right after the checkpoint's own backward; a frame kept alive
    (here by retain_graph, on the GPU by anything that delays Python's release) must not
    postpone it, or a reproduction of the bug silently stops reproducing."""
    from birkhoff.recompute import UseAfterFreeError, sanitize

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    h = x * 1.0  # a non-leaf input, as a layer's output is
    with sanitize(), pytest.raises(UseAfterFreeError) as err:
        with track_saved_storages():
            c = h.cos()  # CosBackward saves h; created first, it runs after the checkpoint's
            out = checkpoint(torch.sin, h, reclaim="always", name="inner")
            loss = (out + c).sum()
        loss.backward(retain_graph=True)
    assert err.value.freed_by == "inner"
