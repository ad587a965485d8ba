"""A third model family, written the way a package outside this repository would write one: soft-prompt
tuning (Lester et al., 2021), ``length`` learned vectors read before every row. It imports only the
library's public core (registry objects, builder helpers, generation, losses) and registers through the
``concept.families`` entry-point group (``tests/test_third_family.py`` installs that entry point); no
file of the library names it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept import packing
from concept.contracts import Family
from concept.generation import GenerationMixin
from concept.losses import next_token_loss


@dataclass
class SoftPromptSettings:
    length: int = 4

    def to_dict(self) -> dict:
        return {"length": self.length}


@dataclass
class SoftPromptOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Prompt(nn.Module):
    def __init__(self, length: int, hidden: int, scale: float):
        super().__init__()
        self.vectors = nn.Parameter(torch.randn(length, hidden) * scale)


class SoftPromptModel(GenerationMixin, nn.Module):
    family = "soft-prompt"

    def __init__(self, backbone, resolution, tokenizer, length: int):
        super().__init__()
        self.backbone, self.resolution, self.tokenizer = backbone, resolution, tokenizer
        embedding = backbone.get_input_embeddings().weight
        self.prompt = Prompt(length, embedding.shape[1], float(embedding.std()))

    def inputs(self, input_ids, valid):
        """The prompt before each row's tokens: embeddings, attention mask and positions."""
        B, P = input_ids.shape[0], self.prompt.vectors.shape[0]
        x = torch.cat([self.prompt.vectors.expand(B, -1, -1).to(self.backbone.dtype),
                       self.backbone.get_input_embeddings()(input_ids)], dim=1)
        mask = torch.cat([valid.new_ones(B, P), valid], dim=1).long()
        positions = torch.cat([torch.arange(P, device=valid.device).expand(B, -1),
                               P + packing.time_positions(valid)], dim=1)
        return x, mask, positions

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None, **_):
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        x, mask, positions = self.inputs(input_ids, valid)
        logits = self.backbone(inputs_embeds=x, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, self.prompt.vectors.shape[0]:]
        loss = None if labels is None else next_token_loss(logits, labels, valid, document_ids)
        return SoftPromptOutput(logits, loss)

    def new_modules(self) -> dict[str, nn.Module]:
        return {"prompt": self.prompt}

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"prompt.{k}": v for k, v in self.prompt.state_dict().items()}


class SoftPrompt(Family):
    """The family (``concept.contracts.Family``): its name, section, settings and build, and what it says about
    itself; everything else (training objectives, evaluation, decoding by replaying its forward, ...) is the
    base's default, and no streaming key is read, written or shown for it (it has no ``build_section``)."""

    name = "soft-prompt"
    section = "soft_prompt"  # --set soft_prompt.length=8

    def settings(self, options, components):
        unknown = sorted(set(options) - {"length"})
        length = options.get("length", 4)
        problems = [f"soft_prompt.{k}: unknown option (known: length)" for k in unknown]
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            problems.append(f"soft_prompt.length: at least 1 vector, got {length!r}")
        return (None if problems else SoftPromptSettings(length)), problems

    def build(self, plan, loaded):
        return SoftPromptModel(loaded.model, plan, loaded.tokenizer, plan.settings.length)

    def describe(self, model):
        return f"the backbone read after {model.prompt.vectors.shape[0]} learned prompt vectors"

    def inspect(self, model, request):
        vectors = model.prompt.vectors
        return {"soft prompt": {"vectors": vectors.shape[0], "mean norm": f"{float(vectors.detach().norm(dim=-1).mean()):.3f}"}}

    def check_training(self, config, plan, device, dist):
        return ["align: a soft prompt has no deep stack to align; drop it"] if config.align else []

    def step_diagnostics(self, model, out, batch):
        return {"prompt_norm": float(model.prompt.vectors.norm(dim=-1).mean())}
