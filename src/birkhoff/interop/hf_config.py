"""HF config.json <-> ModelConfig for the dense Llama family (Llama, Mistral, Qwen2, Qwen3).

Design choices:
- Every HF option either maps to a ModelConfig field or is checked to have the value that the
  birkhoff model computes; anything else raises `ValueError` naming the HF field and its value.
  Nothing is approximated silently (a sliding window shorter than the context, an MLP bias, a
  rope variant birkhoff does not implement, a non-SiLU activation all fail).
- Both rope layouts of config.json are read: transformers >= 5 writes `rope_parameters`
  (rope_theta inside), older files have `rope_theta` + `rope_scaling`.
- Mistral's and Qwen's sliding window is exact when no sequence is longer than the window, so
  the imported `max_seq_len` is capped at the window instead of refusing the model.
- `hf_config_from_model` writes a Llama/Qwen2/Qwen3 config.json for a birkhoff model that was
  not imported (an imported one exports its original config.json unchanged).
"""

from __future__ import annotations

import math
from typing import Any

from birkhoff.config import ModelConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def hf_error(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"config.json: {field}={value!r} is not supported: {why}")


def require(hf: dict[str, Any], field: str, allowed: tuple[object, ...], why: str) -> None:
    """Raise unless hf[field] (when present) is one of `allowed`."""
    if field in hf and hf[field] not in allowed:
        raise hf_error(field, hf[field], why)


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope dict in the transformers >= 5 layout (rope_theta and rope_type inside)."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params = dict(params)
    if "type" in params and "rope_type" not in params:  # the pre-2024 spelling
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if not isinstance(params["rope_theta"], int | float):
        raise hf_error("rope_parameters", params, "one rope for all layers is expected")
    return params


def yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """transformers' default cos/sin scale for yarn: 0.1 ln(factor) + 1 (or the mscale ratio)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig rope fields of an HF config; unsupported variants raise naming the field."""
    params = rope_parameters(hf)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise hf_error("rope_parameters.rope_type", kind, f"supported: {list(SUPPORTED_ROPE)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf_error("partial_rotary_factor", params["partial_rotary_factor"], "must be 1.0")
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    if kind == "default":
        return out
    if params.get("factor") is None:
        raise hf_error("rope_parameters.factor", None, f"rope_type={kind!r} needs a factor")
    out |= {"rope_scaling": kind, "rope_factor": float(params["factor"])}
    if kind in ("llama3", "yarn"):
        out["rope_original_max_seq_len"] = int(params["original_max_position_embeddings"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
    if kind == "yarn":
        out["rope_beta_fast"] = float(params.get("beta_fast") or 32)
        out["rope_beta_slow"] = float(params.get("beta_slow") or 1)
        out["rope_truncate"] = bool(params.get("truncate", True))
        out["rope_attention_factor"] = yarn_attention_factor(params, out["rope_factor"])
    return out


def check_supported(hf: dict[str, Any]) -> str:
    """The model_type, after refusing every option birkhoff would not compute exactly."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise hf_error("model_type", model_type, f"supported: {sorted(ARCHITECTURES)}")
    require(hf, "hidden_act", ("silu",), "the MLP is SwiGLU (silu)")
    require(hf, "mlp_bias", (False,), "the MLP has no biases")
    require(hf, "pretraining_tp", (1, None), "tensor-parallel slicing of the MLP is not modelled")
    require(hf, "use_sliding_window", (False, None), "attention is full-context")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise hf_error("layer_types", sorted(layer_types), "every layer must be full_attention")
    return str(model_type)


def model_config_from_hf(
    hf: dict[str, Any], *, num_streams: int = 1, mtp_depth: int = 0, max_seq_len: int | None = None
) -> ModelConfig:
    """ModelConfig for an HF Llama-family config.json dict (S streams, M MTP depths)."""
    model_type = check_supported(hf)
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or dim // heads
    limit = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window") if model_type == "mistral" else None
    if window is not None:
        limit = min(limit, int(window))  # exact while no sequence is longer than the window
    if max_seq_len is not None and max_seq_len > limit:
        raise ValueError(f"max_seq_len={max_seq_len} is invalid: the checkpoint allows {limit}")
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=dim,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        mlp_hidden=int(hf["intermediate_size"]),
        num_streams=num_streams,
        mtp_depth=mtp_depth,
        max_seq_len=max_seq_len or limit,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else bias,
        attn_out_bias=False if model_type == "qwen2" else bias,
        qk_norm=model_type == "qwen3",
        attn_head_dim=None if head_dim * heads == dim else int(head_dim),
        **rope_fields(hf),
    )


def rope_parameters_of(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers >= 5 `rope_parameters` dict of a ModelConfig."""
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling != "none":
        params |= {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = cfg.rope_original_max_seq_len
    if cfg.rope_scaling == "llama3":
        params |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
        }
    if cfg.rope_scaling == "yarn":
        params |= {
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
            "attention_factor": cfg.rope_attention_factor,
        }
    return params


def model_type_of(cfg: ModelConfig) -> str:
    """The HF family that expresses `cfg` exactly (Qwen3: q/k norm, Qwen2: q/k/v bias only)."""
    if cfg.qk_norm:
        if cfg.qkv_bias != cfg.attn_out_bias:
            raise ValueError(f"qkv_bias={cfg.qkv_bias} with qk_norm: Qwen3 biases are all or none")
        return "qwen3"
    if cfg.qkv_bias and not cfg.attn_out_bias:
        return "qwen2"
    if cfg.attn_out_bias and not cfg.qkv_bias:
        raise ValueError("attn_out_bias=True without qkv_bias has no HF Llama-family equivalent")
    return "llama"


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dict for an S=1, M=0 birkhoff model (Llama, Qwen2 or Qwen3)."""
    if cfg.num_streams != 1:
        raise ValueError(f"num_streams={cfg.num_streams} is invalid: export needs S=1")
    model_type = model_type_of(cfg)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope_parameters_of(cfg),
    }
    if model_type != "qwen2":
        hf["attention_bias"] = cfg.qkv_bias
    return hf
