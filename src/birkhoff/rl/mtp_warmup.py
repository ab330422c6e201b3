"""MTP self-distillation: the MTP depths learn the model's own greedy continuations before GRPO.

Legend: B batch, T tokens.

An upcycled depth starts as a copy of the last layer (interop/upcycle.py) and drafts poorly.
Each warm-up step (`self_distill_steps`) takes the step's task prompts, lets the engine complete
them greedily (plain decoding), and trains the mean MTP loss over the depths on prompt +
completion with every parameter outside the depths frozen, so the policy GRPO starts from is
exactly the imported model. The loop refits the engine when the warm-up ends. Why greedy
targets and a frozen main model: docs/grpo.md.
Left out: data parallel (a frozen subset under FSDP2), soft targets from the main head.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.decode import Completion
from birkhoff.rl.config import RLConfig
from birkhoff.runtime.metrics import memory_metrics, reset_peak_memory
from birkhoff.tasks.batches import SupervisedBatch, prompt_ids
from birkhoff.tasks.problems import Task, sample_problems, step_rng
from birkhoff.tokenizer import Tokenizer
from birkhoff.train.config import TrainConfig
from birkhoff.train.step import Metrics, model_device, train_step


def own_output_batch(
    prompts: list[list[int]], completions: list[Completion], *, pad_id: int
) -> SupervisedBatch:
    """[B,T] prompt + completion ids, right-padded, the mask on the completion tokens."""
    rows = [p + c.tokens for p, c in zip(prompts, completions, strict=True)]
    T = max(len(r) for r in rows)
    ids_BT = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.bool)
    for b, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        ids_BT[b, : len(row)] = torch.tensor(row)
        mask_BT[b, len(prompt) : len(row)] = True
    return SupervisedBatch(ids_BT, mask_BT)


def mtp_loss(model: nn.Module, batch: SupervisedBatch) -> tuple[Tensor, Metrics]:
    """The mean MTP loss over the depths (the main head's loss is reported, not trained)."""
    out = model(batch.input_ids, labels=batch.input_ids, loss_mask=batch.loss_mask)
    if not out.mtp_losses:
        raise ValueError("mtp_depth=0: the MTP self-distillation warm-up needs MTP depths")
    loss = torch.stack(out.mtp_losses).mean()
    metrics: Metrics = {f"mtp_loss_{k}": x.detach() for k, x in enumerate(out.mtp_losses, 1)}
    metrics.update(mtp_loss=loss.detach(), main_loss=out.main_loss.detach())
    return loss, metrics


@contextmanager
def only_mtp_trainable(model: nn.Module) -> Iterator[None]:
    """Inside, every parameter outside `model.mtp` has requires_grad False (restored after):
    no gradient reaches the trunk, the embedding or the shared lm_head, and AdamW skips them."""
    mtp_params = {id(p) for p in model.get_submodule("mtp").parameters()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in mtp_params]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def greedy_completions(
    engine: Engine, prompts: list[list[int]], task: Task, tokenizer: Tokenizer, rl: RLConfig
) -> list[Completion]:
    """The main model's greedy completions, stopped as the rollouts stop."""
    stop = getattr(task, "stop", ())
    params = SamplingParams(rl.max_new_tokens, stop_token_ids=tokenizer.stop_ids, stop=stop)
    return engine.generate(prompts, params, detokenize=tokenizer.decode)


def self_distill_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: Engine,
    task: Task,
    tokenizer: Tokenizer,
    cfg: TrainConfig,
    rl: RLConfig,
    *,
    steps: range,
) -> Iterator[dict[str, Any]]:
    """Run the warm-up steps `steps`, yielding each one's metrics row (phase "mtp")."""
    device = model_device(model)
    for step in steps:
        reset_peak_memory(device)
        start = time.perf_counter()
        problems = sample_problems(task, step_rng(cfg.seed, step), cfg.batch_size)
        prompts = [prompt_ids(p, tokenizer) for p in problems]
        completions = greedy_completions(engine, prompts, task, tokenizer, rl)
        generate_s = time.perf_counter() - start
        batch = own_output_batch(prompts, completions, pad_id=tokenizer.pad_id).to(device)
        start = time.perf_counter()
        with only_mtp_trainable(model):
            metrics = train_step(model, optimizer, batch, cfg, step=step, loss_fn=mtp_loss)
        row: dict[str, Any] = {"phase": "mtp", "step": step, **metrics, "generate_s": generate_s}
        row.update(train_s=time.perf_counter() - start, **memory_metrics(device))
        row["completion_tokens"] = sum(len(c.tokens) for c in completions) / len(completions)
        yield row
