"""`soft`: the concept input is the probability-weighted mixture of concept embeddings, with no
hard step: ``e = probs @ E`` with ``probs = softmax(logits / tau)``. Gradients reach every
concept embedding in proportion to its probability. The concept *id* reported (diagnostics,
``concept_ids``) is the most probable one, but the input is the mixture.

Train and evaluate with it (``--sampler soft --eval-sampler soft``): with the default
``argmax`` eval sampler the model would see hard embeddings at inference that it never saw
in training.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.components import upcast
from concept.contracts import Sampler, Tempered


@dataclass
class SoftConfig:
    tau: float = 1.0  # temperature of the mixture weights

    def validate(self) -> list[str]:
        return [] if self.tau > 0 else [f"tau: temperature must be > 0, got {self.tau}"]


class SoftSampler(Sampler, Tempered, nn.Module):
    Config = SoftConfig
    straight_through = False
    hard = False  # the concept input is the mixture itself

    def __init__(self, config: SoftConfig, ctx=None):
        super().__init__()
        self.config = config
        self.init_temperature(config.tau)

    @staticmethod
    def check_compatible(config, components) -> list[str]:
        train, evaluation = components.get("sampler"), components.get("eval_sampler")
        if train is not None and evaluation is not None and train.name == "soft" and evaluation.name != "soft":
            return [f"a model trained on soft mixtures would see hard {evaluation.name!r} embeddings at inference, "
                    f"inputs it never saw; use --eval-sampler soft"]
        return []

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(upcast(logits) / self.temperature, dim=-1).to(logits.dtype)
