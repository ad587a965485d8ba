"""Reporting the frontier: the summary (best point), the tables, the plots and the files of ``OUT``
(putting the frontier into a document is ``benchmarks/frontier_doc.py``'s job: the library rewrites no docs)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ... import fs
from .scheduling import FrontierSpec, ScheduledRun

def write_json(path: Path, data) -> None:
    fs.write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def task_metrics(result: dict) -> list[tuple[str, str]]:
    """(task, metric) pairs of the frontier's task columns: each task's ``acc`` (else its first metric)."""
    pairs = {}
    for row in result["rows"]:
        for task, metrics in (row.get("tasks") or {}).items():
            names = [m for m in metrics if m != "samples"]
            if names and task not in pairs:
                pairs[task] = "acc" if "acc" in names else names[0]
    return list(pairs.items())


def summarise(spec: FrontierSpec, planned: list[ScheduledRun], rows: list[dict]) -> dict:
    """Add the gaps to dense and to the matched pruned baseline, the FLOP ratio used to rank
    (the largest over the domains) and the best streaming point at <= ``spec.max_flops``."""
    labels = [d.label for d in spec.domains]
    by_name = {row["run"]: row for row in rows}
    dense = next((row for row in rows if row["kind"] == "dense"), None)
    for row in rows:
        for label in labels:
            m = row["domains"][label]
            base = dense["domains"][label]["bits_per_token"] if dense else None
            bits = m["bits_per_token"]
            m["gap_bits"] = bits - base if bits is not None and base is not None else None
            m["gap_pct"] = 100 * m["gap_bits"] / base if m["gap_bits"] is not None and base else None
            pruned = by_name.get(row.get("pruned_baseline") or "")
            pbits = pruned["domains"][label]["bits_per_token"] if pruned else None
            m["vs_pruned_bits"] = bits - pbits if bits is not None and pbits is not None else None
        flops = [row["domains"][label]["flop_ratio"] for label in labels]
        bits = [row["domains"][label]["bits_per_token"] for label in labels]
        row["flop_ratio"] = max(flops) if None not in flops else None
        row["mean_bits"] = sum(bits) / len(bits) if None not in bits else None
    eligible = [row for row in rows if row["kind"] == "streaming" and row["flop_ratio"] is not None
                and row["mean_bits"] is not None and row["flop_ratio"] <= spec.max_flops]
    best = min(eligible, key=lambda row: row["mean_bits"]) if eligible else None
    return {
        "domains": [dataclasses.asdict(d) for d in spec.domains],
        "max_flops": spec.max_flops,
        "best": None if best is None else {"run": best["run"], "split": best["split"],
                                           "target_ratio": best["target_ratio"], "flop_ratio": best["flop_ratio"],
                                           "mean_bits": best["mean_bits"]},
        "recipe": spec.train.to_dict(),
        "build": spec.build.to_dict(),
        "eval": {"batches": spec.eval_batches, "batch": spec.eval_batch, "seq_len": spec.seq_len,
                 "controls": spec.controls, "tasks": list(spec.tasks), "tasks_limit": spec.tasks_limit},
        "rows": rows,
    }


# -- reports ---------------------------------------------------------------------------------
def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def best_line(result: dict) -> str:
    best, cap = result["best"], result["max_flops"]
    if best is None:
        return f"No streaming point at ≤ {cap:g}× dense FLOPs on every domain."
    return (f"Best streaming point at ≤ {cap:g}× dense FLOPs: **{best['run']}** (split {best['split']}, target ratio "
            f"{best['target_ratio']:g}): {best['flop_ratio']:.3f}× dense FLOPs, mean {best['mean_bits']:.3f} bits/token "
            f"over {', '.join(d['label'] for d in result['domains'])}.")


def table_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the frontier table: one row per run: kind, split, target ratio, FLOP ratio,
    then per domain bits/token, realised ratio, ΔNLL(shuffled), ΔNLL with the discrete codes shuffled
    and removed, the gap to dense (bits and %) and the difference to the matched pruned baseline, then
    the identity start's gate RMS (a property of the model, not of a domain)."""
    labels = [d["label"] for d in result["domains"]]
    each = lambda what: [f"{what} {label}" for label in labels]  # noqa: E731
    tasks = task_metrics(result)
    head = (["run", "kind", "split", "target ratio", f"FLOP ratio ({' / '.join(labels)})"] + each("bits")
            + each("ratio") + each("ΔNLL shuffle") + each("ΔNLL codes") + each("ΔNLL codes removed")
            + each("gap to dense") + each("vs pruned") + ["gate RMS"]
            + [f"{metric} {task}" for task, metric in tasks])
    rows = []
    for row in result["rows"]:
        ms = [row["domains"][label] for label in labels]
        flops = [m["flop_ratio"] for m in ms]
        flop = _f(flops[0], ".3f") if len(set(flops)) == 1 else " / ".join(_f(x, ".3f") for x in flops)
        gap = lambda m: "–" if m["gap_bits"] is None else (  # noqa: E731
            f"{m['gap_bits']:+.2f} ({_f(m['gap_pct'], '+.0f')}%)" if row["kind"] != "dense" else "0")
        rows.append([row["run"], row["kind"], row["split"] or "–", _f(row["target_ratio"], "g"), flop]
                    + [_f(m["bits_per_token"], ".3f") for m in ms]
                    + [_f(m["ratio"], ".3f") for m in ms]
                    + [_f(m["delta_nll_shuffle"], "+.3f") for m in ms]
                    + [_f(m.get("delta_nll_codes_shuffled"), "+.3f") for m in ms]
                    + [_f(m.get("delta_nll_codes_zero"), "+.3f") for m in ms]
                    + [gap(m) for m in ms]
                    + [_f(m["vs_pruned_bits"], "+.2f") for m in ms]
                    + [_f(ms[0].get("gate_norm") if ms else None, ".3f")]
                    + [_task_cell((row.get("tasks") or {}).get(task, {}).get(metric)) for task, metric in tasks])
    return head, rows


def _task_cell(m: dict | None) -> str:
    if m is None:
        return "–"
    return f"{m['value']:.3f}" + (f" ± {m['stderr']:.3f}" if m.get("stderr") is not None else "")


def markdown_table(result: dict) -> str:
    head, rows = table_cells(result)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def report_block(result: dict, image: str) -> str:
    """The table, the image link, the best point and the command (frontier.md and benchmarks/frontier_doc.py)."""
    ev = result["eval"]
    domains_ = ", ".join(f"{d['label']} = `{d['source']}`" for d in result["domains"])
    parts = [f"![held-out bits/token against FLOP ratio to dense]({image})", "",
             markdown_table(result), "",
             best_line(result), "",
             f"Held-out: {domains_}; {ev['batches']} × {ev['batch']} × {ev['seq_len']} tokens per domain. FLOP ratio: "
             f"ideal forward FLOPs at length {ev['seq_len']} over dense (streaming: at the ratio realised on each domain). "
             f"gap to dense: bits/token minus dense's (and %); vs pruned: minus the FLOP-matched pruned baseline's "
             f"(negative = the streaming model is better). ΔNLL in nats: shuffle, the concepts' whole inputs permuted across "
             f"the batch; codes, only their discrete codes (each concept keeps its own continuous part); codes removed, "
             f"the discrete embedding taken out of each concept's input (its continuous part kept). gate RMS: the identity "
             f"start's gate on the discrete embedding (– without one); docs/diagnostics.md says what healthy readings are."]
    if task_metrics(result):
        limit = result["eval"].get("tasks_limit")
        parts += ["", f"Task columns: lm-evaluation-harness metric ± one standard error on "
                      f"{f'the first {limit}' if limit else 'all'} examples of each task "
                      f"(`--tasks {','.join(result['eval']['tasks'])}`); `frontier-tasks.png` draws them against FLOPs."]
    notes = [f"- {row['run']}: {n}" for row in result["rows"] for n in row.get("notes", [])]
    if notes:
        parts += ["", *notes]
    if result.get("command"):
        parts += ["", "```", result["command"], "```"]
    return "\n".join(parts)


def _save(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG atomically, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fs.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


def plot(result: dict, path: Path) -> Path:
    """One panel per domain: x = FLOP ratio to dense, y = held-out bits/token; streaming points
    coloured by split (a line joins a split's ratios), marker by target ratio; pruned baselines
    as grey crosses; dense as a horizontal line (and a star at x = 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, labels = result["rows"], [d["label"] for d in result["domains"]]
    splits = list(dict.fromkeys(r["split"] for r in rows if r["kind"] == "streaming"))
    ratios = list(dict.fromkeys(r["target_ratio"] for r in rows if r["kind"] == "streaming"))
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(splits)}
    markers = {r: "osD^vPh*"[i % 8] for i, r in enumerate(ratios)}
    fig, axes = plt.subplots(1, len(labels), figsize=(6.2 * len(labels), 4.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        def xy(row):
            m = row["domains"][label]
            return m["flop_ratio"], m["bits_per_token"]

        for s in splits:
            pts = sorted((xy(r) for r in rows if r["kind"] == "streaming" and r["split"] == s and None not in xy(r)))
            if len(pts) > 1:
                ax.plot(*zip(*pts), color=colours[s], lw=1, alpha=0.5)
        for r in rows:
            x, y = xy(r)
            if x is None or y is None:
                continue
            if r["kind"] == "streaming":
                ax.scatter(x, y, color=colours[r["split"]], marker=markers[r["target_ratio"]], s=55, zorder=3)
                ax.annotate(r["split"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
            elif r["kind"] == "pruned":
                ax.scatter(x, y, color="0.35", marker="X", s=60, zorder=3)
                ax.annotate(r["run"], (x, y), textcoords="offset points", xytext=(5, -10), fontsize=7, color="0.35")
            else:
                ax.axhline(y, color="k", ls="--", lw=1)
                ax.scatter(1.0, y, color="k", marker="*", s=120, zorder=3)
        ax.axvline(result["max_flops"], color="0.6", ls=":", lw=1)
        ax.set_title(f"held-out: {label}")
        ax.set_xlabel("FLOP ratio to dense (ideal forward)")
        ax.set_ylabel("bits / token")
        ax.grid(alpha=0.3)
    handles = ([Line2D([], [], color=colours[s], marker="o", ls="-", label=f"split {s}") for s in splits]
               + [Line2D([], [], color="0.2", marker=markers[r], ls="", label=f"target ratio {r:g}") for r in ratios]
               + [Line2D([], [], color="0.35", marker="X", ls="", label="pruned (FLOP-matched)"),
                  Line2D([], [], color="k", marker="*", ls="--", label="dense"),
                  Line2D([], [], color="0.6", ls=":", label=f"{result['max_flops']:g}x dense FLOPs")])
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return _save(fig, path)


def plot_tasks(result: dict, path: Path) -> Path:
    """One panel per task: x = FLOP ratio to dense (the largest over the domains), y = its accuracy with
    one standard error; streaming points by split, pruned baselines as grey crosses, dense as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = task_metrics(result)
    rows = result["rows"]
    splits = list(dict.fromkeys(r["split"] for r in rows if r["kind"] == "streaming"))
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(splits)}
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    for ax, (task, metric) in zip(axes[0], tasks):
        for r in rows:
            m = (r.get("tasks") or {}).get(task, {}).get(metric)
            if m is None or r.get("flop_ratio") is None:
                continue
            err = m.get("stderr") or 0.0
            if r["kind"] == "dense":
                ax.axhline(m["value"], color="k", ls="--", lw=1)
                ax.errorbar(1.0, m["value"], yerr=err, color="k", marker="*", ms=11, capsize=3)
                continue
            style = dict(color=colours[r["split"]], marker="o") if r["kind"] == "streaming" else dict(color="0.35",
                                                                                                      marker="X")
            ax.errorbar(r["flop_ratio"], m["value"], yerr=err, ms=7, capsize=3, ls="", **style)
            ax.annotate(r["split"] if r["kind"] == "streaming" else r["run"], (r["flop_ratio"], m["value"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.set_title(f"{task} ({metric})")
        ax.set_xlabel("FLOP ratio to dense (ideal forward)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def write(result: dict, out: str | os.PathLike) -> dict[str, Path]:
    """``frontier.json`` (everything), ``frontier.md`` (the table), ``frontier.png`` (the plot) and, with
    tasks, ``frontier-tasks.png`` (accuracy against FLOP ratio)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "frontier.json", "md": out / "frontier.md", "png": out / "frontier.png"}
    if task_metrics(result):
        paths["tasks_png"] = plot_tasks(result, out / "frontier-tasks.png")
    plot(result, paths["png"])
    write_json(paths["json"], result)
    fs.write_atomic(paths["md"], "# Frontier: held-out bits/token against FLOP ratio to dense\n\n"
                    + report_block(result, "frontier.png") + "\n")
    return paths
