"""The dense family (``concept build --family dense``; ``concept train RUN --baseline dense`` derives one from
RUN's build): the backbone itself with LoRA adapters, plain next-token prediction, the yardstick every concept
model is measured against. Its model is ``concept.dense.DenseModel`` (``family``: ``dense``, or ``pruned`` when it
skips a block of layers); it decodes as the plain backbone with transformers' cache (:meth:`Dense.decoder`), and is
evaluated and scored by the core's causal forward (the ``Family`` defaults).

Its section, ``dense`` (``--set dense.KEY=VALUE``; :class:`DenseSettings`): ``mtp_heads`` (K MTP heads on the
last hidden state, for multi-token decoding), ``static`` (masks built without reading anything back to the host,
as the baseline of a static build) and ``baseline_of`` (the build it was derived from, for people and for the
checkpoints of runs written before the baselines were families: ``concept.migrate``).

Standard library only (the registry imports it for ``concept train --help``): each method imports what it needs
(torch) when it runs (``# lazy: torch``)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..contracts import Family, FlopTarget
from . import derive as derive_run


@dataclass
class DenseSettings:
    """The dense family's section, validated."""

    mtp_heads: int = 0
    static: bool = False
    baseline_of: dict | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


def parse_settings(cls, section: str, options: dict) -> tuple[object, list[str]]:
    """``options`` of the section ``section`` as ``cls`` (a settings dataclass): (settings, problems), the
    problems each naming ``section.KEY``."""
    known = [f.name for f in fields(cls)]
    problems = [f"{section}.{k}: unknown option (known: {', '.join(known)})" for k in options if k not in known]
    settings = cls(**{k: v for k, v in options.items() if k in known})
    heads = settings.mtp_heads
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        problems.append(f"{section}.mtp_heads: a count of MTP heads >= 0, got {heads!r}")
    if not isinstance(settings.static, bool):
        problems.append(f"{section}.static: true or false, got {settings.static!r}")
    if settings.baseline_of is not None and not isinstance(settings.baseline_of, dict):
        problems.append(f"{section}.baseline_of: the build config it was derived from (an object), got "
                        f"{settings.baseline_of!r}")
    return settings, problems


class Dense(Family):
    name = "dense"
    section = "dense"  # --set dense.mtp_heads=K
    decodes = ("concepts", "mtp")  # `concept generate --mtp` with its heads; --show-concepts says it has none

    def settings(self, options: dict, components: dict):
        return parse_settings(DenseSettings, self.section, options)

    def build(self, plan, loaded):
        # lazy: torch (module docstring)
        from ..dense import DenseModel

        s = plan.settings
        return DenseModel(loaded.model, resolution=plan, tokenizer=loaded.tokenizer, mtp_heads=s.mtp_heads,
                          static=s.static, **self.layers(s))

    def layers(self, settings) -> dict:
        """``DenseModel``'s layer arguments: none skipped (the pruned family skips a block)."""
        return {}

    def structure(self, plan) -> dict:
        return {self.section: plan.settings.to_dict()}

    def describe(self, model) -> str:
        return "the dense baseline: the backbone with LoRA adapters, plain next-token prediction"

    def inspect(self, model, request) -> dict:
        removed = model.removed or model.deleted
        return {"baseline": {"kind": self.name, "removed_layers": list(removed) if removed else None},
                "components": ["backbone"]}

    def derive(self, config, source: dict, plan):
        """The baseline of the run whose build is ``source`` (``concept train RUN --baseline``:
        ``concept.baselines.derive``)."""
        return derive_run(config, source, plan)

    def matched_flops(self, plan, config, shape) -> FlopTarget:
        """Its own forward FLOPs at ``config.seq_len`` (``--baseline pruned`` of a baseline run: the same block)."""
        # lazy: torch (module docstring)
        from ..flops import pruned_flops

        block = self.layers(plan.settings).get("removed") or (0, 0)
        total, T = plan.backbone_info.num_layers, config.seq_len
        kept = total - (block[1] - block[0])
        return FlopTarget(pruned_flops(shape, kept, T) / pruned_flops(shape, total, T), block[0], T,
                          f"the {self.name} model's own ({kept} of {total} layers)")

    def compile_refusal(self, model) -> str | None:
        """Its layers compile (``DenseModel`` runs them through ``compiled_stacks``; its masks static then)."""
        return None

    # -- decoding ------------------------------------------------------------------------------
    def decoder(self, model):
        """The backbone (its kept layers: ``DenseModel.generate``) over transformers' cache
        (``concept.decoding.DenseDecoder``); with MTP heads, keeping the last layer's state they draft from."""
        # lazy: torch (module docstring)
        from ..decoding import DenseDecoder

        return DenseDecoder(model.backbone, model.layers[-1] if model.mtp_heads is not None else None)

    def static_decoder(self, model, new_tokens: int, compile_choice: str | None):
        """``--compile``: its layers over one static KV cache, one compiled step
        (``concept.static_decoding.StaticDenseDecoder``)."""
        # lazy: torch (module docstring)
        from ..static_decoding import StaticDenseDecoder

        return StaticDenseDecoder(model, new_tokens, compile_choice)

    # -- training ------------------------------------------------------------------------------
    def check_training(self, config, plan, device, dist) -> list[str]:
        """What a run of it cannot do (a run derived with ``--baseline`` was checked as such already)."""
        if config.baseline:
            return []
        problems = []  # (--align: at the last layer's output, its only place: it has no deep stack)
        if config.train_only == "new" and not plan.settings.mtp_heads:
            problems.append(f"train-only new: a {self.name} model has no new modules (only LoRA adapters) unless it "
                            f"has MTP heads (--set {self.section}.mtp_heads=K); drop --train-only")
        return problems

    def objectives(self, config, model, step, notes: list) -> list:
        """The shared ones (distillation, alignment, its MTP heads'), noting what ``--distill`` means here."""
        # lazy: torch (module docstring)
        from ..objectives import common

        if self.name == "dense" and config.distill:
            notes.append("--distill with the dense baseline: the teacher is this model without its adapters, so the "
                         "KL starts at 0 and only keeps the adapters close to the backbone (a regulariser)")
        return common(config, has_mtp=model.mtp_heads is not None)
