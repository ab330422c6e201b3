"""Graphed training steps (train/graph.py): the replayed forward + backward must give the plain
step's losses, metrics and parameters (fp64: bit for bit), and bad use fails with a clear error.
The padding the supervised loop adds for graphs must not change losses or gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from birkhoff.config import Kernels, ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.hyper import apply_kernels
from birkhoff.tasks.batches import SupervisedBatch, build_supervised_batch
from birkhoff.tasks.problems import AdditionTask, sample_problems, step_rng
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train import TrainConfig, build_optimizer, supervised_loss, train_step
from birkhoff.train.graph import (
    StepGraphs,
    batch_signature,
    bucketed_length,
    weight_addresses,
    weight_slots,
)
from birkhoff.train.recompute import compile_blocks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(device: str = "cpu", *, kernels: Kernels = "auto", **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=CharTokenizer().vocab_size, dim=32, num_layers=2, num_heads=2,
               num_streams=4, mtp_depth=1, max_seq_len=64)  # fmt: skip
    model = Transformer(ModelConfig(**(cfg | kw))).to(device)
    return apply_kernels(model, kernels)


def addition_batch(n: int, digits: int, seed: int = 0) -> SupervisedBatch:
    problems = sample_problems(AdditionTask(digits), step_rng(seed, 0), n)
    return build_supervised_batch(problems, CharTokenizer())


def test_config_and_construction_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="cuda_graph"):
        TrainConfig(cuda_graph=True, recompute="full")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        StepGraphs(tiny_model(), supervised_loss, TrainConfig(cuda_graph=True))
    batch = addition_batch(2, 1)
    with pytest.raises(ValueError, match="not both"):
        model = tiny_model()
        train_step(model, build_optimizer(model, TrainConfig()), batch, TrainConfig(), step=0,
                   loss_fn=supervised_loss, graphs=lambda b: (torch.zeros(()), {}))  # fmt: skip


def test_batch_signature_takes_tensors_only() -> None:
    batch = addition_batch(3, 1)
    (ids_shape, ids_dtype), (mask_shape, mask_dtype) = batch_signature(batch)
    assert ids_shape == mask_shape == tuple(batch.input_ids.shape)
    assert (ids_dtype, mask_dtype) == (torch.int64, torch.bool)
    with pytest.raises(ValueError, match="'weight_versions' is a list"):
        from birkhoff.rl.rollout import RLBatch

        z = torch.zeros(1, 2)
        batch_signature(RLBatch(z, z, z, z[:, 0], [0]))
    with pytest.raises(ValueError, match="tuple of tensors"):
        batch_signature({"input_ids": batch.input_ids})  # type: ignore[arg-type]


def test_bucketed_length() -> None:
    assert [bucketed_length(n, 1024) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    assert bucketed_length(70, 100) == 100 and bucketed_length(30, 20) == 30


def test_padding_keeps_losses_and_gradients() -> None:
    """Right padding is no target and, causally, nobody's context: the loss and every gradient
    stay what they were (fp64; only the summation over more, zero, terms changes)."""
    model = tiny_model().double()
    batch = addition_batch(4, 2)
    grads = []
    for b in (batch, batch.padded(batch.input_ids.shape[1] + 9, CharTokenizer().pad_id)):
        model.zero_grad(set_to_none=True)
        loss, metrics = supervised_loss(model, b)
        loss.backward()
        grads.append((loss.detach(), metrics, [p.grad.clone() for p in model.parameters()]))
    (loss0, m0, g0), (loss1, m1, g1) = grads
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=0)
    for name in m0:
        torch.testing.assert_close(m1[name], m0[name], rtol=1e-12, atol=0)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="shorter"):
        batch.padded(2, 0)


def run_steps(model: Transformer, cfg: TrainConfig, batches: list[SupervisedBatch],
              graphs: StepGraphs | None) -> list[dict[str, float]]:  # fmt: skip
    opt = build_optimizer(model, cfg)
    device = next(model.parameters()).device
    return [train_step(model, opt, b.to(device), cfg, step=s, graphs=graphs)
            for s, b in enumerate(batches)]  # fmt: skip


def test_weight_addresses_see_every_way_a_weight_moves() -> None:
    """The per-call check behind recapture: `p.data = t`, a parameter replaced in its module and
    a reassigned buffer change the addresses; copying new values in (a loaded state dict) and
    an optimizer step do not."""
    model = tiny_model(kernels="eager")
    model.register_buffer("scale", torch.ones(3))
    slots = weight_slots(model)
    held = {id(registry[name]) for registry, name in slots if registry[name] is not None}
    assert held == {id(t) for t in [*model.parameters(), *model.buffers()]}
    start = weight_addresses(slots)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    ids = addition_batch(2, 1).input_ids
    model(ids, labels=ids).loss.backward()
    build_optimizer(model, TrainConfig()).step()
    assert weight_addresses(slots) == start
    moves = [
        lambda: setattr(model.embed.weight, "data", model.embed.weight.data.clone()),
        lambda: setattr(model.norm, "weight", torch.nn.Parameter(model.norm.weight.detach() + 1)),
        lambda: setattr(model, "scale", torch.zeros(3)),
    ]
    for move in moves:
        before = weight_addresses(slots)
        move()
        assert weight_addresses(slots) != before


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_graphs", [4, 1])
def test_graphed_steps_equal_plain_steps_in_fp64(max_graphs: int) -> None:
    """Two batch shapes, alternating (max_graphs=1 drops and recaptures each time): every
    step's metrics and the final parameters equal the plain steps' bit for bit."""
    plain = tiny_model("cuda", kernels="eager").double()
    graphed = copy.deepcopy(plain)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=8, cuda_graph=True)
    batches = [addition_batch(8, 1 + s % 2, seed=s) for s in range(5)]
    graphs = StepGraphs(graphed, supervised_loss, cfg, max_graphs=max_graphs)
    expected = run_steps(plain, cfg, batches, None)
    got = run_steps(graphed, cfg, batches, graphs)
    assert got == expected
    assert len(graphs.graphs) == min(2, max_graphs)
    for (name, a), b in zip(plain.named_parameters(), graphed.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@needs_cuda
def test_a_moved_parameter_is_captured_again() -> None:
    """`p.data = ...` moves a parameter: the graphs read the old address, so the next call must
    capture again and give the plain step's result on the new values."""
    plain = tiny_model("cuda", kernels="eager").double()
    graphed = copy.deepcopy(plain)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=4, cuda_graph=True)
    graphs = StepGraphs(graphed, supervised_loss, cfg)
    opt_p, opt_g = build_optimizer(plain, cfg), build_optimizer(graphed, cfg)
    batch = addition_batch(8, 1).to("cuda")
    for step in range(3):
        if step == 2:  # the same new values in both models, at a new address in `graphed`
            for model in (plain, graphed):
                model.embed.weight.data = model.embed.weight.data * 0.5
        expected = train_step(plain, opt_p, batch, cfg, step=step)
        assert train_step(graphed, opt_g, batch, cfg, step=step, graphs=graphs) == expected
    for a, b in zip(plain.parameters(), graphed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_graphed_compiled_fused_bf16_steps_match_plain() -> None:
    """The benchmark's configuration: fused mHC kernels, compiled blocks, bf16 autocast and
    bf16 streams. Graphs replay the same kernels, so the steps agree bit for bit. (Attention
    runs as SDPA's math kernels here: flash attention's backward sums dq with atomics, which
    differs between any two runs.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = tiny_model("cuda", dim=64, residual_dtype="autocast")
    graphed = copy.deepcopy(plain)
    compile_blocks(plain)
    compile_blocks(graphed)
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, num_steps=8, amp_dtype="bf16", cuda_graph=True)
    batches = [addition_batch(8, 2, seed=s).padded(64, CharTokenizer().pad_id) for s in range(3)]
    with sdpa_kernel(SDPBackend.MATH):
        expected = run_steps(plain, cfg, batches, None)
        got = run_steps(graphed, cfg, batches, StepGraphs(graphed, supervised_loss, cfg))
    assert got == expected
    for (name, a), b in zip(plain.named_parameters(), graphed.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@needs_cuda
def test_bad_ids_a_held_gradient_or_a_host_sync_fail_clearly() -> None:
    model = tiny_model("cuda", kernels="eager")
    cfg = TrainConfig(cuda_graph=True)
    graphs = StepGraphs(model, supervised_loss, cfg)
    batch = addition_batch(2, 1).to("cuda")
    graphs(batch)
    model.zero_grad(set_to_none=True)
    bad = batch._replace(input_ids=batch.input_ids.clone().fill_(10_000))
    with pytest.raises(ValueError, match="input_ids holds token id 10000"):
        graphs(bad)  # the captured forward does not read the ids' range: the call checks it
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    with pytest.raises(ValueError, match="hold a gradient"):
        graphs(batch)
    model.zero_grad(set_to_none=True)

    def syncing_loss(m: torch.nn.Module, b: SupervisedBatch):
        loss, metrics = supervised_loss(m, b)
        return loss * float(loss), metrics  # .item() in the step: not capturable

    with pytest.raises(RuntimeError, match="syncs with the host"):
        StepGraphs(model, syncing_loss, cfg)(batch)


def test_the_supervised_loop_pads_batches_for_its_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With cuda_graph the loop hands StepGraphs batches padded to a multiple of 64 tokens (so
    a run sees few shapes) and its rows equal the plain loop's. StepGraphs is replaced by an
    eager stand-in here (capture needs CUDA): what is checked is the loop's wiring."""
    from birkhoff.train import loop

    seen: list[tuple[int, ...]] = []

    class EagerGraphs:
        def __init__(self, model: torch.nn.Module, loss_fn, cfg: TrainConfig) -> None:
            self.model, self.loss_fn = model, loss_fn

        def __call__(self, batch: SupervisedBatch):
            seen.append(tuple(batch.input_ids.shape))
            loss, metrics = self.loss_fn(self.model, batch)
            loss.backward()
            return loss.detach(), metrics

    def rows(cfg: TrainConfig) -> list[dict[str, float]]:
        model = tiny_model(kernels="eager").double()
        task, opt = AdditionTask(2), build_optimizer(model, cfg)
        out = loop.supervised_steps(model, opt, task, CharTokenizer(), cfg, steps=range(3))
        return [{k: v for k, v in r.items() if not k.endswith("_s") and "mem" not in k}
                for r in out]  # fmt: skip

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=3, batch_size=4)
    plain = rows(cfg)
    monkeypatch.setattr(loop, "StepGraphs", EagerGraphs)
    graphed = rows(cfg.replace(cuda_graph=True))
    assert seen and all(T == 64 for _, T in seen), seen  # addition prompts are < 64 tokens
    assert len(graphed) == len(plain)
    for g, p in zip(graphed, plain, strict=True):
        assert g.keys() == p.keys()
        for key, value in p.items():
            assert g[key] == (pytest.approx(value, rel=1e-9, abs=1e-12) if isinstance(
                value, float) else value), key  # fmt: skip
