"""The streaming family (docs/architecture.md, §0 "Code map"; docs/plugins.md, §1 "Kinds and
entry-point groups"): one pass over the text, the backbone split into shallow / middle / deep
stacks, a concept emitted where the length policy decides (``concept.streaming.model``).

This module stays free of torch: the torch-free ``TrainConfig`` (``concept.train_config``) and the CLI
(``concept train --help``, ``concept inspect``'s drawings) load the family object through its entry point.
So each method imports the modules it needs (which import torch) when it runs (``# lazy: torch``)."""
from __future__ import annotations

from ..contracts import DifferentiableBoundary, Family, FlopTarget, RatioControlled, TracksRatio
from .options import StreamingBuild, StreamingTraining
from .section import StreamingSection
from .operating_point import has_budget


class Streaming(Family):
    name = "streaming"
    build_section = StreamingSection  # its components, split, concept input and budget (--length-policy, ...)
    defaults: dict[str, str] = {}
    checks_components = True  # the components' compatibility vetoes describe this family's forward
    stacks = True  # shallow / middle / deep stacks and a concept ratio
    decodes = ("concepts", "mtp")  # what `concept generate` shows of its decoding
    training = StreamingTraining  # the training options only this family reads
    build_options = StreamingBuild  # the `concept build` options only this family reads (calibration)

    # -- building ------------------------------------------------------------------------------
    def build(self, plan, loaded):
        # lazy: torch (module docstring)
        from ..builder import build_components
        from .model import ConceptModel

        return ConceptModel(loaded.model, plan.split, resolution=plan, tokenizer=loaded.tokenizer,
                            identity_start=plan.config.concept_input in ("identity", "identity-scaled"),
                            relative_gate=plan.config.concept_input == "identity-scaled", **build_components(plan, loaded))

    def finish_build(self, model, options: StreamingBuild, given: set, say) -> dict:
        """Calibrate the fresh model's NULL bias for ``options.target_ratio`` (``concept.streaming.calibration``;
        ``--no-calibrate``: not). A policy without such a bias is left alone; unreadable default data only
        skips the calibration. ``given``: the options the user set; ``say(label, text)``: status for people.
        Returns ``{"calibration": what was done, or None}``."""
        # lazy: torch (module docstring)
        from ..errors import ConceptError
        from .calibration import DEFAULT_BATCH, DEFAULT_SEQ_LEN, calibratable, calibrate

        if options.no_calibrate:
            return {"calibration": None}
        if not calibratable(model):
            if given:
                say("note:", f"length policy {model.resolution.config.length_policy.name} sets its ratio by its own "
                             f"parameters; {', '.join('--' + k.replace('_', '-') for k in sorted(given))} does nothing")
            return {"calibration": None}
        target, data, batches = options.target_ratio, options.calibration_data, options.calibration_batches
        say("calibrating", f"NULL bias for {target:g} concepts per token on {batches} x {DEFAULT_BATCH} x "
                           f"{DEFAULT_SEQ_LEN} tokens of {data or 'the Python standard library'} ...")
        try:
            result = calibrate(model, target, data, batches)
        except ConceptError as exc:
            if "calibration_data" in given:
                raise
            say("note:", f"not calibrated ({exc}); the NULL bias stays 0 (pass --calibration-data, or --no-calibrate)")
            return {"calibration": None}
        say("calibrated", f"NULL bias {result['null_bias']:+.4f}: {result['ratio']:.4f} concepts per token on "
                          f"{result['tokens']:,} tokens (target {target:g})")
        if abs(result["ratio"] - target) > 0.05 * target:
            say("note:", f"the length policy cannot reach {target:g} concepts per token with these settings "
                         f"(it reached {result['ratio']:.4f})")
        return {"calibration": result}

    def structure(self, plan) -> dict:
        """Its stacks (what ``concept build`` shows)."""
        return {"stacks": stack_layers(plan.split)}

    def describe(self, model) -> str:
        comps, info = model.resolution.components, model.resolution.backbone_info
        shallow, middle, deep = model.resolution.split
        return (f"a streaming concept model: the backbone's {info.num_layers} layers split {shallow}/{middle}/{deep} "
                f"(shallow / middle / deep), length policy `{comps['length_policy'].name}`, vocabulary "
                f"`{comps['vocabulary'].name}`, position scheme `{comps['position_scheme'].name}`, attention "
                f"`{comps['attention'].name}`, tail fusion `{comps['tail_fusion'].name}`")

    def inspect(self, model, request) -> dict:
        """Its stacks, the NULL bias and where it comes from (``calibration``), and the ideal FLOPs at
        ``request.ratio`` concepts per token and ``request.seq_len`` tokens: of the decisions, and (``static``)
        of the widths its static layout computes."""
        # lazy: torch (module docstring)
        from ..flops import ideal_ratio

        flops = ideal_ratio(model, request.ratio, request.seq_len)
        static = static_widths_ideal(model, request.ratio, request.seq_len)
        return {"stacks": stack_layers(model.split),
                "calibration": ratio_calibration(model, request.record, request.train),
                "flops": {"concepts_per_token": request.ratio, **flops.to_dict(), "emit": model.emit,
                          **({"static": static} if static else {})}}

    # -- training ------------------------------------------------------------------------------
    def check_training(self, config, plan, device, dist) -> list[str]:
        problems = []
        attention = plan.components["attention"]
        reason = attention.cls.check_trainable(device)  # e.g. `flex` has no backward on CPU
        if reason:
            problems.append(f"attention '{attention.name}' cannot train on {device}: {reason}")
        policy = plan.components["length_policy"]
        if config.placement and not policy.cls.learned_placement:
            problems.append(f"placement: length policy '{policy.name}' has no per-token keep score that --placement "
                            f"could train (it decides by its own rule); build with --length-policy null, or drop "
                            f"--placement")
        if dist is not None and dist.mode == "fsdp2":
            # lazy: torch (module docstring)
            from ..codes import fsdp2_problems

            problems += fsdp2_problems(config.kmeans_init, config.revive_after)
        return problems

    def prepare(self, model, train: dict) -> None:
        pass

    def objectives(self, config, model, step, notes: list) -> list:
        """The sampler's temperature schedule and the ratio controller, then the loss terms in a fixed order: ratio
        loss, usage, the shared ones (distillation, alignment, MTP heads), the anti-collapse controllers,
        placement. They aim at the ratio curriculum's target of the step about to be trained (``step()``)."""
        # lazy: torch (module docstring)
        from .. import codes
        from ..objectives import common
        from .objectives import (
            PlacementObjective,
            RatioControl,
            RatioObjective,
            UsageObjective,
        )
        from .ratio import PIController, ratio_controllable, scheduled_ratio

        def target() -> float:
            return scheduled_ratio(step(), config.steps, config.target_ratio, config.ratio_start, config.ratio_warmup)

        controls, policy = config.ratio_control, model.length_policy
        if controls != "none" and not ratio_controllable(policy):
            notes.append(f"length policy {type(policy).__name__} sets its ratio by its own parameters; "
                         f"--ratio-control {controls} does nothing for it")
            controls = "none"
        if controls in ("loss", "both") and not isinstance(policy, DifferentiableBoundary):
            controls = "pi"
        # the controller calibrates the NULL bias at step 0 unless --ratio-control none; it tracks with pi / both
        pi = PIController(config.target_ratio, ki=config.pi_ki) if controls != "none" else None
        found: list = codes.temperature_schedule(model.sampler, config, step)
        found.append(RatioControl(target, config.target_ratio, pi, controls in ("pi", "both"), config.calibration_batches))
        if controls in ("loss", "both"):
            found.append(RatioObjective(config.ratio_loss_weight, target))
        if config.usage_weight:
            found.append(UsageObjective(config.usage_weight))
        found += common(config, has_mtp=getattr(model, "mtp_heads", None) is not None, align_at=config.align_at)
        found += codes.controllers(model, config.kmeans_init, config.revive_after, config.seed)  # revival, k-means
        if config.placement:
            found.append(PlacementObjective(config.placement, target))
        return found

    def plots(self, name: str, rows: list[dict], out) -> None:
        pass

    # -- decoding and evaluation ---------------------------------------------------------------
    def decoder(self, model):
        # lazy: torch (module docstring)
        from .decoding import ConceptDecoder

        return ConceptDecoder(model)

    def static_decoder(self, model, new_tokens: int, compile_choice: str | None):
        """``--compile``: the decoder whose step is one compiled graph over static KV caches."""
        # lazy: torch (module docstring)
        from .static_decoding import StaticConceptDecoder

        return StaticConceptDecoder(model, new_tokens, compile_choice)

    def compile_refusal(self, model) -> str | None:
        """Its stacks compile with a static concept budget only (the shapes then do not follow the decisions).
        Reading the budget also brings its host copy of the policy's target ratio up to date (``gap.target_of``),
        which a whole-forward graph reads as a constant."""
        if model.max_ratio:
            return None
        return ("a streaming model compiles with static shapes only: build it with a static concept budget, "
                "e.g. `concept build --max-ratio 0.25` (BuildConfig.max_ratio; the default `auto` finds none for a "
                "length policy with neither a target ratio nor a rate bound; the shapes then do not depend on the "
                "decisions and one graph serves every step)")

    def step_diagnostics(self, model, out, batch) -> dict[str, float]:
        # lazy: torch (module docstring)
        from .diagnostics import step_diagnostics

        return step_diagnostics(model, out, batch)

    def evaluate(self, model, batches, bucket: int, controls: bool, seed: int):
        # lazy: torch (module docstring)
        from .diagnostics import evaluate

        return evaluate(model, batches, bucket, controls, seed)

    def score(self, model, context, context_valid, continuation, continuation_valid):
        return None  # the core's causal forward over context + continuation (one pass = its decoding)

    # -- as the source of a FLOP-matched baseline ----------------------------------------------
    def static_shapes(self, plan) -> bool:
        """A build with a static concept budget (``max_ratio``: ``concept.streaming.operating_point.has_budget``)."""
        return has_budget(plan.config.max_ratio)

    def matched_flops(self, plan, config, shape) -> FlopTarget:
        """The model's ideal forward FLOPs at ``config.target_ratio`` concepts per token (evenly spaced) over
        ``config.seq_len`` tokens, as a fraction of the dense backbone's (``concept.flops``); the block starts at
        the middle stack (the pruned model keeps the shallow and deep stacks: ``concept.flops.matched_prune``)."""
        # lazy: torch (module docstring)
        from ..flops import evenly_spaced_keep, forward_flops, pruned_flops

        vocabulary, policy = plan.components["vocabulary"], plan.components["length_policy"]
        classes = int(getattr(vocabulary.config, "size", 0)) + int(policy.cls.uses_null_class)
        emit = int(getattr(policy.config, "emit", 1) or 1)
        T, ratio, split = config.seq_len, config.target_ratio, tuple(plan.split)
        flops = forward_flops(shape, split, evenly_spaced_keep(T, ratio), classes, emit).concept
        return FlopTarget(flops / pruned_flops(shape, sum(split), T), split[0], T,
                          f"the streaming model's ideal at target ratio {ratio} (split {','.join(map(str, split))})",
                          ratio)



STACKS = ("shallow", "middle", "deep")


def stack_layers(split) -> dict:
    """{"shallow": {"count": 2, "first": 0, "last": 1, "range": "0-1"}, ...}."""
    out, start = {}, 0
    for name, count in zip(STACKS, split):
        last = start + count - 1
        out[name] = {"count": count, "first": start, "last": last,
                     "range": f"{start}-{last}" if count > 1 else str(start)}
        start += count
    return out


def ratio_calibration(model, record: dict, train: dict | None) -> dict | None:
    """The NULL bias the model runs with and where it comes from: the build's calibration (concept.json),
    training (train.json), or nothing (built with --no-calibrate). None for a policy without a bias."""
    policy = model.length_policy
    if not isinstance(policy, RatioControlled):
        return None
    out = {"null_bias": float(policy.null_bias), "target_ratio": None, "ratio": None, "by": None}
    if isinstance(policy, TracksRatio):  # the ratio tracker's target (null, mtp)
        out["target_ratio"] = float(policy.target_ratio)
    if train is not None and train.get("ratio_control", "both") != "none":  # the trainer's controller set it
        out.update(by="training", target_ratio=train.get("target_ratio", out["target_ratio"]))
    elif record.get("calibration"):
        out.update(record["calibration"], by="build", null_bias=out["null_bias"])
    return out


def static_widths_flops(model, keep, deep_block: bool | None = None):
    """The FLOPs of the widths the model's static layout computes over a row with decisions ``keep`` [T], padding
    included (the budget's concept slots in the middle stack; the deep stack's block, or the slots plus T where its
    backend plans no block: ``flops.forward_flops``), as (report, concept slots, deep rows); None without a budget.
    ``deep_block``: the deep stack's width as with the block (True) or the layout (False); None: the model's."""
    # lazy: torch (module docstring)
    from .. import packing
    from ..flops import Shape, forward_flops, fusion_flops, head_classes

    T = len(keep)
    slots = model.concept_slots(T)
    if not slots:
        return None
    block = model.plans_deep_block() if deep_block is None else deep_block
    report = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, keep, head_classes(model),
                           emit=model.emit, fusion=fusion_flops(model), static_slots=slots, deep_block=block)
    return report, slots, packing.deep_block_width(T, slots, model.emit) if block else slots + T


def static_widths_ideal(model, ratio: float, T: int) -> dict | None:
    """:func:`static_widths_flops` at ``ratio`` concepts per token spread evenly, for ``concept inspect``, with the
    budget behind it (``budget``: its setting, e.g. ``auto``, the ratio and the slack it resolves to now)."""
    # lazy: torch (module docstring)
    from ..flops import evenly_spaced_keep

    flops = static_widths_flops(model, evenly_spaced_keep(T, ratio * model.levels / model.emit))
    if flops is None:
        return None
    report, slots, deep_rows = flops
    budget = {"setting": model.budget_setting, "max_ratio": model.max_ratio, "slack": model.budget_slack}
    return {"budget": budget, "concept_slots": slots, "deep_rows": deep_rows, "deep_block": model.plans_deep_block(),
            "ratio": report.ratio, "speedup": report.speedup}
