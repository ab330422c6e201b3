"""apply_recompute: applied from outside, names unchanged, numbers unchanged, errors named."""

import copy

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.block import Block
from birkhoff.recompute import track_saved_storages
from birkhoff.train import TrainConfig
from birkhoff.train.recompute import (
    apply_checkpoint,
    apply_recompute,
    build_model,
    compile_blocks,
    compile_units,
)

CFG = ModelConfig(
    vocab_size=32, dim=32, num_layers=2, num_heads=4, num_streams=4, mtp_depth=2, max_seq_len=16
)
IDS = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))


def fresh(cfg: ModelConfig = CFG) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg).double()


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with track_saved_storages():
        loss = model(IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_names_parameters_and_classes_are_unchanged():
    plain, wrapped = fresh(), apply_recompute(fresh())
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    assert type(wrapped.layers[0]) is Block and type(wrapped.mtp[1]).__name__ == "MTPDepth"
    params = dict(wrapped.named_parameters())
    wrapped.load_state_dict(plain.state_dict())  # a checkpoint of the plain model loads as is
    assert all(params[n] is p for n, p in wrapped.named_parameters())


@pytest.mark.parametrize("reclaim", ["safe", "never"])  # "always": see test_model_reclaim.py
def test_every_block_and_mtp_depth_is_one_checkpoint_with_identical_fp64_numbers(reclaim):
    ref_loss, ref_grads = loss_and_grads(fresh())
    model = apply_recompute(fresh(), reclaim=reclaim)
    with track_saved_storages() as registry:
        loss = model(IDS, labels=IDS).loss
    loss.backward()
    if reclaim == "safe":  # depth k's inputs: the previous depth's streams and Emb(t_{i+k})
        assert (
            sorted(registry.freed.values())
            == ["layers.0", "layers.1"] + ["mtp.0"] * 2 + ["mtp.1"] * 2
        )
    assert torch.equal(loss.detach(), ref_loss)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, ref_grads[name]), name


def test_torch_checkpoint_on_the_same_units_gives_identical_numbers():
    ref_loss, ref_grads = loss_and_grads(fresh())
    calls = []

    def torch_checkpoint(fn, *args, name):
        calls.append(name)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    loss, grads = loss_and_grads(apply_checkpoint(fresh(), torch_checkpoint))
    assert calls[:4] == ["layers.0", "layers.1", "mtp.0", "mtp.1"]
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_a_deep_copy_runs_its_own_weights():
    model = apply_recompute(fresh())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        plain = fresh()
        plain.load_state_dict(twin.state_dict())
        assert torch.equal(twin(IDS).logits, plain(IDS).logits)
        assert not torch.equal(model(IDS).logits, twin(IDS).logits)


def test_errors_name_the_problem():
    model = apply_recompute(fresh())
    with pytest.raises(ValueError, match="layers.0: recompute is already applied"):
        apply_recompute(model)
    with pytest.raises(ValueError, match="reclaim='sometimes'"):
        apply_recompute(fresh(), reclaim="sometimes")


@pytest.mark.parametrize(("field", "value"), [("recompute", "some"), ("reclaim", "sometimes")])
def test_train_config_validates_the_policy(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        TrainConfig(**{field: value})


def test_build_model_applies_the_configured_policy():
    cpu = torch.device("cpu")
    plain = build_model(CFG, TrainConfig(), device=cpu)
    full = build_model(CFG, TrainConfig(recompute="full", reclaim="never"), device=cpu)
    assert "forward" not in vars(plain.layers[0])
    assert (
        "forward" in vars(full.layers[0])
        and vars(full.mtp[0])["forward"].__func__.keywords["name"] == "mtp.0"
    )


def test_compiled_units_trace_whole_and_keep_fp64_numbers():
    """compile_blocks covers every block, every MTP depth with its merge, and each head's
    contraction and norm; each traces as one graph (fullgraph: a break fails) and the compiled
    model's fp64 loss and gradients equal the eager model's. One layer (every layer traces the
    same code), two MTP depths (the second one takes the first one's streams)."""
    torch._dynamo.reset()
    cfg = CFG.replace(num_layers=1)
    eager, compiled = fresh(cfg), fresh(cfg)
    units = compile_units(compiled)
    assert len(units) == cfg.num_layers + cfg.mtp_depth + 2 * (1 + cfg.mtp_depth)
    compile_blocks(compiled, backend="aot_eager", fullgraph=True)
    expected_loss = eager(IDS, labels=IDS).loss
    expected_loss.backward()
    loss = compiled(IDS, labels=IDS).loss
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-14, msg=name)
