"""A tiny Llama-style model directory (config.json + a random safetensors checkpoint) for the engine stage.

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def config_json(model: TinyModel) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
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


def write_model(model: TinyModel, directory: str) -> str:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (deterministic) and return it."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json(model), f, indent=2)
    save_file(random_weights(model), os.path.join(directory, "model.safetensors"))
    return directory
