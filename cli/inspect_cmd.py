"""``concept inspect RUN_DIR``: what a saved run holds, and its ideal FLOP ratio.

The backbone, parameters and components are every run's; the rest is what the run's family says about
itself (``Family.inspect``): named sections of JSON data, drawn here as tables (by name where a section
has its own drawing, e.g. the streaming family's ``stacks``, else as rows)."""
from __future__ import annotations

import click
from rich.markup import escape

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .output import (
    describe_backbone,
    finite,
    param_counts,
    print_json,
    quiet_progress_bars,
    render_components,
    render_params,
    render_section,
    status,
    stdout,
)

# config slot -> attribute of the model holding that component (attention has no parameters)
SLOT_MODULES = {"backbone": "backbone", "length_policy": "length_policy", "sampler": "sampler",
                "eval_sampler": "eval_sampler", "position_scheme": "positions", "vocabulary": "vocabulary",
                "tail_fusion": "tail_fusion"}


def module_params(model) -> dict:
    out = {}
    for slot, attr in SLOT_MODULES.items():
        module = getattr(model, attr, None)
        if module is not None and hasattr(module, "parameters"):
            out[slot] = sum(p.numel() for p in module.parameters())
    return out


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=str))
@click.option("--ratio", type=click.FloatRange(0, 1, min_open=True), callback=finite, default=DEFAULT_TARGET_RATIO,
              show_default=True,
              help="Concepts per token for the ideal FLOP ratio (a family with a concept ratio).")
@click.option("--seq-len", "seq_len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Sequence length T for the ideal FLOP ratio.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
def inspect(run_dir: str, ratio: float, seq_len: int, as_json: bool) -> None:
    """Summarise a run folder: backbone, parameters, components, and what its family shows (the streaming
    family: stacks, NULL-bias calibration and the ideal FLOP ratio; the planner-executor: plan types, task)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept
    from concept.builder import read_run, read_train
    from concept.components import InspectRequest

    record = read_run(run_dir)  # clear error for a missing or corrupt folder, before loading anything
    backbone = (record.get("config") or {}).get("backbone") or {}
    status("loading", f"{run_dir} ({backbone.get('name', '?')} backbone) ...")
    quiet_progress_bars()
    model = concept.load(run_dir)
    plan = model.resolution.describe()
    family = model.resolution.family_object
    train = read_train(run_dir)
    description = family.describe(model)  # (a baseline's too: the dense and pruned families)
    sections = family.inspect(model, InspectRequest(record, train, ratio, seq_len))
    used = sections.pop("components", None)
    per_slot = module_params(model)
    components = {slot: {**c, "parameters": per_slot.get(slot)} for slot, c in plan["components"].items()
                  if used is None or slot in used}
    counts = param_counts(model)
    if as_json:
        print_json({"path": run_dir, "format": record.get("format"), "family": plan["family"],
                    "description": description, "backbone": plan["backbone"], "params": counts,
                    "components": components, **sections})
        return
    stdout.print(f"[bold]run[/] {escape(run_dir)} ({escape(plan['family'])}): {escape(description)}")
    stdout.print(f"backbone: {escape(describe_backbone(plan['backbone']))}")
    for name, data in sections.items():
        for drawn in render_section(name, data, plan["backbone"]):
            stdout.print(drawn)
    stdout.print(render_params(counts))
    stdout.print(render_components(components, module_params=per_slot))
