"""DeepSeek-V4 config.json (transformers' DeepseekV4Config) <-> birkhoff's ModelConfig.

Every field of a V4 config.json maps to a ModelConfig / V4AttentionConfig / MoEConfig field,
is checked to have the one value birkhoff computes (`FIXED`), or is metadata (`IGNORED`); any
other field or value raises `ValueError` naming it. Both spellings are read: transformers 5's
(`layer_types`, `compress_rates`, `mlp_layer_types`, nested `rope_parameters`) and the released
checkpoints' (`compress_ratios` with the MTP layers' entries, which must be 0 = sliding,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`). Block-fp8 `quantization_config` is
read by the importer; fp4 experts are refused. `v4_config_from_model` writes transformers 5's
spelling; the two are inverse on the fields a V4 config.json describes. docs/v4.md has the table.
"""

from __future__ import annotations

from typing import Any

from birkhoff.config import ModelConfig, MoEConfig, V4AttentionConfig
from birkhoff.interop.hf_config import hf_error

CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
IGNORED = frozenset(
    {  # metadata and runtime switches: no effect on the computation
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "initializer_range",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "_name_or_path",
        "id2label",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
    }
)
FIXED: dict[str, tuple[tuple[object, ...], str]] = {  # field: (values birkhoff computes, why)
    "num_key_value_heads": ((1,), "V4 reads one shared key/value head"),
    "n_shared_experts": ((1,), "transformers builds one shared expert of moe_intermediate_size"),
    "norm_topk_prob": ((True,), "the selected gates are always normalised"),
    "router_jitter_noise": ((0, 0.0), "router jitter is not implemented"),
    "attention_dropout": ((0, 0.0), "attention dropout is not implemented"),
    "hidden_act": (("silu",), "the experts are SwiGLU (silu)"),
    "attention_bias": ((False,), "V4 attention has no biases"),
    "mlp_bias": ((False,), "V4 experts have no biases"),
    "topk_method": (("noaux_tc",), "routing is top-k with the selection bias"),
    "expert_dtype": (("fp8", "bf16"), "fp4 experts are not supported"),
}
MAPPED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "partial_rotary_factor",
        "qk_rope_head_dim",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "n_routed_experts",
        "scoring_func",
        "routed_scaling_factor",
        "max_position_embeddings",
        "rope_theta",
        "layer_types",
        "compress_ratios",
        "compress_rates",
        "compress_rate_csa",
        "compress_rate_hca",
        "compress_rope_theta",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "mlp_layer_types",
        "num_hash_layers",
        "swiglu_limit",
        "sliding_window",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "num_nextn_predict_layers",
        "output_router_logits",
        "router_aux_loss_coef",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "quantization_config",
    }
)


def check_fields(hf: dict[str, Any]) -> None:
    """Refuse a non-V4 model_type, unknown fields and values birkhoff would not compute."""
    if hf.get("model_type") != "deepseek_v4":
        raise hf_error("model_type", hf.get("model_type"), "expected 'deepseek_v4'")
    unknown = sorted(set(hf) - IGNORED - MAPPED - set(FIXED))
    if unknown:
        raise ValueError(f"config.json: unknown DeepSeek-V4 field(s) {unknown}")
    for field, (allowed, why) in FIXED.items():
        if field in hf and hf[field] not in allowed:
            raise hf_error(field, hf[field], why)
    quant = hf.get("quantization_config")
    if quant is not None:
        check_quantization(quant)


def check_quantization(quant: dict[str, Any]) -> None:
    """Only DeepSeek's block fp8 (e4m3, one scale per 128x128 block) is read."""
    expected = {
        "quant_method": ("fp8",),
        "fmt": ("e4m3", None),
        "weight_block_size": ([128, 128],),
        "scale_fmt": ("ue8m0", None),
        "activation_scheme": ("dynamic", None),
    }
    for key, value in quant.items():
        if key not in expected or value not in expected[key]:
            raise hf_error(f"quantization_config.{key}", value, "block fp8 e4m3 128x128 only")


def compress_rates(hf: dict[str, Any]) -> tuple[int, int]:
    """(CSA, HCA) compression rates: `compress_rates`, else the legacy scalars, else 4 / 128."""
    rates = dict(hf.get("compress_rates") or {})
    csa = int(rates.get(CSA, hf.get("compress_rate_csa", 4)))
    hca = int(rates.get(HCA, hf.get("compress_rate_hca", 128)))
    return csa, hca


def layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer attention kinds: `layer_types`, else `compress_ratios` (0 sliding, the CSA
    rate CSA, the HCA rate HCA; entries past the decoder are the MTP layers', which must be 0)."""
    if hf.get("layer_types") is not None:
        kinds = tuple(hf["layer_types"])
        if len(kinds) != num_layers:
            raise hf_error("layer_types", len(kinds), f"needs num_hidden_layers={num_layers}")
        return kinds
    ratios = hf.get("compress_ratios")
    if ratios is None:  # transformers' default schedule: 2 HCA, then CSA / HCA interleaved
        return tuple(
            [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(num_layers - 2)]
        )
    csa, hca = compress_rates(hf)
    by_ratio = {0: SLIDING, csa: CSA, hca: HCA}
    if len(ratios) < num_layers or any(r not in by_ratio for r in ratios):
        raise hf_error("compress_ratios", ratios, f"{num_layers}+ entries of 0, {csa} or {hca}")
    for i, ratio in enumerate(ratios[num_layers:], start=num_layers):
        if ratio != 0:
            raise hf_error(f"compress_ratios[{i}]", ratio, "MTP layers use sliding attention")
    return tuple(by_ratio[r] for r in ratios[:num_layers])


def num_hash_layers(hf: dict[str, Any], num_layers: int) -> int:
    """Hash-routed MoE layers: a prefix of `mlp_layer_types`, else `num_hash_layers` (3)."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return min(int(hf.get("num_hash_layers", 3)), num_layers)
    count = list(kinds).count("hash_moe")
    if list(kinds) != ["hash_moe"] * count + ["moe"] * (num_layers - count):
        raise hf_error("mlp_layer_types", kinds, "hash_moe layers first, then moe")
    return count


def rope_head_dim(hf: dict[str, Any]) -> int:
    """qk_rope_head_dim: head_dim * partial_rotary_factor (or the legacy field; both agree)."""
    head_dim = int(hf["head_dim"])
    factor = hf.get("partial_rotary_factor")
    legacy = hf.get("qk_rope_head_dim")
    rope = int(head_dim * factor) if factor is not None else int(legacy or head_dim // 8)
    if legacy is not None and int(legacy) != rope:
        raise hf_error("qk_rope_head_dim", legacy, f"partial_rotary_factor gives {rope}")
    return rope


def compress_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's rope fields: V4 applies a yarn scaling to the compressed branches only
    (rope_parameters.compress, or the legacy rope_scaling); the main rope must be plain."""
    params = hf.get("rope_parameters") or {}
    main = params.get("main") or {}
    if main.get("rope_type", "default") != "default":
        raise hf_error("rope_parameters.main.rope_type", main["rope_type"], "must be default")
    if "rope_theta" in main and float(main["rope_theta"]) != float(hf.get("rope_theta", 1e4)):
        raise hf_error("rope_parameters.main.rope_theta", main["rope_theta"], "!= rope_theta")
    scaling = dict(params.get("compress") or hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise hf_error("rope_parameters.compress.rope_type", kind, "default | yarn")
    if float(scaling.get("attention_factor", 1.0)) != 1.0:
        raise hf_error(
            "rope_parameters.compress.attention_factor",
            scaling["attention_factor"],
            "V4 does not scale cos/sin",
        )
    return {
        "rope_scaling": "yarn",
        "rope_factor": float(scaling["factor"]),
        "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
        "rope_beta_fast": float(scaling.get("beta_fast") or 32),
        "rope_beta_slow": float(scaling.get("beta_slow") or 1),
        "rope_truncate": bool(scaling.get("truncate", True)),
    }


def attention_config(hf: dict[str, Any], num_layers: int) -> V4AttentionConfig:
    csa, hca = compress_rates(hf)
    return V4AttentionConfig(
        q_lora_rank=int(hf["q_lora_rank"]),
        head_dim=int(hf["head_dim"]),
        qk_rope_head_dim=rope_head_dim(hf),
        layer_types=layer_types(hf, num_layers),  # type: ignore[arg-type]
        sliding_window=int(hf.get("sliding_window", 128)),
        compress_rate_csa=csa,
        compress_rate_hca=hca,
        compress_rope_theta=float(hf.get("compress_rope_theta", 160000.0)),
        index_n_heads=int(hf.get("index_n_heads", 64)),
        index_head_dim=int(hf.get("index_head_dim", 128)),
        index_topk=int(hf.get("index_topk", 512)),
        o_groups=int(hf.get("o_groups", 8)),
        o_lora_rank=int(hf.get("o_lora_rank", 1024)),
    )


def moe_config(hf: dict[str, Any], num_layers: int) -> MoEConfig:
    balance = bool(hf.get("output_router_logits", False))
    return MoEConfig(
        num_experts=int(hf.get("n_routed_experts", 256)),
        experts_per_token=int(hf.get("num_experts_per_tok", 6)),
        expert_hidden=int(hf.get("moe_intermediate_size", 2048)),
        num_shared_experts=1,
        num_dense_layers=0,
        route_scale=float(hf.get("routed_scaling_factor", 1.5)),
        balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) if balance else 0.0,
        balance_loss="switch",
        scoring=hf.get("scoring_func", "sqrtsoftplus"),
        num_hash_layers=num_hash_layers(hf, num_layers),
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
    )


def model_config_from_v4(
    hf: dict[str, Any], *, mtp_depth: int | None = None, max_seq_len: int | None = None
) -> ModelConfig:
    """ModelConfig of a DeepSeek-V4 config.json dict; `mtp_depth` (default: the checkpoint's
    num_nextn_predict_layers) may keep fewer MTP depths, `max_seq_len` a shorter context."""
    check_fields(hf)
    num_layers = int(hf.get("num_hidden_layers", 43))
    depths = int(hf.get("num_nextn_predict_layers", 1))
    if mtp_depth is not None and not 0 <= mtp_depth <= depths:
        raise ValueError(f"mtp_depth={mtp_depth} is invalid: the checkpoint has {depths} depths")
    limit = int(hf.get("max_position_embeddings", 1048576))
    if max_seq_len is not None and max_seq_len > limit:
        raise ValueError(f"max_seq_len={max_seq_len} is invalid: the checkpoint allows {limit}")
    dim = int(hf["hidden_size"])
    expert_hidden = int(hf.get("moe_intermediate_size", 2048))
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=dim,
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=1,
        mlp_hidden=expert_hidden,
        num_streams=int(hf.get("hc_mult", 4)),
        sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
        mhc_eps=float(hf.get("hc_eps", 1e-6)),
        mtp_depth=depths if mtp_depth is None else mtp_depth,
        max_seq_len=max_seq_len or limit,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe_config(hf, num_layers),
        attention=attention_config(hf, num_layers),
        **compress_rope(hf),
    )


def check_exportable(cfg: ModelConfig) -> tuple[V4AttentionConfig, MoEConfig]:
    """cfg's V4 attention and MoE, after refusing what a V4 config.json cannot say."""
    v4, moe = cfg.attention, cfg.moe
    if v4 is None:
        raise ValueError("attention=None is invalid: a DeepSeek-V4 export needs V4 attention")
    if moe is None:
        raise ValueError("moe=None is invalid: DeepSeek-V4 layers are all MoE")
    wrong = {
        "num_dense_layers": (moe.num_dense_layers, 0),
        "mtp_moe": (moe.mtp_moe, True),
        "num_shared_experts": (moe.num_shared_experts, 1),
        "balance_loss": (moe.balance_loss, "switch"),
        "swiglu_limit is None": (moe.swiglu_limit is None, False),
    }
    for field, (value, needed) in wrong.items():
        if value != needed:
            raise ValueError(f"moe.{field}={value!r} is invalid: DeepSeek-V4 has {needed!r}")
    if cfg.mlp_hidden not in (None, moe.expert_hidden):
        raise ValueError(f"mlp_hidden={cfg.mlp_hidden} is invalid: V4 has no dense MLP")
    if cfg.rope_scaling not in ("none", "yarn") or cfg.rope_attention_factor != 1.0:
        raise ValueError(f"rope_scaling={cfg.rope_scaling!r}: V4 has yarn on the compress rope")
    return v4, moe


def rope_parameters(cfg: ModelConfig, v4: V4AttentionConfig) -> dict[str, Any]:
    factor = v4.qk_rope_head_dim / v4.head_dim
    main = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": factor}
    compress: dict[str, Any] = {**main, "rope_theta": v4.compress_rope_theta}
    if cfg.rope_scaling == "yarn":
        compress |= {
            "rope_type": "yarn",
            "factor": cfg.rope_factor,
            "beta_fast": cfg.rope_beta_fast,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
            "attention_factor": 1.0,
        }
    return {"main": main, "compress": compress}


def v4_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers 5 DeepseekV4Config dict (config.json) of a birkhoff V4 ModelConfig."""
    v4, moe = check_exportable(cfg)
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": v4.head_dim,
        "q_lora_rank": v4.q_lora_rank,
        "partial_rotary_factor": v4.qk_rope_head_dim / v4.head_dim,
        "layer_types": list(v4.layer_types),
        "compress_rates": {CSA: v4.compress_rate_csa, HCA: v4.compress_rate_hca},
        "compress_rope_theta": v4.compress_rope_theta,
        "sliding_window": v4.sliding_window,
        "o_groups": v4.o_groups,
        "o_lora_rank": v4.o_lora_rank,
        "index_n_heads": v4.index_n_heads,
        "index_head_dim": v4.index_head_dim,
        "index_topk": v4.index_topk,
        "moe_intermediate_size": moe.expert_hidden,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "n_shared_experts": 1,
        "scoring_func": moe.scoring,
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.route_scale,
        "mlp_layer_types": ["hash_moe"] * moe.num_hash_layers
        + ["moe"] * (cfg.num_layers - moe.num_hash_layers),
        "swiglu_limit": moe.swiglu_limit,
        "output_router_logits": moe.balance_loss_weight > 0,
        "router_aux_loss_coef": moe.balance_loss_weight or 0.001,
        "hc_mult": cfg.num_streams,
        "hc_sinkhorn_iters": cfg.sinkhorn_iters,
        "hc_eps": cfg.mhc_eps,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters(cfg, v4),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
    }
