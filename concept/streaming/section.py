"""The streaming family's section of a build config (``BuildConfig.sections["streaming"]``; ``Family.build_section``):
its component slots (length policy, samplers, position scheme, vocabulary, attention, tail fusion), the split of
the backbone's layers, what a concept feeds the middle stack and the static budget. Each field is an option
(``concept.options``): ``concept build --length-policy NAME --split 4,22,4 --max-ratio 0.25``, listed under the
family in ``--help``; in ``concept.json`` and a recipe the fields sit under ``streaming:``.

Standard library only (``concept build --help`` makes its flags from it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import (
    ComponentRef,
    component_ref,
    parse_value,
    slot,
    _unknown_msg,
)
from ..options import option
from .operating_point import MAX_RATIO_AUTO, max_ratio_problem, parse_max_ratio, parse_split

CONCEPT_INPUTS = ("identity", "identity-scaled", "embedding")


@dataclass
class StreamingSection:
    """The streaming family's build options; the planner-executor family reads the same section (its vocabulary,
    samplers, position scheme and split)."""

    name = "streaming"  # its key in a build config
    options_title = "streaming family"  # their --help sections (concept.options.group_of)
    option_groups = {"streaming family: components": ("length_policy", "sampler", "eval_sampler", "position_scheme",
                                                      "vocabulary", "attention", "tail_fusion")}
    kinds = {"eval_sampler": "sampler"}  # a slot's plugin kind, where it is not the slot's name

    # "auto" (2/15 shallow, 4/15 deep: 4,18,8 on 30), counts "4,22,4" (shallow, middle, deep) or fractions
    split: str = option("auto", metavar="TEXT", help="Layers per stack: 'auto' (2/15 shallow, 4/15 deep: 4,18,8 on "
                                                     "30 layers), counts '4,22,4' or fractions '0.15,0.7,0.15'.")
    length_policy: ComponentRef = slot("null", help="Length policy plugin")
    sampler: ComponentRef = slot("gumbel-st", help="Training sampler plugin")
    eval_sampler: ComponentRef = slot("argmax", help="Inference sampler plugin")
    position_scheme: ComponentRef = slot("time", help="Position scheme plugin", flag="--rope",
                                         aliases=("--position-scheme",))
    vocabulary: ComponentRef = slot("embedding", help="Concept vocabulary plugin")
    attention: ComponentRef = slot("chunked", help="Deep-stack attention backend")
    tail_fusion: ComponentRef = slot("none", help="What tail tokens take from their latest concept: none, update, "
                                                  "bridge")
    # what a concept feeds the middle stack: "identity" = the emitting token's shallow state plus the
    # discrete concept embedding behind a gate that starts at 0 (keep-all == the backbone exactly);
    # "identity-scaled" = the same with the gate in units of the shallow state's RMS; "embedding" = the
    # discrete concept embedding alone
    concept_input: str = option("identity", choices=CONCEPT_INPUTS,
                                help="Concept input: the emitting token's shallow state + a gated embedding "
                                     "(identity), the same with the gate in units of the shallow state "
                                     "(identity-scaled), or the discrete embedding alone (embedding).")
    # the static concept budget (concept.packing.budget): a number, "auto" (derived from the length policy:
    # concept.streaming.budget) or "none" / 0 = off (layout widths follow the batch)
    max_ratio: float | str = option(
        MAX_RATIO_AUTO, metavar="R|auto|none",
        help="Streaming: static shapes. A row's first n real tokens emit at most ceil(max_ratio * n) boundaries "
             "(the model drops those over it), so the packed layout has ceil(max_ratio * T) concept slots per row "
             "whatever the decisions (no host sync, one compiled graph). auto: 1.25 times the length policy's "
             "target ratio plus 6 boundaries of slack per row for a policy whose per-document tracker holds each "
             "row near it (0.15625 at the default 0.125: null, mtp), twice it plus 4 for one without a tracker "
             "(threshold), a fixed policy's own rate 1 / every; none or 0: off, widths follow the batch.")

    def __post_init__(self):
        # a component named by a string (``length_policy="fixed"``) is that component with its defaults
        for name in self.slots():
            if isinstance(getattr(self, name), str):
                setattr(self, name, ComponentRef(getattr(self, name)))

    @classmethod
    def slots(cls) -> dict[str, str]:
        """Component slot -> its plugin kind (``concept.registry.KINDS``)."""
        return {f.name: cls.kinds.get(f.name, f.name) for f in dataclasses.fields(cls) if f.type in ("ComponentRef",
                                                                                                      ComponentRef)}

    # -- JSON and overrides -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> tuple["StreamingSection | None", list[str]]:
        """The section from its JSON object, or (None, problems)."""
        fields, slots = [f.name for f in dataclasses.fields(cls)], cls.slots()
        problems = [_unknown_msg(f"key in the {cls.name} section:", k, fields) for k in data if k not in fields]
        kwargs = {}
        for key, value in data.items():
            if key in slots:
                value, problem = component_ref(key, value)
                if problem:
                    problems.append(problem)
                    continue
            if key in fields:
                kwargs[key] = value
        return (None, problems) if problems else (cls(**kwargs), [])

    def override(self, path: str, raw: str) -> str | None:
        """Apply one ``--set`` item (``sampler.tau=0.7``, ``length_policy=fixed``, ``split=2,2,2``); a problem, or
        None where it applied; ``"unknown"`` where this section has no such key."""
        head, _, key = path.partition(".")
        slots = self.slots()
        if key:
            if head not in slots:
                return "unknown"
            getattr(self, head).params[key] = parse_value(raw)
        elif path in slots:
            setattr(self, path, ComponentRef(str(parse_value(raw))))
        elif path == "max_ratio":
            self.max_ratio = parse_max_ratio(raw)
        elif path in ("split", "concept_input"):
            setattr(self, path, str(raw))
        else:
            return "unknown"
        return None

    # -- resolution -----------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What is wrong with its plain options (the components are checked when they are looked up)."""
        found = []
        if self.concept_input not in CONCEPT_INPUTS:
            found.append(_unknown_msg("concept_input", str(self.concept_input), list(CONCEPT_INPUTS)))
        if max_ratio_problem(self.max_ratio):
            found.append(max_ratio_problem(self.max_ratio))
        return found

    def layers(self, num_layers: int) -> tuple[tuple[int, int, int] | None, list[str]]:
        """The split in layer counts (shallow, middle, deep) of a backbone of ``num_layers``."""
        return parse_split(self.split, num_layers)
