"""``concept inspect RUN_DIR``: what a saved run holds, and its ideal FLOP ratio."""
from __future__ import annotations

import click
from rich.markup import escape

from .output import (describe_backbone, param_counts, print_json, quiet_progress_bars, render_components,
                     render_params, render_stacks, stack_layers, status, stdout, table)

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


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=str))
@click.option("--ratio", type=click.FloatRange(0, 1, min_open=True), default=0.25, show_default=True,
              help="Concepts per token for the ideal FLOP ratio.")
@click.option("--seq-len", "seq_len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Sequence length T for the ideal FLOP ratio.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
def inspect(run_dir: str, ratio: float, seq_len: int, as_json: bool) -> None:
    """Summarise a run folder: stacks, parameters, components and the ideal FLOP ratio."""
    import concept
    from concept.builder import read_run
    from concept.flops import ideal_ratio

    record = read_run(run_dir)  # clear error for a missing or corrupt folder, before loading anything
    backbone = (record.get("config") or {}).get("backbone") or {}
    status("loading", f"{run_dir} ({backbone.get('name', '?')} backbone) ...")
    quiet_progress_bars()
    model = concept.load(run_dir)
    plan = model.plan.describe()
    counts = param_counts(model)
    per_slot = module_params(model)
    flops = ideal_ratio(model, ratio, seq_len)
    flop_summary = {"concepts_per_token": ratio, **flops.to_dict()}

    if as_json:
        components = {slot: {**c, "parameters": per_slot.get(slot)} for slot, c in plan["components"].items()}
        print_json({"path": run_dir, "format": record.get("format"), "backbone": plan["backbone"],
                    "stacks": stack_layers(model.split), "params": counts, "components": components,
                    "flops": flop_summary})
        return

    stdout.print(f"[bold]run[/] {escape(run_dir)}")
    stdout.print(f"backbone: {escape(describe_backbone(plan['backbone']))}")
    stdout.print(render_stacks(model.split, plan["backbone"]["num_layers"]))
    stdout.print(render_params(counts))
    stdout.print(render_components(plan["components"], module_params=per_slot))
    t = table("ideal FLOPs", "value", title=f"ideal FLOPs at {ratio:g} concepts/token, T={seq_len}")
    t.add_row("concepts", f"{flops.concepts:,} of {flops.T:,} tokens")
    t.add_row("dense backbone", f"{flops.dense:.3e}")
    t.add_row("concept model", f"{flops.concept:.3e}")
    t.add_row("ratio (concept / dense)", f"{flops.ratio:.3f}")
    t.add_row("ideal speedup", f"{flops.speedup:.2f}x")
    stdout.print(t)
