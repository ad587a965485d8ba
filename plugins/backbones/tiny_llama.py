"""`tiny-llama`: a small randomly initialised Llama decoder, for tests and quick experiments."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from concept.backbone import BackboneInfo, LoadedBackbone, info_from_hf_config
from concept.contracts import Backbone
from concept.options import SEED_MAX


@dataclass
class TinyConfig:
    layers: int = 8
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 256
    max_positions: int = 4096
    seed: int = 0

    def validate(self) -> list[str]:
        problems = [f"{k}: must be >= 1, got {getattr(self, k)}" for k in
                    ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions")
                    if getattr(self, k) < 1]
        if not 0 <= self.seed <= SEED_MAX:
            problems.append(f"seed: must be in [0, {SEED_MAX}] (a 64-bit seed), got {self.seed}")
        if not problems and self.hidden % self.heads:
            problems.append(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if not problems and self.heads % self.kv_heads:
            problems.append(f"kv_heads: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if not problems and (self.hidden // self.heads) % 2:
            problems.append(f"hidden/heads must be even for RoPE, got {self.hidden // self.heads}")
        return problems


class TinyLlamaBackbone(Backbone):
    Config = TinyConfig
    architecture = "llama"

    @classmethod
    def hf_config(cls, config: TinyConfig):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.intermediate,
            num_hidden_layers=config.layers, num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_positions,
            rope_theta=10000.0, tie_word_embeddings=False,
        )

    @classmethod
    def provenance(cls, config: TinyConfig) -> dict:
        """Randomly initialised here: no base model; the weights are concept's (Apache-2.0)."""
        return {"base_model": None, "license": "apache-2.0"}

    @classmethod
    def describe(cls, config: TinyConfig) -> BackboneInfo:
        return info_from_hf_config(cls.hf_config(config), f"{cls.architecture}-tiny", pretrained=False)

    @classmethod
    def load(cls, config: TinyConfig) -> LoadedBackbone:
        from transformers import AutoModelForCausalLM

        hf_cfg = cls.hf_config(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        return LoadedBackbone(model=model.eval(), tokenizer=None, info=cls.describe(config))
