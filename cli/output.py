"""Shared rendering: data on stdout (tables or JSON), status and errors on stderr."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from typing import Any, Iterable

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from concept.streaming.family import stack_layers  # (no torch)

PIPE_WIDTH = 160  # tables written to a pipe or file are not squeezed into 80 columns


class _Console:
    """A rich Console made for the current sys.stdout / sys.stderr at each use, so redirections
    (click's CliRunner, pytest's capture) are honoured."""

    def __init__(self, stderr: bool = False):
        self._stderr = stderr
        self.recorder: Console | None = None  # set by :func:`html_report`: prints go into its page

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.print(*objects, **kwargs)
            return
        stream = sys.stderr if self._stderr else sys.stdout
        tty = hasattr(stream, "isatty") and stream.isatty()
        width = None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH
        Console(file=stream, stderr=self._stderr, highlight=False, width=width).print(*objects, **kwargs)


stdout = _Console()
stderr = _Console(stderr=True)

STATUS_STYLE = {"ok": "green", "error": "bold red", "conflict": "bold yellow", "not checked": "dim"}


def print_error(message: str) -> None:
    click.echo(f"{click.style('error:', fg='red', bold=True)} {message}", err=True)


_QUIET = False


def quiet_rank() -> None:
    """A non-zero rank under torchrun: no status lines and no data on stdout (errors still print)."""
    global _QUIET
    _QUIET = True
    sys.stdout = open(os.devnull, "w")


def status(verb: str, detail: str = "") -> None:
    """A progress line on stderr, e.g. ``building tiny-llama ...``."""
    if _QUIET:
        return
    stderr.print(f"[bold cyan]{escape(verb)}[/] {escape(detail)}".rstrip())


def quiet_progress_bars() -> None:
    """Library progress bars (transformers' "Loading weights") only on an interactive stderr."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's and datasets' bars (tqdm reads it per bar)


def finite(ctx: click.Context, param: click.Parameter, value):
    """A click callback: a number option's value must be finite (click's FloatRange lets NaN through)."""
    # lazy: concept's package imports torch; concept.options itself is standard library only
    from concept.options import finite as representable

    if isinstance(value, float) and not representable(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def json_safe(data: Any) -> Any:
    """``data`` with every NaN or infinite float replaced by None: JSON has no NaN (``json.dumps`` would
    write a bare ``NaN`` that strict parsers refuse)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    return data


def print_json(data: Any) -> None:
    click.echo(json.dumps(json_safe(data), indent=2, default=str, allow_nan=False))


CONCEPT_MARKS = ("[[", "]]")  # a concept-emitting token in plain text (a pipe, a log file)


def marked_plain(text) -> str:
    """A concept map (``concept.diagnostics.render_concepts``: a ``rich.text.Text`` whose styled spans are the
    tokens that emitted a concept) as plain text, each such token between :data:`CONCEPT_MARKS`."""
    plain, out, at = text.plain, [], 0
    concepts = (s for s in text.spans if "reverse" in str(s.style))  # (the library's concept style: bold reverse)
    for span in sorted(concepts, key=lambda s: s.start):
        out += [plain[at:span.start], CONCEPT_MARKS[0], plain[span.start:span.end], CONCEPT_MARKS[1]]
        at = span.end
    return "".join(out) + plain[at:]


def print_concepts(text) -> None:
    """A concept map on stdout: styled on a terminal or into an HTML report (:func:`html_report`), with plain
    :data:`CONCEPT_MARKS` anywhere else (a pipe or a file keeps which tokens emitted a concept)."""
    if stdout.recorder is not None or (hasattr(sys.stdout, "isatty") and sys.stdout.isatty()):
        stdout.print(text)
    else:
        click.echo(marked_plain(text))


@contextlib.contextmanager
def html_report():
    """Inside the block, what goes to stdout through :data:`stdout` (tables, concept maps) is recorded; at its
    end, the whole of it is written to stdout as one self-contained HTML page (inline styles)."""
    recorder = Console(record=True, file=io.StringIO(), width=PIPE_WIDTH, highlight=False)
    stdout.recorder = recorder
    try:
        yield
    finally:
        stdout.recorder = None
    click.echo(recorder.export_html(inline_styles=True), nl=False)


def table(*columns: str, title: str | None = None, fold: Iterable[str] = ()) -> Table:
    """A plain table; columns named in ``fold`` wrap long values instead of cutting them."""
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold")
    fold = set(fold)
    for col in columns:
        t.add_column(col, overflow="fold" if col in fold else "ellipsis")
    return t


def styled_status(value: str) -> str:
    return f"[{STATUS_STYLE.get(value, '')}]{escape(value)}[/]" if value in STATUS_STYLE else escape(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def human(n: int) -> str:
    """1234567 -> '1,234,567 (1.2M)'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.1f}{unit})"
    return f"{n:,}"


def format_params(params: dict, user: Iterable[str] = ()) -> str:
    """Component options as ``k=v`` (user-set ones marked with ``*``)."""
    user = set(user)
    return ", ".join(f"{k}={json.dumps(v)}{'*' if k in user else ''}" for k, v in params.items()) or "-"


# -- model facts shared by `build` and `inspect` ---------------------------------------------

def param_counts(model) -> dict:
    """Parameter counts: total / trainable / frozen, the backbone and each new module."""
    params = list(model.parameters())  # deduplicated by torch
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    new = {name: sum(p.numel() for p in module.parameters()) for name, module in model.new_modules().items()}
    return {
        "total": total,
        "trainable": trainable,
        "frozen": total - trainable,
        "backbone": sum(p.numel() for p in model.backbone.parameters()),
        "new": sum(new.values()),
        "new_modules": new,
    }


def render_stacks(split: tuple[int, int, int], num_layers: int | None = None) -> Table:
    t = table("stack", "layers", "count", title="stacks" + (f" ({num_layers} layers)" if num_layers else ""))
    for name, s in stack_layers(split).items():
        t.add_row(name, s["range"], str(s["count"]))
    return t


def render_plan_types(planner: dict) -> Table:
    """The planner-executor's concept types (``BuildResolution.describe()["planner"]``)."""
    t = table("type", "vocabulary", "max_len", title=f"plan types (budget {planner['target']:g} concepts per example)")
    for i, pt in enumerate(planner["types"]):
        t.add_row(f"{i + 1}: {pt['name']}", str(pt["size"]), str(pt["max_len"]))
    mtp = planner.get("mtp", 1)
    t.caption = (("parallel types (all at once)" if planner.get("parallel") else "types in order")
                 + (f"; {mtp} concept tokens per planner forward (MTP)" if mtp > 1 else ""))
    return t


def render_structure(sections: dict, backbone: dict) -> list:
    """What a build plan wires, as its family describes it (``concept.families.structure``: e.g. the streaming
    model's stacks, the planner-executor's plan types): the tables of each section."""
    return [drawn for name, data in sections.items() for drawn in render_section(name, data, backbone)]


def render_calibration(calibration: dict) -> Table:
    """The streaming family's NULL bias and where it comes from (``concept inspect``)."""
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
    return t


def render_flops(flops: dict) -> Table:
    """The ideal FLOPs of a model with a concept ratio (``concept.flops.ideal_ratio``)."""
    t = table("ideal FLOPs", "value", title=f"ideal FLOPs at {flops['concepts_per_token']:g} concepts/token, "
                                            f"T={flops['T']}")
    emit = flops.get("emit", 1)
    per = f" ({flops['concepts'] // emit:,} boundaries x {emit})" if emit > 1 else ""  # concepts / levels
    t.add_row("concept slots", f"{flops['concepts']:,} for {flops['T']:,} tokens{per}")
    t.add_row("dense backbone", f"{flops['dense']:.3e}")
    t.add_row("concept model", f"{flops['concept']:.3e}")
    t.add_row("ratio (concept / dense)", f"{flops['ratio']:.3f}")
    t.add_row("ideal speedup", f"{flops['speedup']:.2f}x")
    static = flops.get("static")  # (a model with a static layout: the widths it computes, padding included)
    if static:
        budget = static.get("budget")
        if budget:  # (what the concept slots come from: ceil(max_ratio * T) + slack a row)
            t.add_row("static budget", f"{budget['setting']}: {budget['max_ratio']:g} a token + {budget['slack']} a row")
        t.add_row("static layout computes", f"{static['concept_slots']:,} concept slots, {static['deep_rows']:,} deep "
                                            f"rows" + (" (one block)" if static["deep_block"] else ""))
        t.add_row("its ideal speedup", f"{static['speedup']:.2f}x")
    return t


def render_rows(title: str, rows: dict) -> Table:
    t = table(title, "value", title=title)
    for key, value in rows.items():
        t.add_row(escape(str(key)), escape(str(value)))
    return t


def render_section(name: str, data, backbone: dict) -> list:
    """The tables of one section a family shows in ``concept inspect`` (``Family.inspect``): its own drawing
    for the sections this CLI knows, else a table of its rows (nothing for None)."""
    if data is None:
        return []
    if name == "stacks":
        return [render_stacks(tuple(s["count"] for s in data.values()), backbone.get("num_layers"))]
    if name == "planner" and "task" not in data:  # a build's plan types (a built model also has its controls)
        return [render_plan_types(data)]
    if name == "planner":
        task = data["task"] + (f", context {data['context_len']} tokens" if data["task"] == "continue" else "")
        bias = data["eos_bias"]
        if isinstance(bias, list):  # quota per-type: one bias per type
            bias = ", ".join(f"{t['name']} {b:+.4f}" for t, b in zip(data["types"], bias))
        else:
            bias = f"{bias:+.4f}"
        return [render_plan_types(data), render_rows("plan length control", {
            "quota": data.get("quota", "total"), "<EOS> bias (quota controller)": bias, "task": task})]
    drawn = {"calibration": render_calibration, "flops": render_flops}.get(name)
    if drawn is not None:
        return [drawn(data)]
    return [render_rows(name, data if isinstance(data, dict) else {name: data})]


def render_params(counts: dict) -> Table:
    t = table("parameters", "count", title="parameters")
    t.add_row("total", human(counts["total"]))
    t.add_row("trainable", human(counts["trainable"]))
    t.add_row("frozen (backbone)", human(counts["frozen"]))
    t.add_row("new modules", human(counts["new"]))
    for name, n in counts["new_modules"].items():
        t.add_row(f"  {name}", human(n))
    return t


def render_components(components: dict, title: str = "components", module_params: dict | None = None) -> Table:
    """One row per config slot (from ``plan.describe()["components"]``)."""
    cols = ["slot", "name", "provider", "target", "options (* set by user)"]
    if module_params is not None:
        cols.append("parameters")
    t = table(*cols, title=title, fold=cols[2:5])
    for slot, c in components.items():
        row = [slot, c["name"], c["provider"], c["target"], format_params(c["params"], c["set_by_user"])]
        if module_params is not None:
            n = module_params.get(slot)
            row.append("-" if n is None else f"{n:,}")
        t.add_row(*map(escape, row))
    return t


def describe_backbone(info: dict) -> str:
    kind = "pretrained" if info.get("pretrained") else "random init, weights saved with the run"
    return (f"{info['name']} ({info['architecture']}, {info['num_layers']} layers, hidden {info['hidden_size']}, "
            f"vocab {info['vocab_size']}, {kind})")
