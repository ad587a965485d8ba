"""The dense baseline: the backbone itself (plus LoRA when training), plain next-token CE.

It runs the backbone's layers through the same attention routing and masks as the concept
model's shallow stack (causal, padding, packed documents), so the two are compared on
exactly the same inputs. Its logits equal the Hugging Face forward (tested).

The model of the ``dense`` and ``pruned`` families (``concept.baselines``). The **pruned** baseline is the same
model with a contiguous block of decoder layers skipped (``removed=(start, stop)``): the FLOP-matched yardstick of
the streaming model (``concept train --baseline pruned``; ``concept.baselines.prune_plan`` picks the block). The
skipped layers stay in the backbone (the distillation teacher runs them), they are only left
out of the list this model runs.

With ``mtp_heads=K`` (``concept train --baseline dense --mtp-heads K``, or ``--set dense.mtp_heads=K``) the model carries K MTP heads
(``concept.mtp``) on its final hidden state (before the norm: the state its own LM head reads), for
multi-token decoding (``generate(..., mtp="verify")``), trained by the same self-distillation.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass

import torch
from torch import nn

from . import packing
from .attention import CausalPattern
from .backbone import decoder, run_layers
from .generation import generate
from .hub import HubMixin
from .lazy import Deferred, LazyField
from .losses import head_next_token_loss
from .mtp import MTPHeads
from .resolved import Resolved


@dataclass
class DenseOutput:
    logits: torch.Tensor = LazyField()  # computed when first read (concept.lazy)
    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # [B, T, d] the last layer's output (before the final norm)


class DenseModel(Resolved, HubMixin, nn.Module):
    def __init__(self, backbone, resolution=None, tokenizer=None, removed: tuple[int, int] | None = None,
                 mtp_heads: int = 0, deleted: tuple[int, int] | None = None, static: bool | None = None):
        super().__init__()
        self.backbone = backbone
        self.resolution = resolution  # the build resolution (concept.resolved)
        self.tokenizer = tokenizer
        self.gradient_checkpointing = False
        self.compiled_stacks = None  # --compile (concept.compiled): its layers compiled
        # the baseline of a static build (its family's section says so; made by hand from another family's
        # resolution: that family's ``static_shapes``), or compiled: masks built without reading anything back
        self.static = static if static is not None else _static_shapes(resolution)
        n = len(decoder(backbone).layers)
        if removed is not None and not (0 <= removed[0] < removed[1] <= n):
            raise ValueError(f"removed layers {removed} are not a block of the backbone's {n} layers")
        self.removed = tuple(removed) if removed is not None else None
        # a pruned baseline whose skipped block is already deleted from its backbone (a `concept export` of one):
        # it runs every layer the backbone has
        self.deleted = tuple(deleted) if deleted is not None else None
        self.backbone_pruned = False  # inside ``pruned_backbone``: the backbone holds the kept layers alone
        self.mtp_heads = None
        if mtp_heads:
            self.mtp_heads = MTPHeads(backbone.config.hidden_size, mtp_heads)
            self.mtp_heads.bind(lambda h: self.backbone.lm_head(decoder(self.backbone).norm(h)))

    @property
    def family(self) -> str:
        """Its family's name (``concept.families``), as every built model carries it: ``pruned`` when a block of
        layers is skipped (or already deleted from its backbone), else ``dense``."""
        return "pruned" if self.removed or self.deleted else "dense"

    @property
    def layers(self) -> list[nn.Module]:
        """The decoder layers this model runs (all of them, or all but the removed block)."""
        layers = list(decoder(self.backbone).layers)
        if self.removed and not self.backbone_pruned:
            start, stop = self.removed
            return layers[:start] + layers[stop:]
        return layers

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None, **_) -> DenseOutput:
        inner = decoder(self.backbone)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = packing.time_positions(valid, document_ids)
        run = run_layers if self.compiled_stacks is None else partial(self.compiled_stacks, "layers")
        # static: nothing read back to the host (a mask unless plain causal attention is known to be exact)
        causal = True if attention_mask is None and document_ids is None else (
            False if self.static or self.compiled_stacks is not None else None)
        x = run(self.layers, inner.embed_tokens(input_ids), pos, CausalPattern(valid, document_ids, causal),
                inner.rotary_emb, self.gradient_checkpointing and self.training)
        states, head = inner.norm(x), self.backbone.lm_head
        loss = None if labels is None else head_next_token_loss(states, head, labels, valid, document_ids,
                                                               self.compiled_stacks)
        return DenseOutput(Deferred(head, states, watch=head), loss, x)

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Generate with transformers' DynamicCache; see :func:`concept.generation.generate`."""
        with self.pruned_backbone():
            return generate(self, input_ids, attention_mask, **kwargs)

    @contextmanager
    def pruned_backbone(self):
        """While inside, the backbone's own forward (used by cached decoding) runs only the kept layers,
        numbered 0..n-1 (``layer_idx``, the KV cache's slot) as in a backbone built with n layers."""
        if not self.removed:
            yield self.backbone
            return
        inner, config = decoder(self.backbone), self.backbone.config
        layers, n, kept = inner.layers, config.num_hidden_layers, self.layers
        numbered = [(m, m.layer_idx, i) for i, layer in enumerate(kept) for m in layer.modules()
                    if isinstance(getattr(m, "layer_idx", None), int)]
        inner.layers = nn.ModuleList(kept)
        config.num_hidden_layers = len(inner.layers)
        self.backbone_pruned = True  # (``layers``: the block is out of the backbone's list already)
        try:
            for m, _, i in numbered:
                m.layer_idx = i
            yield self.backbone
        finally:
            for m, old, _ in numbered:
                m.layer_idx = old
            inner.layers = layers
            config.num_hidden_layers = n
            self.backbone_pruned = False

    @staticmethod
    def mtp_state(out: DenseOutput) -> torch.Tensor:
        """The states the MTP heads read: the last layer's output."""
        return out.hidden

    def new_modules(self) -> dict[str, nn.Module]:
        return {"mtp_heads": self.mtp_heads} if self.mtp_heads is not None else {}

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, m in self.new_modules().items() for k, v in m.state_dict().items()}


def _static_shapes(resolution) -> bool:
    """Whether the family of ``resolution`` (a build resolution, or None) shapes its tensors statically."""
    family = getattr(resolution, "family_object", None)
    return bool(family is not None and family.static_shapes(resolution))
