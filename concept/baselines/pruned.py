"""The pruned family (``concept build --family pruned --set pruned.layers=START:STOP``; ``concept train RUN
--baseline pruned`` derives one FLOP-matched to RUN's model): the dense baseline (``concept.baselines.dense``)
with a contiguous block of decoder layers skipped. The skipped layers stay in the backbone (the distillation
teacher runs them); they are left out of the list the model runs (``concept.dense.DenseModel``'s ``removed``).

Its section, ``pruned`` (:class:`PrunedSettings`): the dense family's options plus ``layers`` (the block
``[START, STOP)`` it skips, required; null: none, it trains as the dense model), ``deleted`` (an export's backbone
lacks the block already: ``concept.export``) and ``matched`` (the FLOP match it was derived for:
``concept.baselines.derive``, recorded for people and ``concept inspect``).

Standard library only (module docstring of ``concept.baselines.dense``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConceptError
from ..train_config import parse_prune_layers
from .dense import Dense, DenseSettings, parse_settings


@dataclass
class PrunedSettings(DenseSettings):
    """The pruned family's section, validated."""

    layers: list | None = None
    deleted: list | None = None
    matched: dict | None = None


class Pruned(Dense):
    name = "pruned"
    section = "pruned"  # --set pruned.layers=START:STOP

    def settings(self, options: dict, components: dict):
        settings, problems = parse_settings(PrunedSettings, self.section, options)
        if "layers" not in options and "deleted" not in options:
            problems.append(f"{self.section}.layers: which layers to skip, START:STOP (0-based, STOP excluded), "
                            f"e.g. --set {self.section}.layers=8:20; or let `concept train RUN --baseline pruned` "
                            f"choose the block FLOP-matched to RUN's model")
        num_layers = _num_layers(components.get("backbone"))
        for key in ("layers", "deleted"):
            value = getattr(settings, key)
            if value is None:
                continue
            try:  # (a deleted block is checked against the backbone it was deleted from, not this one)
                block = parse_prune_layers(value, num_layers if key == "layers" else 0)
            except ValueError as exc:
                problems.append(f"{self.section}.{key} {value}: {exc}")
                continue
            setattr(settings, key, list(block))
        if settings.matched is not None and not isinstance(settings.matched, dict):
            problems.append(f"{self.section}.matched: the FLOP match it was derived for (an object), got "
                            f"{settings.matched!r}")
        return settings, problems

    def layers(self, settings) -> dict:
        """The block the model skips (``removed``), or the block already deleted from its backbone (an export)."""
        return {"removed": tuple(settings.layers) if settings.layers else None,
                "deleted": tuple(settings.deleted) if settings.deleted else None}

    def describe(self, model) -> str:
        block = model.removed or model.deleted
        if not block:
            return "the pruned baseline with no layer removed: the dense baseline"
        a, b = block
        return f"the pruned baseline: the backbone with layers {a}..{b - 1} skipped, with LoRA adapters"

    def inspect(self, model, request) -> dict:
        shown = super().inspect(model, request)
        matched = model.resolution.settings.matched
        if matched:
            shown["baseline"]["matched"] = matched
        return shown


def _num_layers(backbone) -> int:
    """The decoder layers of a resolved backbone (0: unknown, e.g. a backbone that cannot be described here)."""
    if backbone is None:
        return 0
    try:
        return int(backbone.cls.describe(backbone.config).num_layers)
    except ConceptError:  # (its own problem is reported by the resolution)
        return 0
