"""MTP self-distillation: only the MTP depths train, on the model's own greedy completions, and
speculative decoding accepts more of their drafts afterwards."""

from pathlib import Path

import torch

from birkhoff.engine import Engine, SamplingParams
from birkhoff.presets import tiny_cpu
from birkhoff.refit import refit
from birkhoff.rl.loop import GRPORun
from birkhoff.rl.mtp_warmup import (
    greedy_completions,
    mtp_loss,
    only_mtp_trainable,
    own_output_batch,
    self_distill_steps,
)
from birkhoff.tasks.batches import prompt_ids
from birkhoff.tasks.problems import AdditionTask, held_out_rng, sample_problems
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import train_step


def setup(seed: int = 0) -> tuple:
    preset = tiny_cpu()
    assert preset.rl is not None
    rl = preset.rl.replace(max_new_tokens=8, warmup="mtp-self-distill")
    train = preset.train.replace(lr=3e-3, warmup_steps=0, batch_size=16, seed=seed)
    torch.manual_seed(seed)
    model = build_model(preset.model, train, device=torch.device("cpu"))
    engine = Engine.from_model(model, max_batch_size=16, max_speculative_tokens=1)
    return preset.replace(rl=rl, train=train), model, engine


def test_own_output_batch_masks_the_completion() -> None:
    preset, model, engine = setup()
    tok, task = CharTokenizer(), AdditionTask(1)
    problems = sample_problems(task, held_out_rng(0), 3)
    prompts = [prompt_ids(p, tok) for p in problems]
    completions = greedy_completions(engine, prompts, task, tok, preset.rl)
    batch = own_output_batch(prompts, completions, pad_id=tok.pad_id)
    for b, (prompt, c) in enumerate(zip(prompts, completions, strict=True)):
        row = prompt + c.tokens
        assert batch.input_ids[b, : len(row)].tolist() == row
        assert batch.loss_mask[b].nonzero().flatten().tolist() == list(range(len(prompt), len(row)))


def test_only_the_mtp_depths_change() -> None:
    preset, model, engine = setup()
    tok, task = CharTokenizer(), AdditionTask(1)
    prompts = [prompt_ids(p, tok) for p in sample_problems(task, held_out_rng(0), 8)]
    batch = own_output_batch(
        prompts, greedy_completions(engine, prompts, task, tok, preset.rl), pad_id=tok.pad_id
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, preset.train)
    with only_mtp_trainable(model):
        train_step(model, optimizer, batch, preset.train, step=0, loss_fn=mtp_loss)
    assert all(p.requires_grad for p in model.parameters())  # restored
    for name, param in model.named_parameters():
        changed = not torch.equal(param, before[name])
        assert changed == name.startswith("mtp."), name
    trained = {id(p) for p in model.get_submodule("mtp").parameters()}
    assert {id(p) for p in optimizer.state} == trained


def accepted_fraction(engine: Engine, prompts: list[list[int]]) -> float:
    engine.generate(prompts, SamplingParams(8, num_speculative_tokens=1))
    stats = engine.last_stats
    assert stats is not None
    return stats.acceptance_rate[0]


def test_drafts_are_accepted_more_after_the_warmup() -> None:
    preset, model, engine = setup()
    tok, task = CharTokenizer(), AdditionTask(1)
    eval_prompts = [prompt_ids(p, tok) for p in sample_problems(task, held_out_rng(1), 16)]
    plain = SamplingParams(8)
    greedy_before = [c.tokens for c in engine.generate(eval_prompts, plain)]
    accept_before = accepted_fraction(engine, eval_prompts)
    optimizer = build_optimizer(model, preset.train)
    cfg = preset.train.replace(num_steps=30)
    rows = list(
        self_distill_steps(
            model, optimizer, engine, task, tok, cfg, preset.rl, steps=range(cfg.num_steps)
        )
    )
    assert {r["phase"] for r in rows} == {"mtp"}
    print([round(r["mtp_loss"], 2) for r in rows])
    assert rows[-1]["mtp_loss"] < 0.8 * rows[0]["mtp_loss"]
    refit(model, engine)
    accept_after = accepted_fraction(engine, eval_prompts)
    print(f"draft acceptance {accept_before:.2f} -> {accept_after:.2f}")
    assert accept_after > accept_before + 0.2
    # the main model is untouched: the policy's greedy completions are the same
    assert [c.tokens for c in engine.generate(eval_prompts, plain)] == greedy_before


def test_grpo_run_with_the_self_distillation_warmup(tmp_path: Path) -> None:
    preset, _, _ = setup()
    changes = dict(warmup_steps=2, num_steps=1, num_prompts=4, group_size=2, num_eval_prompts=4)
    rl = preset.rl.replace(eval_every=1, **changes)
    run = GRPORun(preset.replace(rl=rl), tmp_path, device="cpu")
    rows = run.run(progress=False)
    assert [r["phase"] for r in rows] == ["mtp", "mtp", "eval", "grpo", "eval"]
    assert "eval_accept_1" in rows[2] and rows[0]["mtp_loss"] > 0
