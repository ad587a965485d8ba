"""The planner-executor family (docs/planner_executor.md): the backbone plans discrete concepts from the
context, then writes the text from the plan alone (``concept.planner.model``).

This module stays free of torch: the torch-free ``TrainConfig`` (``concept.train_config``) and the CLI
(``concept train --help``, ``concept inspect``'s drawings) load the family object through its entry point.
So each method imports the modules it needs (which import torch) when it runs (``# lazy: torch``)."""
from __future__ import annotations

from ..contracts import Family
from ..families import family
from .options import PlannerTraining


class PlannerExecutor(Family):
    name = "planner-executor"
    @property
    def build_section(self):
        """The streaming family's (it reads its vocabulary, samplers, position scheme and split; it keeps the rest
        as before), looked up through the registry: one family imports no other."""
        return family("streaming").build_section

    section = "planner"  # `--set planner.KEY=VALUE`: its concept types, plan budget, ...
    defaults = {"position_scheme": "per-type"}  # each token type numbered from 1 (docs/planner_executor.md)
    checks_components = False  # no length policy, attention backend or tail fusion of its own
    stacks = False
    decodes = ("plan",)  # what `concept generate` shows of its decoding
    training = PlannerTraining  # the training options only this family reads

    # -- building ------------------------------------------------------------------------------
    def settings(self, options: dict, components: dict):
        # lazy: torch (module docstring)
        from .model import PlannerSettings

        settings, problems = PlannerSettings.parse(options)
        vocabulary = components.get("vocabulary")
        levels = getattr(vocabulary.config, "levels", 1) if vocabulary else 1
        if vocabulary and getattr(vocabulary.config, "beam", 1) > 1:
            problems.append("vocabulary.beam: the levels' beam is the streaming family's; the planner-executor "
                            "searches its plans, levels included, with --beam (drop --set vocabulary.beam)")
        for t in settings.types if settings is not None and levels > 1 else ():
            if t.max_len % levels:
                problems.append(f"planner.types: {t.name!r} has max_len {t.max_len}, but with vocabulary.levels "
                                f"{levels} a concept is {levels} code tokens; use a multiple of {levels}")
        scheme = components.get("position_scheme")
        if scheme is not None and scheme.name != "per-type":
            problems.append(f"position_scheme: the planner-executor family numbers each token type's positions "
                            f"from 1 (docs/planner_executor.md); build it with --rope per-type, not {scheme.name!r}")
        return settings, problems

    def build(self, plan, loaded):
        # lazy: torch (module docstring)
        from .model import build

        return build(plan, loaded)

    def describe(self, model) -> str:
        s = model.settings
        types = ", ".join(f"`{t.name}` ({t.size} ids, at most {t.max_len})" for t in s.types)
        return (f"a planner-executor concept model: the planner reads the context and writes a plan of discrete "
                f"concepts of {len(s.types)} type{'s' * (len(s.types) != 1)} ({types}; about {s.target:g} per example"
                f"{', the types planned in parallel' if s.parallel else ''}"
                f"{f', {s.mtp} concepts per planner forward' if s.mtp > 1 else ''}), the executor (the same "
                f"backbone) writes the text given the plan")

    def inspect(self, model, request) -> dict:
        """Its plan types and budget, the <EOS> bias of its quota controller, and the task it was trained for;
        only the components it uses."""
        return {"planner": {**model.resolution.describe()["planner"], "eos_bias": model.eos_bias.describe(),
                            "task": model.task, "context_len": model.context_len},
                "components": ["backbone", "sampler", "eval_sampler", "position_scheme", "vocabulary"]}

    # -- training ------------------------------------------------------------------------------
    def check_training(self, config, plan, device, dist) -> list[str]:
        problems = [f"{flag}: the planner-executor family has no {what}; drop it" for flag, given, what in (
            ("align", config.align, "deep stack to align"),
            ("distill", config.distill, "teacher distillation yet"),
            ("train-only", config.train_only == "new", "frozen-adapter stage")) if given]
        if dist is not None and dist.mode == "fsdp2":
            problems.append("distributed fsdp2: the planner-executor's planner and E-step run as many forwards as "
                            "each rank's plans need, but FSDP2 gathers every layer's weights in a collective that "
                            "all ranks must enter together; use --distributed ddp")
        return problems

    def prepare(self, model, train: dict) -> None:
        """What the executor is trained to write: the row from its plan (reconstruct) or its continuation."""
        model.task, model.context_len = train.get("task") or "reconstruct", train.get("context_len", 0)

    def objectives(self, config, model, step, notes: list) -> list:
        # lazy: torch (module docstring)
        from .objectives import from_config

        if config.usage_weight and model.settings.quota == "total":
            notes.append("--usage-weight with the total quota: a type can end itself early, and its usage term only "
                         "sees the concepts it emits; build with --set planner.quota=per-type to hold each type's "
                         "length (docs/planner_executor.md)")
        return from_config(config, model, step)

    def plots(self, name: str, rows: list[dict], out) -> None:
        # lazy: torch (module docstring)
        from .plots import planner_curves

        planner_curves({name: rows}, out / "planner.png")

    # -- decoding and evaluation ---------------------------------------------------------------
    def decoder(self, model):
        # lazy: torch (module docstring)
        from .decoding import PlannedDecoder

        return PlannedDecoder(model)

    def step_diagnostics(self, model, out, batch) -> dict[str, float]:
        # lazy: torch (module docstring)
        from .diagnostics import step_diagnostics

        return step_diagnostics(model, out, batch)

    def evaluate(self, model, batches, bucket: int, controls: bool, seed: int):
        # lazy: torch (module docstring)
        from .diagnostics import evaluate_planned

        return evaluate_planned(model, batches, bucket, controls, seed)

    def score(self, model, context, context_valid, continuation, continuation_valid):
        """Plan from the context, then the executor's logits for the continuation given the plan alone."""
        plan = model.planner(context, context_valid)
        return model.executor(plan, continuation, continuation_valid)
