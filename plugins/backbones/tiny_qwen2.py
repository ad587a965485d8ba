"""`tiny-qwen2`: a small randomly initialised Qwen2 decoder (q/k/v biases), for tests."""
from __future__ import annotations

from concept_plugins.backbones.tiny_llama import TinyConfig, TinyLlamaBackbone


class TinyQwen2Backbone(TinyLlamaBackbone):
    Config = TinyConfig
    architecture = "qwen2"

    @classmethod
    def hf_config(cls, config: TinyConfig):
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.intermediate,
            num_hidden_layers=config.layers, num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_positions,
            rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
        )
