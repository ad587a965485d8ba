"""``concept inspect RUN_DIR``: what a saved run holds, and its ideal FLOP ratio."""
from __future__ import annotations

import click
from rich.markup import escape

from concept.config import DEFAULT_TARGET_RATIO

from .output import (
    describe_backbone,
    param_counts,
    print_json,
    quiet_progress_bars,
    render_components,
    render_params,
    render_plan_types,
    render_stacks,
    stack_layers,
    status,
    stdout,
    table,
)

# config slot -> attribute of ConceptModel holding that component (attention has no parameters)
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


def ratio_calibration(model, record: dict, train: dict | None) -> dict | None:
    """The NULL bias the model runs with and where it comes from: the build's calibration (concept.json),
    training (train.json), or nothing (built with --no-calibrate). None for a policy without a bias."""
    policy = getattr(model, "length_policy", None)
    if policy is None or not hasattr(policy, "null_bias"):
        return None
    out = {"null_bias": float(policy.null_bias), "target_ratio": None, "ratio": None, "by": None}
    target = getattr(policy, "target_ratio", None)  # the ratio tracker's target (null, mtp)
    if target is not None:
        out["target_ratio"] = float(target)
    if train is not None and train.get("ratio_control", "both") != "none":  # the trainer's controller set it
        out.update(by="training", target_ratio=train.get("target_ratio", out["target_ratio"]))
    elif record.get("calibration"):
        out.update(record["calibration"], by="build", null_bias=out["null_bias"])
    return out


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=str))
@click.option("--ratio", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_TARGET_RATIO, show_default=True,
              help="Concepts per token for the ideal FLOP ratio.")
@click.option("--seq-len", "seq_len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Sequence length T for the ideal FLOP ratio.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
def inspect(run_dir: str, ratio: float, seq_len: int, as_json: bool) -> None:
    """Summarise a run folder: stacks, parameters, components and the ideal FLOP ratio."""
    import concept
    from concept.builder import read_run, read_train
    from concept.flops import ideal_ratio

    record = read_run(run_dir)  # clear error for a missing or corrupt folder, before loading anything
    backbone = (record.get("config") or {}).get("backbone") or {}
    status("loading", f"{run_dir} ({backbone.get('name', '?')} backbone) ...")
    quiet_progress_bars()
    model = concept.load(run_dir)
    plan = model.plan.describe()
    counts = param_counts(model)
    per_slot = module_params(model)
    family = model.plan.family_object
    if plan["family"] == "planner-executor":  # no stacks, no keep ratio: its plan types and length control
        return inspect_planner_executor(run_dir, model, plan, counts, record, as_json)
    if not family.stacks:  # another family: what it says about itself
        return inspect_family(run_dir, model, family, plan, counts, record, as_json)
    flops = ideal_ratio(model, ratio, seq_len)
    flop_summary = {"concepts_per_token": ratio, **flops.to_dict()}
    calibration = ratio_calibration(model, record, read_train(run_dir))

    if as_json:
        components = {slot: {**c, "parameters": per_slot.get(slot)} for slot, c in plan["components"].items()}
        print_json({"path": run_dir, "format": record.get("format"), "backbone": plan["backbone"],
                    "stacks": stack_layers(model.split), "params": counts, "components": components,
                    "flops": flop_summary, "calibration": calibration})
        return

    stdout.print(f"[bold]run[/] {escape(run_dir)}")
    stdout.print(f"backbone: {escape(describe_backbone(plan['backbone']))}")
    stdout.print(render_stacks(model.split, plan["backbone"]["num_layers"]))
    stdout.print(render_params(counts))
    stdout.print(render_components(plan["components"], module_params=per_slot))
    if calibration is not None:
        t = table("ratio control", "value", title="NULL bias")
        t.add_row("NULL bias", f"{calibration['null_bias']:+.4f}")
        if calibration["target_ratio"] is not None:
            t.add_row("target ratio", f"{calibration['target_ratio']:g} concepts per token")
        if calibration["by"] == "build":
            t.add_row("calibrated ratio", f"{calibration['ratio']:.4f} on {calibration['tokens']:,} tokens of "
                                          f"{calibration['data']} (at build)")
        elif calibration["by"] == "training":
            t.add_row("calibrated by", "training (its ratio controller; null_bias in metrics.jsonl)")
        else:
            t.add_row("calibrated by", "nothing: built with --no-calibrate")
        stdout.print(t)
    t = table("ideal FLOPs", "value", title=f"ideal FLOPs at {ratio:g} concepts/token, T={seq_len}")
    per = f" ({flops.concepts // model.emit:,} boundaries x {model.emit})" if model.emit > 1 else ""  # concepts / levels
    t.add_row("concept slots", f"{flops.concepts:,} for {flops.T:,} tokens{per}")
    t.add_row("dense backbone", f"{flops.dense:.3e}")
    t.add_row("concept model", f"{flops.concept:.3e}")
    t.add_row("ratio (concept / dense)", f"{flops.ratio:.3f}")
    t.add_row("ideal speedup", f"{flops.speedup:.2f}x")
    stdout.print(t)


def inspect_planner_executor(run_dir: str, model, plan: dict, counts: dict, record: dict, as_json: bool) -> None:
    """``concept inspect`` of a planner-executor run: plan types, parameters, components, <EOS> bias, task."""
    planner = {**plan["planner"], "eos_bias": float(model.eos_bias.value), "task": model.task,
               "context_len": model.context_len}
    used = ("backbone", "sampler", "eval_sampler", "position_scheme", "vocabulary")
    components = {slot: c for slot, c in plan["components"].items() if slot in used}
    if as_json:
        print_json({"path": run_dir, "format": record.get("format"), "family": plan["family"],
                    "backbone": plan["backbone"], "planner": planner, "params": counts, "components": components})
        return
    stdout.print(f"[bold]run[/] {escape(run_dir)} (planner-executor)")
    stdout.print(f"backbone: {escape(describe_backbone(plan['backbone']))}")
    stdout.print(render_plan_types(plan["planner"]))
    stdout.print(render_params(counts))
    stdout.print(render_components(components))
    for title, rows in model.plan.family_object.inspect(model).items():
        stdout.print(render_rows(title, rows))


def render_rows(title: str, rows: dict):
    t = table(title, "value", title=title)
    for key, value in rows.items():
        t.add_row(escape(str(key)), escape(str(value)))
    return t


def inspect_family(run_dir: str, model, family, plan: dict, counts: dict, record: dict, as_json: bool) -> None:
    """``concept inspect`` of a family without stacks: its own description and tables, parameters, components."""
    sections = family.inspect(model)
    if as_json:
        print_json({"path": run_dir, "format": record.get("format"), "family": plan["family"],
                    "description": family.describe(model), "backbone": plan["backbone"], "params": counts,
                    "components": plan["components"], **sections})
        return
    stdout.print(f"[bold]run[/] {escape(run_dir)} ({escape(plan['family'])}): {escape(family.describe(model))}")
    stdout.print(f"backbone: {escape(describe_backbone(plan['backbone']))}")
    stdout.print(render_params(counts))
    for title, rows in sections.items():
        stdout.print(render_rows(title, rows))
