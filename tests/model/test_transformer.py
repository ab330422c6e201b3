"""The transformer: S=1 reduces to a hand-written pre-norm transformer; init close to S=1."""

import pytest
import torch
import torch.nn.functional as F

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer


def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _ref_rope(x_BTHK: torch.Tensor, theta: float) -> torch.Tensor:
    # Written independently: rotate (x_j, x_{j+K/2}) by angle pos * theta^(-2j/K).
    B, T, H, K = x_BTHK.shape
    out = torch.empty_like(x_BTHK)
    for j in range(K // 2):
        ang = torch.arange(T, dtype=torch.float64) * theta ** (-2.0 * j / K)
        c, s = ang.cos()[None, :, None], ang.sin()[None, :, None]
        a, b = x_BTHK[..., j], x_BTHK[..., j + K // 2]
        out[..., j], out[..., j + K // 2] = a * c - b * s, b * c + a * s
    return out


def _reference_logits(sd: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor):
    B, T = ids.shape
    H, Hkv, K, eps = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.norm_eps
    x = sd["embed.weight"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = _ref_rms(x, sd[p + "attn_norm.weight"], eps)
        q = _ref_rope((h @ sd[p + "attn.wq.weight"].T).view(B, T, H, K), cfg.rope_theta)
        k = _ref_rope((h @ sd[p + "attn.wk.weight"].T).view(B, T, Hkv, K), cfg.rope_theta)
        v = (h @ sd[p + "attn.wv.weight"].T).view(B, T, Hkv, K)
        k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
        scores = torch.einsum("bthk,bshk->bhts", q, k) / K**0.5
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhts,bshk->bthk", att, v).reshape(B, T, H * K)
        x = x + o @ sd[p + "attn.wo.weight"].T
        h = _ref_rms(x, sd[p + "mlp_norm.weight"], eps)
        gate, up = h @ sd[p + "mlp.w_gate.weight"].T, h @ sd[p + "mlp.w_up.weight"].T
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.w_down.weight"].T
    return _ref_rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_single_stream_equals_plain_prenorm_transformer(num_kv_heads: int | None) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=23,
        dim=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        num_streams=1,
        mtp_depth=0,
    )
    model = Transformer(cfg).double()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 23, (2, 11))
    ref = _reference_logits(dict(model.state_dict()), cfg, ids)
    assert torch.allclose(model(ids).logits, ref, atol=1e-10, rtol=0)
    out = model(ids, labels=ids)
    assert out.logits is None  # with labels the [B,T,V] logits are never formed
    assert torch.equal(out.argmax[:, :-1], ref[:, :-1].argmax(-1))
    expected = F.cross_entropy(ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(out.loss, expected, atol=1e-12)
    assert out.mtp_losses == []


def test_multistream_model_at_init_close_to_single_stream() -> None:
    # Same attention/MLP/norm weights, S=4 vs S=1: at init mHC is close to a plain residual,
    # so the final hidden states agree within a few percent.
    torch.manual_seed(0)
    base = dict(vocab_size=31, dim=32, num_layers=4, num_heads=4, mtp_depth=0)
    m4 = Transformer(ModelConfig(**base, num_streams=4)).double()
    m1 = Transformer(ModelConfig(**base, num_streams=1)).double()
    m1.load_state_dict(m4.state_dict(), strict=False)
    ids = torch.randint(0, 31, (2, 16))
    h4, h1 = m4.decoder(ids).hidden, m1.decoder(ids).hidden
    rel = (h4 - h1).norm() / h1.norm()
    assert rel < 0.03, f"S=4 deviates from S=1 by {rel:.4f} at init"


def test_decoder_output_contract() -> None:
    cfg = ModelConfig(vocab_size=17, dim=16, num_layers=1, num_heads=2, num_streams=3)
    out = Transformer(cfg).decoder(torch.zeros(2, 5, dtype=torch.long))
    assert out.hidden.shape == (2, 5, 16)
    assert out.multistream.shape == (2, 5, 3, 16)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.zeros(2, 5), "int64"),
        (torch.zeros(2, 0, dtype=torch.long), "empty"),
        (torch.full((1, 3), 17), "token id 17"),
        (torch.full((1, 3), -1), "token id -1"),
        (torch.zeros(1, 65, dtype=torch.long), "max_seq_len=64"),
    ],
)
def test_bad_input_ids_raise(ids: torch.Tensor, match: str) -> None:
    model = Transformer(
        ModelConfig(vocab_size=17, dim=16, num_layers=1, num_heads=2, max_seq_len=64)
    )
    with pytest.raises(ValueError, match=match):
        model(ids)


def test_unchecked_token_values_skip_only_the_range_read() -> None:
    """Inside `token_values_unchecked` (CUDA graph capture) the ids' range is not read; dtype,
    emptiness and length still are, and the check is back on outside."""
    from birkhoff.model.transformer import check_token_ids, token_values_unchecked

    kw = dict(name="ids", vocab_size=17, max_seq_len=4)
    with token_values_unchecked():
        check_token_ids(torch.full((1, 3), 99), **kw)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_seq_len=4"):
            check_token_ids(torch.zeros(1, 5, dtype=torch.long), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token id 99"):
        check_token_ids(torch.full((1, 3), 99), **kw)  # type: ignore[arg-type]


def test_bad_labels_and_mask_raise() -> None:
    model = Transformer(ModelConfig(vocab_size=17, dim=16, num_layers=1, num_heads=2))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="labels shape"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(ValueError, match="loss_mask shape"):
        model(ids, labels=ids, loss_mask=torch.ones(2, 3))


@pytest.mark.parametrize("streams", [1, 4])
def test_residual_dtype_autocast_keeps_the_streams_in_bf16(streams: int) -> None:
    """residual_dtype="autocast": under bf16 autocast the streams (and the MTP depths' input)
    are bf16 from the embedding on, the loss stays close to fp32 streams' and every parameter
    gets a gradient; without autocast both settings are the same model, exactly."""
    base = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_streams=streams,
                       mtp_depth=1, max_seq_len=32)  # fmt: skip
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for residual in ("fp32", "autocast"):
        torch.manual_seed(0)
        model = Transformer(base.replace(residual_dtype=residual))
        with torch.no_grad():
            plain = model(ids, labels=ids).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
            streams_dtype = model.decoder(ids).multistream.dtype
        assert out.loss is not None and plain is not None
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        expected = torch.bfloat16 if residual == "autocast" else torch.float32
        assert streams_dtype == expected
        losses[residual] = (float(plain), float(out.loss.detach()))
    assert losses["fp32"][0] == losses["autocast"][0]  # no autocast: the same model
    assert abs(losses["fp32"][1] - losses["autocast"][1]) < 0.05


def test_residual_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="residual_dtype"):
        ModelConfig(vocab_size=8, dim=8, num_layers=1, num_heads=2, residual_dtype="fp16")  # type: ignore[arg-type]
