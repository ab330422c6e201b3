"""Shared helpers: tiny configs and a model whose MTP depths were trained a little.

The task is a noisy Fibonacci recurrence mod V (t_{i+1} = t_i + t_{i-1} mod V, with a few random
tokens), so after a short training run the main model and the MTP depths are right often but not
always: speculative drafts get both accepted and rejected, which the speculative tests need.
"""

from __future__ import annotations

import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer


def tiny_config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=16, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, num_streams=2,
        mtp_depth=2, max_seq_len=48,
    )  # fmt: skip
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def fibonacci_batch(
    batch: int, length: int, vocab: int, noise: float, gen: torch.Generator
) -> torch.Tensor:
    ids = torch.zeros(batch, length, dtype=torch.long)
    ids[:, :2] = torch.randint(0, vocab, (batch, 2), generator=gen)
    for i in range(2, length):
        ids[:, i] = (ids[:, i - 1] + ids[:, i - 2]) % vocab
        flip = torch.rand(batch, generator=gen) < noise
        ids[flip, i] = torch.randint(0, vocab, (int(flip.sum()),), generator=gen)
    return ids


def train_briefly(cfg: ModelConfig, *, steps: int, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    # one thread: tensors this small gain nothing from more, and a busy machine makes more slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            ids = fibonacci_batch(16, 16, cfg.vocab_size, 0.1, gen)
            loss = model(ids, labels=ids).loss
            assert loss is not None
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def trained_tiny_model() -> Transformer:
    # one layer and 5 Sinkhorn iterations keep this at ~2 s of CPU; the engine reads both from cfg
    return train_briefly(tiny_config(num_layers=1, sinkhorn_iters=5), steps=40)


def chi_square_pvalue(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
) -> float:
    """Pearson goodness-of-fit p-value of `counts` against `probs` (bins with expected count
    below `min_expected` are pooled into one bin, as the chi-square approximation needs)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = torch.cat((counts[~small], counts[small].sum()[None]))
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
