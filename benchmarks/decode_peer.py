"""What benchmarks/decode.py measures beside the engine: GPU busy time, and a peer engine.

- `device_seconds(fn)`: the time during which something `fn` ran on the GPU (kernels, copies,
  memsets) runs, from torch.profiler (overlapping streams counted once); decode.py takes
  busy = (device time of a long run - of a short run) / (wall time of the same two runs),
  i.e. over steady-state decode steps only.
- `hf_peer(...)`: HuggingFace transformers' `generate` on a dense Llama of the given shape with
  random weights (greedy, every row exactly `new_tokens` tokens, EOS ignored):
  "static" = static KV cache, which transformers compiles with torch.compile in its
  "reduce-overhead" (CUDA-graph) mode on CUDA; "eager" = the default dynamic cache, no compile.
  transformers is an optional benchmark dependency (`pip install -e .[bench]`), imported here only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from common import covered_us, sync

from birkhoff.config import ModelConfig


def device_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds during which some GPU activity `fn` causes runs (`covered_us`; 0.0 on CPU)."""
    if device.type != "cuda":
        return 0.0
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA]  # fmt: skip
    return covered_us(spans) * 1e-6


def llama_like(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """A random-weight transformers Llama with the shape of `cfg` (S = 1, M = 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()


def hf_peer(
    cfg: ModelConfig, prompts: list[list[int]], new_tokens: int, mode: str,
    device: torch.device, dtype: torch.dtype, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of transformers' generate in `mode` ("static" | "eager") on these prompts
    (equal lengths, so no padding); best of `repeats` after two warm-up calls (compilation)."""
    model = llama_like(cfg, device, dtype)
    ids = torch.tensor(prompts, device=device)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    if mode == "static":
        kwargs["cache_implementation"] = "static"

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

    start = time.perf_counter()
    for _ in range(2):  # the first calls compile (static) and warm up
        run()
    sync(device)
    warmup = time.perf_counter() - start
    seconds, tokens = float("inf"), 0
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        tokens = run()
        sync(device)
        seconds = min(seconds, time.perf_counter() - start)
    return {"peer": f"hf-{mode}", "batch": len(prompts), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "warmup_seconds": warmup}  # fmt: skip
