import math
from types import SimpleNamespace

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.tasks.batches import build_supervised_batch
from birkhoff.tasks.problems import AdditionTask, sample_problems, step_rng
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train import TrainConfig, build_optimizer, forward_context, lr_at, train_step
from birkhoff.train.recompute import apply_recompute
from birkhoff.train.step import NonFiniteError, SkipCounter, answer_accuracy


def tiny_model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=CharTokenizer().vocab_size, dim=32, num_layers=1, num_heads=2,
               num_streams=2, mtp_depth=1, max_seq_len=32)  # fmt: skip
    return Transformer(ModelConfig(**(cfg | kw)))


def addition_batch(n: int = 16):
    problems = sample_problems(AdditionTask(2), step_rng(0, 0), n)
    return build_supervised_batch(problems, CharTokenizer())


def test_train_step_lowers_loss_on_a_fixed_batch():
    model, batch = tiny_model(), addition_batch()
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=40, weight_decay=0.0)
    opt = build_optimizer(model, cfg)
    history = [train_step(model, opt, batch, cfg, step=s) for s in range(40)]
    first, last = history[0], history[-1]
    assert {"loss", "main_loss", "mtp_loss_1", "grad_norm", "lr", "skipped"} <= first.keys()
    assert last["main_loss"] < 0.5 * first["main_loss"]
    assert last["mtp_loss_1"] < 0.6 * first["mtp_loss_1"]
    assert first["lr"] == lr_at(0, cfg) and history[7]["lr"] == lr_at(7, cfg)
    # loss = main + lambda/M * sum_k mtp_k, reported consistently
    expected = first["main_loss"] + 0.3 * first["mtp_loss_1"]
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_mtp_learns_a_token_two_ahead():
    """Blocks (a, b, (a+b) mod 10): the sum is 2 tokens after a, so MTP depth 1 at a's position
    (which also sees Emb(b)) can predict it exactly; a wrong shift would leave it at ~ln 10."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, dim=32, num_layers=1, num_heads=2, num_streams=2,
                      mtp_depth=1, max_seq_len=16)  # fmt: skip
    model = Transformer(cfg)
    train = TrainConfig(lr=1e-2, warmup_steps=10, num_steps=160, weight_decay=0.0)
    opt = build_optimizer(model, train)
    gen = torch.Generator().manual_seed(0)

    def batch() -> SimpleNamespace:
        ab = torch.randint(0, 10, (32, 4, 2), generator=gen)
        ids = torch.cat([ab, ab.sum(-1, keepdim=True) % 10], dim=-1).view(32, 12)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, 2::3] = True  # only the sums are targets
        return SimpleNamespace(input_ids=ids, loss_mask=mask)

    history = [train_step(model, opt, batch(), train, step=s) for s in range(160)]
    assert history[0]["mtp_loss_1"] > 2.0  # ~ln 10 at init
    assert sum(h["mtp_loss_1"] for h in history[-10:]) / 10 < 0.3


def test_custom_loss_fn_is_used():
    model, batch = tiny_model(), addition_batch()
    cfg = TrainConfig(lr=1e-3, warmup_steps=0)
    opt = build_optimizer(model, cfg)
    before = model.lm_head.weight.detach().clone()
    seen = []

    def loss_fn(m, b):
        seen.append(b)
        logits = m(b.input_ids).logits
        return logits.float().pow(2).mean(), {"custom": torch.tensor(1.5)}

    out = train_step(model, opt, batch, cfg, step=0, loss_fn=loss_fn)
    assert seen == [batch] and out["custom"] == 1.5 and "main_loss" not in out
    assert not torch.equal(before, model.lm_head.weight)


def test_non_finite_gradient_skips_the_step():
    model, batch = tiny_model(), addition_batch()
    cfg = TrainConfig(lr=1e-3, warmup_steps=0)
    opt = build_optimizer(model, cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def nan_loss(m, b):
        return m(b.input_ids).logits.sum() * float("nan"), {}

    out = train_step(model, opt, batch, cfg, step=0, loss_fn=nan_loss)
    assert out["skipped"] == 1.0 and not math.isfinite(out["grad_norm"])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not opt.state  # AdamW moments untouched
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_loss_with_finite_gradients_skips_the_step():
    model, batch = tiny_model(), addition_batch()
    cfg = TrainConfig(lr=1e-3, warmup_steps=0)
    opt = build_optimizer(model, cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def inf_loss(m, b):  # a constant term: the gradients stay finite
        return m(b.input_ids).logits.mean() + torch.tensor(float("inf")), {}

    out = train_step(model, opt, batch, cfg, step=0, loss_fn=inf_loss)
    assert math.isfinite(out["grad_norm"]) and out["skipped"] == 1.0
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not opt.state


def test_skip_counter_counts_and_stops_after_max_in_row(tmp_path):
    counter = SkipCounter(3)
    rows = [{"step": s, "skipped": float(s in (1, 3, 4, 5))} for s in range(6)]
    for row in rows[:5]:
        counter.count(row)
        counter.check(row["step"], checkpoint=tmp_path, checkpoint_step=2)
    assert [r["skipped_total"] for r in rows[:5]] == [0, 1, 1, 2, 3]
    counter.count(rows[5])
    with pytest.raises(NonFiniteError, match=r"steps 3-5: 3 steps in a row .* weights are those "
                       r"of step 3\); last good checkpoint: .* \(step 2;"):  # fmt: skip
        counter.check(5, checkpoint=tmp_path, checkpoint_step=2)
    again = SkipCounter(3)
    again.restore(counter.state())
    assert (again.total, again.in_row) == (4, 3)


def test_grad_clip_reports_norm_before_clipping_and_bounds_it():
    model, batch = tiny_model(), addition_batch()
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, grad_clip=1e-3)
    opt = build_optimizer(model, cfg)
    seen = {}

    def record(m, b):  # snapshot grads via a hook on the optimizer step
        out = m(b.input_ids, labels=b.input_ids, loss_mask=b.loss_mask)
        return out.loss, {}

    def pre_hook(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen["norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    opt.register_step_pre_hook(pre_hook)
    out = train_step(model, opt, batch, cfg, step=0, loss_fn=record)
    assert out["grad_norm"] > 1e-3
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-4)


def test_bf16_autocast_refuses_cpu_model():
    model = tiny_model()
    with (
        pytest.raises(ValueError, match="amp_dtype='bf16'"),
        forward_context(model, TrainConfig(amp_dtype="bf16")),
    ):
        pass


def test_recompute_full_runs_under_tracking_with_identical_numbers():
    from birkhoff.recompute.registry import active_registry

    batch = addition_batch()
    results = {}
    for mode in ("none", "full"):
        cfg = TrainConfig(lr=1e-3, warmup_steps=0, recompute=mode)
        model = tiny_model()
        if mode == "full":
            apply_recompute(model, reclaim=cfg.reclaim)
        opt = build_optimizer(model, cfg)
        tracked = []

        def loss_fn(m, b, tracked=tracked):
            tracked.append(active_registry() is not None)
            out = m(b.input_ids, labels=b.input_ids, loss_mask=b.loss_mask)
            return out.loss, {}

        results[mode] = [train_step(model, opt, batch, cfg, step=s, loss_fn=loss_fn)["loss"]
                         for s in range(3)]  # fmt: skip
        assert tracked == [mode == "full"] * 3
    assert results["none"] == results["full"]


def test_answer_accuracy_hand_made():
    # labels [x, 5, 7, eos]; mask on 7 and eos. Position 1 must predict 7, position 2 eos.
    labels = torch.tensor([[1, 5, 7, 2], [1, 5, 7, 2]])
    mask = torch.tensor([[False, False, True, True]] * 2)
    logits = torch.zeros(2, 4, 10)
    logits[0, 1, 7] = logits[0, 2, 2] = 1.0  # both right
    logits[1, 1, 7] = logits[1, 2, 3] = 1.0  # second wrong
    token_acc, seq_acc = answer_accuracy(logits.argmax(-1), labels, mask)
    assert float(token_acc) == 0.75 and float(seq_acc) == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_step_on_cuda_lowers_loss_and_keeps_fp32_master_weights():
    model, batch = tiny_model().cuda(), addition_batch().to("cuda")
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=30, weight_decay=0.0, amp_dtype="bf16")
    opt = build_optimizer(model, cfg)
    assert opt.param_groups[0]["fused"] is True
    history = [train_step(model, opt, batch, cfg, step=s) for s in range(30)]
    assert history[-1]["main_loss"] < 0.6 * history[0]["main_loss"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(h["skipped"] == 0.0 for h in history)


def test_compiled_blocks_train_like_eager_ones(monkeypatch):
    """TrainConfig.compile: every block and MTP block compiled, same losses and parameters as
    the eager model over a few steps. Dynamo and AOT autograd trace forward and backward here;
    the aot_eager backend skips inductor's codegen (a minute on 2 cores); benchmarks/train_step.py
    --compile runs the same function with inductor on the GPU (docs/results.md)."""
    from birkhoff.train.recompute import build_model

    compile_module = torch.nn.Module.compile

    def compile_aot_eager(self, **kw):
        compile_module(self, backend="aot_eager", **kw)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_aot_eager)
    batch = addition_batch()
    results = {}
    for compiled in (False, True):
        cfg = TrainConfig(lr=1e-3, warmup_steps=0, compile=compiled)
        torch.manual_seed(0)
        model = build_model(tiny_model().cfg, cfg, device=torch.device("cpu"))
        assert all((b._compiled_call_impl is not None) == compiled for b in model.layers)
        opt = build_optimizer(model, cfg)
        losses = [train_step(model, opt, batch, cfg, step=s)["loss"] for s in range(3)]
        results[compiled] = losses, [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-4, atol=1e-5)


def test_compile_with_recompute_is_refused():
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(compile=True, recompute="full")
