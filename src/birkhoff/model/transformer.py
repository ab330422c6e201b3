"""The mHC + MTP decoder-only transformer (training layout).

Legend: B batch, T tokens, S streams, D model dim, V vocab, M MTP depth.

`decoder()` returns the contracted hidden state [B,T,D] and the multistream [B,T,S,D] the MTP
depths consume. `forward()` without labels returns the main head's logits [B,T,V]; with labels
(the input ids, shifted inside: mtp.py) it returns the main loss, one loss per MTP depth and the
main head's logprob and argmax per position, all through `model.logprobs.token_logprobs`, so
`logits` is None. `temperature` scales the main head only. Recompute is applied from outside
(`birkhoff.train.recompute.apply_recompute`), keeping every parameter name. See docs/mhc.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.block import Block, RopeTables
from birkhoff.model.hyper import build_contraction, expand_streams
from birkhoff.model.layers import RMSNorm, rope_tables
from birkhoff.model.logprobs import token_logprobs
from birkhoff.model.mtp import MTPDepth, combine_losses, masked_mean, masked_token_ce, shift_targets
from birkhoff.model.v4_attention import v4_rope


class DecoderOutput(NamedTuple):
    hidden: Tensor  # [B,T,D] contracted + final norm
    multistream: Tensor  # [B,T,S,D] before the output contraction


class TransformerOutput(NamedTuple):
    logits: Tensor | None  # [B,T,V] main head; None when labels are given
    loss: Tensor | None  # L_main + lambda/M sum_k L_k
    main_loss: Tensor | None
    mtp_losses: list[Tensor]  # one scalar per depth; empty when M = 0
    logp: Tensor | None = None  # [B,T] >= fp32: log p(labels[i+1]) at position i (last: masked)
    argmax: Tensor | None = None  # [B,T] the main head's most likely token at position i


_CHECK_VALUES: ContextVar[bool] = ContextVar("check_token_values", default=True)


@contextmanager
def token_values_unchecked() -> Iterator[None]:
    """Inside, `check_token_ids` checks dtype and shape only. Reading the ids' range is a host
    sync, which a CUDA graph capture cannot do; the capturing caller (train/graph.py) checks every
    batch it replays."""
    token = _CHECK_VALUES.set(False)
    try:
        yield
    finally:
        _CHECK_VALUES.reset(token)


def check_token_ids(ids: Tensor, *, name: str, vocab_size: int, max_seq_len: int) -> None:
    """Boundary check for token-id batches: 2-D integer, non-empty, in vocabulary, not too long."""
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64/int32 [B,T] tensor, got {ids.dtype} {ids.shape}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty: shape {tuple(ids.shape)}")
    if ids.shape[1] > max_seq_len:
        raise ValueError(f"{name} has length {ids.shape[1]} > max_seq_len={max_seq_len}")
    if not _CHECK_VALUES.get():
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds token id {lo if lo < 0 else hi} outside [0, {vocab_size})")


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks: list[Block] = [Block(cfg, i) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(self.blocks)  # typed list above, registered modules here
        self.contraction = build_contraction(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp_depths: list[MTPDepth] = [MTPDepth(cfg, k) for k in range(cfg.mtp_depth)]
        self.mtp = nn.ModuleList(self.mtp_depths)
        self.init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_weights(self) -> None:
        """Normal(0, 0.02); residual-output projections scaled by 1/sqrt(2 * num sublayers)."""
        out_std = 0.02 / math.sqrt(2 * (self.cfg.num_layers + self.cfg.mtp_depth))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                is_out = name.endswith(("attn.wo", "attn.o_b_proj", "mlp.w_down"))
                nn.init.normal_(module.weight, std=out_std if is_out else 0.02)

    def rope(self, T: int, device: torch.device) -> RopeTables:
        positions_BT = torch.arange(T, device=device)[None, :]
        if self.cfg.attention is not None:
            return v4_rope(positions_BT, self.cfg)
        return rope_tables(positions_BT, self.cfg.head_dim, self.cfg.rope_theta, cfg=self.cfg)

    def residual(self, x_BTD: Tensor) -> Tensor:
        """The embedding as the residual's first value: in the autocast dtype when the config's
        `residual_dtype` is "autocast" and autocast is on (every later residual update then
        stays in it), else as it is (fp32 with fp32 weights)."""
        device = x_BTD.device.type
        if self.cfg.residual_dtype == "autocast" and torch.is_autocast_enabled(device):
            return x_BTD.to(torch.get_autocast_dtype(device))
        return x_BTD

    def decoder(self, input_ids_BT: Tensor) -> DecoderOutput:
        rope = self.rope(input_ids_BT.shape[1], input_ids_BT.device)
        x_BTSD = expand_streams(self.residual(self.embed(input_ids_BT)), self.cfg.num_streams)
        for block in self.blocks:
            x_BTSD = block(x_BTSD, rope, input_ids_BT)
        return DecoderOutput(self.norm(self.contraction(x_BTSD)), x_BTSD)

    def mtp_hidden(self, multistream_BTSD: Tensor, input_ids_BT: Tensor) -> list[Tensor]:
        """Head inputs [B,T,D] of depths 1..M; depth k sees Emb(t_{i+k}) at position i."""
        if self.cfg.mtp_depth == 0:
            return []
        self.mtp_depths[0].check_streams(multistream_BTSD)
        rope = self.rope(input_ids_BT.shape[1], input_ids_BT.device)
        h_BTSD, outs = multistream_BTSD, []
        for k, depth in enumerate(self.mtp_depths, start=1):
            emb_BTD = self.embed(torch.roll(input_ids_BT, -k, dims=1))
            h_BTSD = depth(h_BTSD, emb_BTD, rope)
            outs.append(depth.head_input(h_BTSD))
        return outs

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        *,
        temperature: float = 1.0,
    ) -> TransformerOutput:
        cfg = self.cfg
        check_token_ids(
            input_ids, name="input_ids", vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len
        )
        out = self.decoder(input_ids)
        if labels is None:
            return TransformerOutput(self.lm_head(out.hidden), None, None, [])
        mask_BT = self.check_labels(input_ids, labels, loss_mask)
        weight_VD = self.lm_head.weight  # the MTP depths share it
        targets_BT, in_BT = shift_targets(labels, mask_BT, 1)
        head = token_logprobs(out.hidden, weight_VD, targets_BT, temperature=temperature)
        main = masked_mean(-head.logp, in_BT)
        mtp_losses = [
            masked_token_ce(h_BTD, weight_VD, *shift_targets(labels, mask_BT, k + 1))
            for k, h_BTD in enumerate(self.mtp_hidden(out.multistream, input_ids), start=1)
        ]
        loss = combine_losses(main, mtp_losses, cfg.mtp_loss_weight)
        return TransformerOutput(None, loss, main, mtp_losses, head.logp, head.argmax)

    def check_labels(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor | None) -> Tensor:
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        check_token_ids(
            labels, name="labels", vocab_size=self.cfg.vocab_size, max_seq_len=self.cfg.max_seq_len
        )
        if loss_mask is None:
            return torch.ones_like(labels, dtype=torch.bool)
        if loss_mask.shape != labels.shape:
            raise ValueError(
                f"loss_mask shape {tuple(loss_mask.shape)} != labels shape {tuple(labels.shape)}"
            )
        return loss_mask.bool()
