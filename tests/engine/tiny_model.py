"""A tiny Llama-style model directory (config.json + a random safetensors checkpoint) for the engine stage.

With ``soft_cap`` set the model is a Gemma 2 instead (the architecture vLLM hands an attention logit soft cap
to its backends): the same sizes, Gemma's norms, GeGLU and scaled embedding, and no window unless asked for.

No model hub is needed. The weights are random but scaled like a trained model's
(unit-variance activations, attention logits of a few units), so attention is
peaked: a page read in the wrong layout changes the output far beyond any
dtype tolerance. vLLM's ``load_format="dummy"`` weights (uniform in ±1e-3)
would make attention uniform, and any layout would pass.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class TinyModel:
    name: str
    dtype: str = "float16"
    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    sliding_window: int | None = None
    seed: int = 0
    soft_cap: float | None = None  # attention logits capped to cap * tanh(s / cap): a Gemma 2 model

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _sizes(model: TinyModel) -> dict:
    """The config fields every architecture here shares: the model's sizes."""
    return {"hidden_size": model.hidden_size, "intermediate_size": model.intermediate_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim, "vocab_size": model.vocab_size,
            "max_position_embeddings": model.max_position_embeddings}


def config_json(model: TinyModel) -> dict:
    if model.soft_cap is not None:
        return _gemma2_config(model)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_sizes(model),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": model.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model.sliding_window is not None:
        config["sliding_window"] = model.sliding_window
        config["layer_types"] = ["sliding_attention"] * model.num_layers
    return config


def random_weights(model: TinyModel) -> dict[str, torch.Tensor]:
    if model.soft_cap is not None:
        return _gemma2_weights(model)
    gen = torch.Generator().manual_seed(model.seed)
    dtype = getattr(torch, model.dtype)
    h, d = model.hidden_size, model.head_dim

    def normal(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    # q and k projections at 2/sqrt(h): entries of q, k ~ N(0, 4), logits q·k/sqrt(d) with a std of ~4.
    proj = 2.0 / math.sqrt(h)
    weights = {
        "model.embed_tokens.weight": normal(model.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": normal(model.vocab_size, h, std=1.0 / math.sqrt(h)),
    }
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": normal(model.num_heads * d, h, std=proj),
            p + "self_attn.k_proj.weight": normal(model.num_kv_heads * d, h, std=proj),
            p + "self_attn.v_proj.weight": normal(model.num_kv_heads * d, h, std=1.0 / math.sqrt(h)),
            p + "self_attn.o_proj.weight": normal(h, model.num_heads * d, std=1.0 / math.sqrt(model.num_heads * d)),
            p + "mlp.gate_proj.weight": normal(model.intermediate_size, h, std=1.0 / math.sqrt(h)),
            p + "mlp.up_proj.weight": normal(model.intermediate_size, h, std=1.0 / math.sqrt(h)),
            p + "mlp.down_proj.weight": normal(h, model.intermediate_size, std=1.0 / math.sqrt(model.intermediate_size)),
        })
    return weights


def _gemma2_config(model: TinyModel) -> dict:
    """Gemma 2: the scale is query_pre_attn_scalar ** -0.5 (the head size here, as Llama's), the soft cap on every
    layer, no final logit cap; every layer full (or every one windowed), not Gemma's alternation, so that the
    engine keeps one kind of KV cache."""
    kind = "full_attention" if model.sliding_window is None else "sliding_attention"
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **_sizes(model),
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": model.head_dim,
        "attn_logit_softcapping": model.soft_cap,
        "final_logit_softcapping": None,
        "sliding_window": model.sliding_window,
        "layer_types": [kind] * model.num_layers,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": model.dtype,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _gemma2_weights(model: TinyModel) -> dict[str, torch.Tensor]:
    """Scaled as the Llama's: Gemma multiplies the embedding by sqrt(hidden), so its entries are 1/sqrt(hidden);
    its norms scale by (1 + weight), so their weights are 0; the output head is the embedding (tied)."""
    gen = torch.Generator().manual_seed(model.seed)
    dtype = getattr(torch, model.dtype)
    h, d = model.hidden_size, model.head_dim

    def normal(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    proj = 2.0 / math.sqrt(h)  # logits q·k/sqrt(d) with a std of ~4, before the cap
    weights = {
        "model.embed_tokens.weight": normal(model.vocab_size, h, std=1.0 / math.sqrt(h)),
        "model.norm.weight": torch.zeros(h, dtype=dtype),
    }
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    down = 1.0 / math.sqrt(model.intermediate_size)
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        weights.update({p + f"{norm}.weight": torch.zeros(h, dtype=dtype) for norm in norms})
        weights.update({
            p + "self_attn.q_proj.weight": normal(model.num_heads * d, h, std=proj),
            p + "self_attn.k_proj.weight": normal(model.num_kv_heads * d, h, std=proj),
            p + "self_attn.v_proj.weight": normal(model.num_kv_heads * d, h, std=1.0 / math.sqrt(h)),
            p + "self_attn.o_proj.weight": normal(h, model.num_heads * d, std=1.0 / math.sqrt(model.num_heads * d)),
            p + "mlp.gate_proj.weight": normal(model.intermediate_size, h, std=1.0 / math.sqrt(h)),
            p + "mlp.up_proj.weight": normal(model.intermediate_size, h, std=1.0 / math.sqrt(h)),
            p + "mlp.down_proj.weight": normal(h, model.intermediate_size, std=down),
        })
    return weights


def write_model(model: TinyModel, directory: str) -> str:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (deterministic) and return it."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json(model), f, indent=2)
    save_file(random_weights(model), os.path.join(directory, "model.safetensors"))
    return directory
