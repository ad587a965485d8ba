"""The baselines a concept model is measured against, as two families (``concept.families`` entry points):
``dense`` (the backbone with LoRA adapters: :mod:`concept.baselines.dense`) and ``pruned`` (minus a contiguous
block of layers: :mod:`concept.baselines.pruned`). Their model is ``concept.dense.DenseModel``.

``concept train RUN --baseline dense|pruned`` trains a run of that family whose build :func:`derive` makes from
RUN's: the same backbone and seed (the same data: the training options), and for ``pruned`` the block whose
forward FLOPs match RUN's model at ``--seq-len`` (:func:`prune_plan`: what to match is the source family's
``Family.matched_flops``, e.g. the streaming model's ideal FLOPs at its target ratio), or ``--prune-layers``.

Standard library only at import (its family modules are imported by ``concept train --help``)."""
from __future__ import annotations

import dataclasses

from ..config import BuildConfig
from ..errors import ConfigError
from ..families import family

from ..train_config import BASELINES as NAMES, REQUEST, for_family, foreign_options, parse_prune_layers  # noqa: F401


def derive(config, source: dict, plan) -> tuple[object, object, list[str]]:
    """The build of the baseline ``config.baseline`` (a ``BuildConfig`` of the family of that name) derived from
    the source run's build config ``source`` resolved as ``plan``, the training config it trains with
    (:func:`without_foreign`) and notes for the user (the pruned block, the options that do nothing).
    Its section records ``mtp_heads``, the block and the FLOP match, ``static`` (the baseline of a build with a
    static concept budget builds its masks without reading anything back), and the source build
    (``baseline_of``). A pruned baseline of a family without an operating point to match
    (``Family.matched_flops`` None) and no ``--prune-layers``: a ``ConfigError`` naming the fix."""

    name = config.baseline
    section: dict = {"mtp_heads": config.mtp_heads} if config.mtp_heads else {}
    if plan.family_object.static_shapes(plan):
        section["static"] = True
    notes = []
    if name == "pruned":
        prune, about = prune_plan(config, plan)
        note = describe_prune(prune, about, by_hand=config.prune_layers is not None)
        section["layers"] = list(prune.removed) if prune.kept < prune.num_layers else None
        section["matched"] = {**prune.to_dict(), "about": about, "note": note}
        notes.append(note)
    section["baseline_of"] = source
    build = BuildConfig.from_dict({"family": name, "backbone": source["backbone"], "seed": source.get("seed", 0),
                                   name: section})
    config, unread = without_foreign(config, build.family)
    return build, config, notes + unread


# read by the source family to choose the match (``Family.matched_flops``), never read by a baseline, or read the
# one way a baseline can (``--align-at final``: it has no deep stack): no note
MATCH_OPTIONS = ("target-ratio", "tau-start", "tau-end", "align-at")


def without_foreign(config, name: str) -> tuple[object, list[str]]:
    """``config`` as the training config of a run of the family ``name`` (``concept.train_config.for_family``:
    the core's options and that family's), and a note naming the options only another family reads that were
    set (``concept.train_config.foreign_options``: a baseline has no concepts, they do nothing; the source
    family's ratio only chose the match)."""
    found = foreign_options(config, family(name))
    own = for_family(name)
    config = own(**{f.name: getattr(config, f.name) for f in dataclasses.fields(own) if hasattr(config, f.name)})
    unread = [f"--{flag}" for flag, _, _ in found if flag not in MATCH_OPTIONS]
    if not unread:
        return config, []
    return config, [f"a {name} baseline has no concepts: {' / '.join(unread)} do{'es' * (len(unread) == 1)} nothing"]


def prune_plan(config, plan, hf_config=None):
    """The pruned baseline's layer block for a run of the resolved build ``plan`` trained with ``config``
    (``concept.flops.prune_block``) and a phrase naming what it matches (None: set by hand, nothing to match):
    FLOP-matched to what the plan's family gives at ``config.seq_len`` (``Family.matched_flops``), or
    ``config.prune_layers``. ``hf_config``: the backbone's Hugging Face config, if at hand (else read from the
    backbone plugin, or the backbone loaded)."""
    # lazy: torch
    from ..flops import Shape, prune_block

    num_layers = plan.backbone_info.num_layers
    removed = parse_prune_layers(config.prune_layers, num_layers) if config.prune_layers else None
    shape = Shape.from_hf_config(hf_config if hf_config is not None else _hf_config(plan))
    target = plan.family_object.matched_flops(plan, config, shape)
    if target is None and removed is None:
        raise ConfigError([f"baseline pruned: its default block is FLOP-matched to the source model's compute, and a "
                           f"{plan.family} run has no operating point to match; choose the block with --prune-layers "
                           f"START:STOP, or use --baseline dense"])
    if target is None:
        prune = prune_block(shape, num_layers, config.seq_len, 0.0, 0, removed)
        prune.target_flop_ratio = prune.flop_ratio  # (nothing to match: the block's own)
        return prune, None
    return prune_block(shape, num_layers, target.seq_len, target.flop_ratio, target.first_layer, removed,
                       target.target_ratio), target.about


def _hf_config(plan):
    """The backbone's Hugging Face config (for FLOP counts): from the plugin without weights when it can."""
    bb = plan.components["backbone"]
    make = getattr(bb.cls, "hf_config", None)
    if callable(make):
        return make(bb.config)
    # lazy: torch
    from ..builder import build_backbone

    return build_backbone(plan).model.config


def describe_prune(prune, about: str | None, by_hand: bool = False) -> str:
    """One line for the user (and concept.json's reader): what was removed and which FLOPs that gives, next to
    ``about``, what it matches."""
    a, b = prune.removed
    block = (f"layers {a}..{b - 1} removed ({b - a} of {prune.num_layers}, {prune.kept} kept" if b > a else
             f"no layer removed (all {prune.num_layers} kept: it trains as the dense model")
    text = (f"pruned baseline: {block}{', set by --prune-layers' if by_hand else ''}), forward FLOPs "
            f"{prune.flop_ratio:.3f}x dense at T={prune.T}")
    if about is not None:
        text += f"; {about} is {prune.target_flop_ratio:.3f}x"
    if about is not None and not prune.met and not by_hand:
        text += (f". Whole layers cannot reach that target (one layer is {prune.layer_share:.3f}x dense, the "
                 f"embedding and LM head cost the rest): it used the closest, {prune.kept} kept "
                 f"layer{'s' * (prune.kept != 1)}")
    return text
