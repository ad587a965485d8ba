"""The baselines a concept model is measured against (``concept train --baseline dense|pruned``): the
backbone with LoRA adapters, whole (dense) or minus a contiguous block of middle layers FLOP-matched to
the concept model (pruned). A baseline is trained like a family's model; :class:`Baseline` is what the
trainer asks about it, as it asks a family (``concept.components.Family``).
"""
from __future__ import annotations

from . import objectives
from .builder import build_backbone
from .dense import DenseModel
from .flops import Shape, matched_prune
from .train_config import foreign_options, parse_prune_layers  # noqa: F401 (parse_prune_layers: API)


class Baseline:
    """What trains with ``--baseline NAME``: checks, the model, its objectives and its notes."""

    family = None  # not a family's model

    def __init__(self, name: str):
        self.name = name
        self.prune = None  # the pruned baseline's layer block, once the model is made

    @property
    def what(self) -> str:
        return f"a {self.name} baseline"

    def check_training(self, config, plan, device, dist) -> list[str]:
        if self.name == "pruned" and config.prune_layers is None and not plan.family_object.stacks:
            return [f"baseline pruned: its default block is FLOP-matched to a streaming model's split and concept "
                    f"ratio, which a {plan.family} run does not have; choose the block with --prune-layers "
                    f"START:STOP, or use --baseline dense"]
        return []

    def notes(self, config) -> list[str]:
        found = []
        if self.name == "dense" and config.distill:
            found.append("--distill with the dense baseline: the teacher is this model without its adapters, so the "
                         "KL starts at 0 and only keeps the adapters close to the backbone (a regulariser)")
        read = {"align-at"} | ({"target-ratio"} if self.name == "pruned" else set())  # (its block is matched at it)
        unread = [f"--{flag}" for flag, _, _ in foreign_options(config) if flag not in read]
        if unread:
            found.append(f"a {self.name} baseline has no concepts: {' / '.join(unread)} do"
                         f"{'es' * (len(unread) == 1)} nothing")
        return found

    def training_model(self, plan, config, out, resume: bool, notes: list):
        loaded = build_backbone(plan)
        if self.name == "pruned":
            self.prune = prune_plan(config, plan, loaded.model.config)
            notes.append(describe_prune(self.prune, plan.split, by_hand=config.prune_layers is not None))
        removed = self.prune.removed if self.prune and self.prune.kept < self.prune.num_layers else None
        return DenseModel(loaded.model, resolution=plan, tokenizer=loaded.tokenizer, removed=removed,
                          mtp_heads=config.mtp_heads)

    def derived(self, config, plan) -> dict:
        """What train.json records beside the config: which layers the pruned baseline skips (``concept.load``)."""
        if self.prune is None:
            return {}
        return {"pruned": {**self.prune.to_dict(), "note": describe_prune(self.prune, plan.split,
                                                                         config.prune_layers is not None)}}

    def objectives(self, config, model, step, notes: list) -> list:
        return objectives.common(config, has_mtp=getattr(model, "mtp_heads", None) is not None,
                                 align_at=getattr(config, "align_at", "final"))  # (a streaming run's option)

    def plots(self, name: str, rows: list[dict], out) -> None:
        pass

    def step_diagnostics(self, model, out, batch) -> dict[str, float]:
        return {}


def prune_plan(config, plan, hf_config):
    """The pruned baseline's layer block (``concept.flops.matched_prune``): FLOP-matched to the
    streaming model of this build plan at ``config.target_ratio`` and ``config.seq_len``."""
    vocabulary = plan.components["vocabulary"]
    policy = plan.components["length_policy"]
    classes = int(getattr(vocabulary.config, "size", 0)) + int(policy.cls.uses_null_class)
    emit = int(getattr(policy.config, "emit", 1) or 1)
    removed = parse_prune_layers(config.prune_layers, plan.backbone_info.num_layers) if config.prune_layers else None
    return matched_prune(Shape.from_hf_config(hf_config), tuple(plan.split), classes, config.target_ratio,
                         config.seq_len, emit, removed)


def describe_prune(prune, split, by_hand: bool = False) -> str:
    """One line for the user (and train.json's reader): what was removed and which FLOPs that gives."""
    a, b = prune.removed
    block = (f"layers {a}..{b - 1} removed ({b - a} of {prune.num_layers}, {prune.kept} kept" if b > a else
             f"no layer removed (all {prune.num_layers} kept: it trains as the dense model")
    text = (f"pruned baseline: {block}{', set by --prune-layers' if by_hand else ''}), forward FLOPs {prune.flop_ratio:.3f}x dense at T={prune.T}; "
            f"the streaming model's ideal at target ratio {prune.target_ratio} (split {','.join(map(str, split))}) "
            f"is {prune.target_flop_ratio:.3f}x")
    if not prune.met and not by_hand:
        text += (f". Whole layers cannot reach that target (one layer is {prune.layer_share:.3f}x dense, the "
                 f"embedding and LM head cost the rest): it used the closest, {prune.kept} kept "
                 f"layer{'s' * (prune.kept != 1)}")
    return text


