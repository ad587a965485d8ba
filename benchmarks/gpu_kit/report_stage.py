"""`report` (on the CPU machine): the stages' JSON into the GPU sections of the docs, and the files to commit.

Reads the ``STAGE.json`` files that came back from the device (default ``.gpukit/results/``, one
folder per call: ``callN/``) and merges each stage's runs part by part: each part of its result
(``environment``, ``smollm2``, ``throughput``, ...) from the latest run that has it, saying which call
and when (a failed later call keeps what an earlier one measured); then it replaces the block between ``<!-- gpu-kit:STAGE:begin -->`` and
``<!-- gpu-kit:STAGE:end -->``: setup, exact and speed in ``docs/benchmarks.md``, quality in
``docs/results.md``, and the ``defaults`` block of ``docs/benchmarks.md`` with what setup, exact and speed say
of the defaults that wait for a GPU (``defaults_verdict``); each file is replaced atomically. It also files the pytest-benchmark baseline
under ``benchmarks/baselines/<gpu>/``, the training curves under ``docs/img/`` and the raw JSON under
``benchmarks/gpu_results/<gpu>/``, and prints the one ``git add`` to commit them. Results of a dry
run are never written into the docs; ``--dry`` renders the dry run's own results into copies of the
docs inside ``--out``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from . import defaults_verdict, flex_diagnosis
from .common import RESULTS, ROOT, KitError, Stage, read_json
from .pytest_run import counts

DOC = {"setup": "docs/benchmarks.md", "exact": "docs/benchmarks.md", "speed": "docs/benchmarks.md",
       "quality": "docs/results.md"}
DEFAULTS_DOC = "docs/benchmarks.md"  # the `defaults` block: ``defaults_verdict``'s reading of setup, exact and speed
CURVES = "docs/img/gpu-quality-curves.png"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- gpu-kit:{name}:begin -->", f"<!-- gpu-kit:{name}:end -->"


def replace_block(text: str, name: str, body: str, where: str) -> str:
    from concept import fs

    try:
        return fs.replace_marked(text, *markers(name), body.strip())
    except ValueError as exc:
        raise KitError(f"{where} {exc}; restore them and run `report` again") from None


def load(sources: list[Path]) -> dict[str, dict]:
    """Each stage's runs found in ``sources`` (each a folder, searched two levels deep), merged (:func:`merge`).
    A run cut off by the device's time limit (``"status": "running"``) counts with what it wrote."""
    runs: dict[str, list[dict]] = {}
    for source in sources:
        for path in sorted(Path(source).glob("**/*.json")):
            if path.stem not in DOC or len(path.relative_to(source).parts) > 3:
                continue
            data = read_json(path)
            if not isinstance(data, dict) or data.get("stage") != path.stem:
                continue
            data["_path"] = path
            data["_call"] = path.parent.name if path.parent != Path(source) else Path(source).name
            same = [d for d in runs.get(path.stem, []) if (d["started_at"], d["status"], d["seconds"]) ==
                    (data["started_at"], data["status"], data["seconds"])]
            if not same:  # (a dry run's copy in its work folder is the same run)
                runs.setdefault(path.stem, []).append(data)
    return {name: merge(sorted(found, key=lambda d: d["started_at"])) for name, found in runs.items()}


def run_source(run: dict) -> dict:
    return {"call": run["_call"], "started_at": run["started_at"], "status": run["status"], "command": run["command"]}


def merge(runs: list[dict]) -> dict:
    """One stage's runs (oldest first) as one: each part of the result from the latest run that has it
    (``parts_from``: which call, when, its status); the envelope (command, machine, status) of the latest run;
    the problems and warnings of every run and the skips of the runs used, each with its call when there
    are several."""
    latest = runs[-1]
    result, parts_from, paths = {}, {}, {}
    for run in runs:
        for part, value in (run.get("result") or {}).items():
            if value not in (None, {}, [], ""):
                result[part], parts_from[part], paths[part] = value, run_source(run), run["_path"]
    used = [r for r in runs if r is latest or any(p["call"] == r["_call"] and p["started_at"] == r["started_at"]
                                                   for p in parts_from.values())]

    def labelled(key: str, among: list[dict]) -> list:
        if len(runs) == 1:
            return list(latest.get(key, []))
        return [(f"{r['_call']}, {r['started_at'][:16].replace('T', ' ')}: " + item if isinstance(item, str)
                 else {**item, "reason": f"{item['reason']} ({r['_call']})"}) for r in among for item in r.get(key, [])]

    return {**latest, "result": result, "parts_from": parts_from, "runs": [run_source(r) for r in runs],
            "problems": labelled("problems", runs), "warnings": labelled("warnings", runs),
            "skipped": labelled("skipped", used), "_paths": paths}


def part_folder(data: dict, part: str) -> Path:
    """The folder of the run whose ``part`` the merged ``data`` holds (its files lie beside its JSON)."""
    return data.get("_paths", {}).get(part, data["_path"]).parent


def cell(text: str, limit: int = 200) -> str:
    """An error message as one table cell: one line, shortened, no pipes."""
    return re.sub(r"\s+", " ", str(text))[:limit].replace("|", "\\|")


def graphs_cell(row: dict) -> str:
    """A compiled row's CUDA graphs: whether its training forward and backward ran as CUDA graphs, how many graphs
    inductor skipped and how many were recorded again in the timed steps (where the row recorded it: 0 when every
    step replays); '–' where the row did not record it (the leases before 2026-11-28c)."""
    if row.get("cuda_graphs") is None:
        return "–"
    if not row["cuda_graphs"]:
        return "no"
    again = f", {row['cudagraph_rerecorded']} recorded again" if "cudagraph_rerecorded" in row else ""
    return f"yes, {row.get('cudagraph_skips', 0)} skipped{again}"


def budget_text(compiled: dict) -> str:
    """The compiled rows' static concept budget as ``setup`` resolved it: '' where it did not record one."""
    b = compiled.get("budget")
    if not b:
        return ""
    return (f"; the streaming model's budget `{compiled.get('max_ratio')}`: {b['max_ratio']:g} + {b['slack']} slack, "
            f"{b['concept_slots']} concept slots a row of {b['seq_len']}")


def capped_cell(run: dict) -> str:
    """A quality run's ``capped`` (the static budget's dropped boundaries per token) as mean / most / last tenth,
    or – for a run without a budget."""
    if run.get("capped_mean") is None:
        return "–"
    return " / ".join(f"{run[k]:.2g}" for k in ("capped_mean", "capped_max", "capped_last_tenth"))


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def heading(data: dict) -> str:
    m = data.get("machine") or {}
    text = (f"Measured {data['started_at'][:10]} by the GPU kit (`{data['command'] or data['stage']}`, "
            f"{data['seconds']:.0f} s, status **{data['status']}**) on {m.get('gpu') or 'no GPU'}, torch {m.get('torch')} "
            f"(CUDA {m.get('cuda')}), transformers {m.get('transformers')}, Python {m.get('host_python')}.")
    return text + provenance(data)


def provenance(data: dict) -> str:
    """Which run each part of a merged result came from, when the stage ran more than once."""
    if len(data.get("runs", [])) < 2:
        return ""
    by_run: dict[tuple, list[str]] = {}
    for part, source in data.get("parts_from", {}).items():
        by_run.setdefault((source["call"], source["started_at"], source["status"]), []).append(f"`{part}`")
    parts = "; ".join(f"{', '.join(names)} from {call} ({when[:16].replace('T', ' ')}, {status})"
                      for (call, when, status), names in sorted(by_run.items(), key=lambda i: i[0][1]))
    runs = ", ".join(f"{r['call']} ({r['status']})" for r in data["runs"])
    return f" The stage ran {len(data['runs'])} times ({runs}); each part from the latest run that has it: " + \
        (parts or "none has a result") + "."


def skipped_lines(data: dict) -> list[str]:
    lines = [f"- skipped: {s['what']}: {s['reason']}" for s in data.get("skipped", [])]
    lines += [f"- problem: {p}" for p in data.get("problems", [])]
    lines += [f"- warning: {w}" for w in data.get("warnings", [])]
    return [re.sub(r"\s+", " ", line) for line in lines]  # one line each (a problem may quote a traceback)


def render_setup(data: dict) -> str:
    r = data["result"]
    env = r.get("environment") or {}
    flex = env.get("flex") or {}
    xf = env.get("xformers") or {}
    deps = env.get("dependencies") or {}
    flex_text = ("compiled, forward and backward in {:.0f} s, relative error {:.1e} against causal SDPA".format(
        flex["forward_backward_s"], flex["relative_error_vs_sdpa"]) if flex.get("compiled")
        else flex.get("error") or flex.get("note") or flex.get("reason") or "–")
    xf_text = (f"{xf.get('version')}: kernels {'load' if xf.get('kernels_load') else 'do not load: ' + str(xf.get('unavailable_reason'))}"
               if xf.get("installed") else f"not installed: {xf.get('reason')}")
    off = [f"{n} {d['found']} (needs {d['required']})" + (f": {d['note']}" if d.get("note") else "")
           for n, d in deps.items() if not d["ok"]]
    lines = [heading(data), "", "| check | result |", "|---|---|",
             f"| GPU | {env.get('gpu', '–')}, capability {env.get('capability', '–')}, {env.get('gpu_memory_gib', '–')} GiB; "
             f"nvidia-smi: {env.get('nvidia_smi') or '–'} |",
             f"| versions | torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, transformers {env.get('transformers')}, "
             f"peft {env.get('peft')}, gguf {env.get('gguf')}, Triton {env.get('triton')} |",
             f"| FlexAttention | {flex_text} |", f"| xformers | {xf_text} |",
             f"| dependencies out of range | {'; '.join(off) if off else 'none'} |"]
    tp = r.get("throughput")
    if tp:
        rec = tp["recipe"]
        failed = tp.get("failed") or {}
        lines += ["", f"Training throughput of the default recipe (batch {rec['batch']} x {rec['seq_len']} tokens, "
                      f"{rec['precision']}, median of {tp['steps']['timed']} steps after {tp['steps']['warm-up']}):", "",
                  "| model | tokens/s | s / step | peak MiB |", "|---|---:|---:|---:|"]
        lines += [f"| {kind} | {m['tokens_per_s']:,.0f} | {m['step_s']:.3f} | {_f(m.get('peak_mib'), ',.0f')} |"
                  for kind, m in tp["models"].items()]
        lines += [f"| {kind} | failed: {cell(error)} | – | – |" for kind, error in failed.items() if " " not in kind]
        compiled = (tp.get("compiled") or {}).get("models", {})
        if compiled:
            lines += ["", f"Compiled (`{json.dumps(tp['compiled']['option'])}`{budget_text(tp['compiled'])}; compile: "
                          f"the warm-up steps' extra time; first step: its seconds, compilation included; CUDA graphs: "
                          f"whether the training forward and backward ran as CUDA graphs, and the graphs inductor ran "
                          f"without them, its log says why):",
                      "", "| model | tokens/s | vs eager | s / step | compile s | first step s | peak MiB | "
                          "CUDA graphs |", "|---|---:|---:|---:|---:|---:|---:|---|"]
            lines += [f"| {kind} | {m['tokens_per_s']:,.0f} | {_f(m.get('vs_eager'), '.2f')}x | {m['step_s']:.3f} | "
                      f"{_f(m.get('compile_s'), '.0f')} | {_f(m.get('first_step_s'), '.1f')} | "
                      f"{_f(m.get('peak_mib'), ',.0f')} | {graphs_cell(m)} |" for kind, m in compiled.items()]
            graphs_failed = tp["compiled"].get("cuda_graphs_failed") or {}
            if graphs_failed:
                lines += ["", "CUDA graphs failed these rows, measured again without them (as every compiled row after "
                              "them): " + "; ".join(f"{label}: {cell(error)}" for label, error in graphs_failed.items())]
        kernels = ((tp.get("compiled") or {}).get("lora_kernel") or {}).get("models", {})
        if kernels:
            lines += ["", "Compiled alike, the adapters in Triton kernels (`--lora-kernel triton`: a projection's forward "
                          "one kernel, its backward two; vs matmuls: against the compiled row above):",
                      "", "| model | tokens/s | vs matmuls | s / step | compile s | first step s | peak MiB | "
                          "CUDA graphs |", "|---|---:|---:|---:|---:|---:|---:|---|"]
            lines += [f"| {kind} | {m['tokens_per_s']:,.0f} | "
                      f"{_f(m['tokens_per_s'] / compiled[kind]['tokens_per_s'] if kind in compiled else None, '.2f')}x | "
                      f"{m['step_s']:.3f} | {_f(m.get('compile_s'), '.0f')} | {_f(m.get('first_step_s'), '.1f')} | "
                      f"{_f(m.get('peak_mib'), ',.0f')} | {graphs_cell(m)} |" for kind, m in kernels.items()]
        compiled_failed = {k: e for k, e in failed.items() if "compiled" in k.split()}
        if compiled_failed:
            lines += ["", "Compiled rows that failed (each on its own; the others above were measured): "
                      + "; ".join(f"{kind}: {cell(error)}" for kind, error in compiled_failed.items())]
        each = {kind: m["tokens_per_s_read_each_step"]
                for kind, m in [*tp["models"].items(), *((f"{k} compiled", m) for k, m in compiled.items()),
                                *((f"{k} compiled triton", m) for k, m in kernels.items())]
                if m.get("tokens_per_s_read_each_step")}
        if each:
            lines += ["", "Tokens/s above: the steps run as `concept train` runs them, each queued before the one "
                          "before it is read. With each step read at once instead (the host waiting for it, how "
                          "`setup` timed before 2026-11-29): " + ", ".join(f"{kind} {v:,.0f}" for kind, v in each.items())
                      + "."]
        target = training_target(tp["models"], compiled, kernels)
        if target:
            lines += ["", target]
        profiled = {kind: m["profile"] for kind, m in tp["models"].items() if m.get("profile")}
        profiled.update({f"{kind} compiled": m["profile"] for kind, m in compiled.items() if m.get("profile")})
        profiled.update({f"{kind} compiled triton": m["profile"] for kind, m in kernels.items() if m.get("profile")})
        if profiled:
            lines += ["", "One more step of each under `torch.profiler` (device busy: the sum of its kernels' own time; "
                          "far below the step's wall time means launches and Python bound the step, not arithmetic; "
                          f"host syncs: CUDA synchronisations inside the step; short kernels: those {short_under(profiled)} a "
                          "call, their calls, share of the device time and cuBLAS's split-K reductions among them, a "
                          "step bound by how many kernels it runs where the share is large; the full tables come "
                          "back as `setup-profile-KIND.txt`):", "",
                      "| model | step s | device busy s | kernel launches | host syncs | aten ops | short kernels | "
                      "most device time |",
                      "|---|---:|---:|---:|---:|---:|---|---|"]
            lines += [f"| {kind} | {p['wall_s']:.3f} | {p['device_s']:.3f} | {p['kernel_launches']:,} | "
                      f"{_f(p.get('host_syncs'), ',')} | {p['ops']:,} | {short_kernels_cell(p.get('short_kernels'))} | "
                      + ", ".join(f"`{t['op'][:60]}` {t['device_ms']:.1f} ms ({t['calls']}x)" for t in p["top_device"][:3])
                      + " |" for kind, p in profiled.items()]
    return "\n".join(lines + [""] + skipped_lines(data))


def short_under(sources) -> str:
    """"under N us", N the bound the rows' short kernels were counted under (``short_kernels.under_us``; each
    profile, or a short-kernel record, in ``sources``); 5 where none says."""
    records = [(d.get("short_kernels") if "short_kernels" in d else d) or {}
               for d in (sources.values() if isinstance(sources, dict) else sources) if d]
    bounds = {record.get("under_us") for record in records}
    bounds.discard(None)
    return f"under {'/'.join(f'{b:g}' for b in sorted(bounds)) or '5'} us"


def short_kernels_cell(short: dict | None) -> str:
    """A profile's short kernels (``concept.profiling.short_kernels``) as one cell; a dash where the kit that
    measured it had none."""
    if not short:
        return "–"
    return (f"{short['calls']:,} calls, {short['device_ms']:.1f} ms ({100 * short['of_device']:.0f} % of the "
            f"device time; {short['split_k_reduce_calls']:,} split-K reductions)")


def training_target(eager: dict, compiled: dict, kernels: dict | None = None) -> str:
    """The training target's line: streaming's best tokens/s, its ratio to the dense model's best, and the ratio
    under the same settings (eager against eager, compiled against compiled, and compiled with the adapters' Triton
    kernels, ``kernels``) where both were measured."""
    settings = (("eager", eager), ("compiled", compiled), ("compiled, --lora-kernel triton", kernels or {}))
    best = {k: max(d[k]["tokens_per_s"] for _, d in settings if k in d)
            for k in ("streaming", "dense") if any(k in d for _, d in settings)}
    if len(best) < 2:
        return ""
    same = [f"{d['streaming']['tokens_per_s'] / d['dense']['tokens_per_s']:.2f}x {name}"
            for name, d in settings if "streaming" in d and "dense" in d]
    return (f"Training target (docs/benchmarks.md): streaming {best['streaming']:,.0f} tokens/s at its best "
            f"(bar 250,000), {best['streaming'] / best['dense']:.2f}x the dense model's best (bar 1.4x); under the same "
            f"settings: {', '.join(same) or 'not measured'}"
            + ("" if "dense" in compiled or "dense" in (kernels or {}) else " (dense compiled not measured)") + ".")


def render_exact(data: dict) -> str:
    r = data["result"]
    if not r.get("tests"):
        return "\n".join([heading(data), ""] + skipped_lines(data))
    # Counted from the cases, without the nameless one an interrupted pytest writes (kits before
    # 2026-11-26 counted it as a passed test).
    tests = [t for t in r["tests"] if t["id"]]
    c = counts(tests)
    tol = r.get("tolerances") or {"relative_l2": {}, "attention_sharpened": float("nan")}
    lines = [heading(data), "",
             f"`{r.get('command')}`: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped. "
             f"Tolerances (relative L2 error against the float32 naive reference): "
             + "; ".join(f"{d}: logits {t['logits']:g}, gradients {t['grads']:g} (each tensor {t['grad_each']:g})"
                         for d, t in tol["relative_l2"].items())
             + f"; the tiny backbone's attention sharpened x{tol['attention_sharpened']:g}.", "",
             "| test (all its cases) | passed | failed | skipped | s | first failure or skip reason |",
             "|---|---:|---:|---:|---:|---|"]
    groups: dict[str, list[dict]] = {}
    for t in tests:
        groups.setdefault(t["id"].split("[")[0], []).append(t)
    for name, tests in groups.items():
        n = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
        first = next((t for t in tests if t["outcome"] in ("failed", "error")), None) or \
            next((t for t in tests if t["outcome"] == "skipped"), None)
        why = (f"`{first['id'].split('::')[-1]}`: " + re.sub(r"\s+", " ", first["message"])[:200]).replace("|", "\\|") \
            if first else ""
        lines.append(f"| `{name}` | {n['passed']} | {n['failed'] + n['error']} | {n['skipped']} | "
                     f"{sum(t['seconds'] for t in tests):.1f} | {why} |")
    return "\n".join(lines + [""] + skipped_lines(data))


def ideal_cells(row: dict) -> str:
    """The ideal and of-ideal cells: "–" for a comparison of two ways of doing the same work (no FLOP ideal)."""
    if row.get("ideal_speedup") is None:
        return "– | –"
    return f"{row['ideal_speedup']:.2f}x | {100 * row['fraction_of_ideal']:.0f}%"


def case_cell(row: dict) -> str:
    """A row's case, with the names of its two sides where they are not dense and concept (``sides``: e.g. adapters /
    merged, whose dense and concept columns hold them)."""
    return f"{row['case']} ({' / '.join(row['sides'])})" if row.get("sides") else row["case"]


def render_speed(data: dict) -> str:
    r = data["result"]
    if not r.get("rows"):
        return "\n".join([heading(data), ""] + skipped_lines(data))
    lines = [heading(data), "", f"`{r.get('command')}`", "",
             "| case | dense ms | concept ms | speed-up | ideal | of ideal | peak MiB (dense / concept) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        peak = (f"{row['dense_peak_mib']:,.0f} / {row['concept_peak_mib']:,.0f}" if "dense_peak_mib" in row else "–")
        lines.append(f"| {case_cell(row)} | {1000 * row['dense_s']:.2f} | {1000 * row['concept_s']:.2f} | "
                     f"{row['speedup']:.2f}x | {ideal_cells(row)} | {peak} |")
    profiled = [row for row in r["rows"] if "concept_device_busy_s" in row]
    if profiled:
        lines += ["", f"Host and device, per side (CUDA events: the median of {profiled[0].get('reps', '–')} calls after "
                      f"{profiled[0].get('warmup', '–')}; wall: the host's clock to the device's end; busy, launches, "
                      f"syncs, aten ops: one more call under `torch.profiler`):", "",
                  "| case | side | events ms | wall ms | device busy ms | kernel launches | host syncs | aten ops |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for row in profiled:
            for side, named in zip(("dense", "concept"), row.get("sides") or ("dense", "concept")):
                lines.append(f"| {row['case']} | {named} | {1000 * row[side + '_s']:.2f} | "
                             f"{_f(row.get(side + '_wall_s') and 1000 * row[side + '_wall_s'], '.2f')} | "
                             f"{1000 * row[side + '_device_busy_s']:.2f} | {row[side + '_kernel_launches']:,} | "
                             f"{row[side + '_host_syncs']} | {row[side + '_aten_ops']:,} |")
    lines += top_device_lines(r["rows"]) + forward_target_lines(r["rows"]) + adapter_cost_lines(r["rows"])
    decode = [row for row in r["rows"] if row.get("suite") == "decode-compiled"]
    if decode:  # tokens/s of the four decoders (benchmarks/test_compiled_decode.py)
        lines += ["", "Decoding, tokens/s (eager: DynamicCache / the eager streaming decoder; compiled: a static KV "
                      "cache and one compiled step):", "",
                  "| case | dense eager | dense compiled | streaming eager | streaming compiled | streaming / dense, "
                  "compiled | compiled / eager, streaming |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {row['case']} | {row['dense_eager_tokens_per_s']:,.0f} | {row['dense_tokens_per_s']:,.0f} | "
                  f"{row['concept_eager_tokens_per_s']:,.0f} | {row['concept_tokens_per_s']:,.0f} | {row['speedup']:.2f}x "
                  f"(ideal {row['static_ideal_speedup']:.2f}x) | {row['compile_speedup_concept']:.2f}x |" for row in decode]
    if (r.get("flex_diagnosis") or {}).get("variants"):  # issue 40: the flex kernel, one cause at a time
        lines += ["", flex_diagnosis.markdown(r["flex_diagnosis"])]
    lines += ["", "Fastest exact backend (speed-up over dense) per length:", "", "| suite | T | fastest | all |",
              "|---|---:|---|---|"]
    for suite, lengths in (r.get("fastest") or {}).items():
        for T, v in lengths.items():
            lines.append(f"| {suite} | {T} | `{v['fastest']}` | "
                         + ", ".join(f"{b} {x:.2f}x" for b, x in sorted(v["speedups"].items(), key=lambda i: -i[1])) + " |")
    rec = r.get("auto_recommendation") or {"current_choice_on_cuda": "–"}
    lines += ["", f"`auto` on CUDA today: `{rec['current_choice_on_cuda']}`. Recommendation from these rows:"]
    for mode, v in rec.items():
        if isinstance(v, dict):
            lines.append(f"- {mode}: " + (f"`{v['backend']}` ({v['reason']})" if v.get("backend") else v["reason"]))
    return "\n".join(lines + [""] + skipped_lines(data))


def adapter_cost_lines(rows: list[dict]) -> list[str]:
    """The adapters' cost a projection (``benchmarks/test_adapters.py``): per projection shape and row count, the
    device time of its forward and backward, the frozen base alone against base and adapter (the matmuls, and the
    Triton kernels of ``--lora-kernel triton`` where the row has them), and the kernels of each; nothing for rows
    without device times (a CPU's, a kit's before it)."""
    found = [row for row in rows if row.get("suite") == "adapter-cost" and "concept_device_busy_s_per_projection" in row]
    if not found:
        return []
    triton = any("kernels_device_busy_s_per_projection" in row for row in found)
    sides = ("dense", "concept", "kernels") if triton else ("dense", "concept")
    lines = ["", "The adapters' cost a projection, forward and backward (bf16, rank 8; device time: the sum of its "
                 "kernels' own time, no launch gaps, as a CUDA graph of the step runs them; the demo recipe's "
                 "full-width rows and the middle stack's" + ("; `triton`: `--lora-kernel triton`'s three kernels"
                                                            if triton else "") + "):", "",
             "| projection | rows | base alone µs | with its adapter µs | the adapter µs | "
             + ("with its adapter, `triton` µs | the adapter, `triton` µs | kernels (base / adapted / `triton`) | "
                if triton else "kernels (base / adapted) | ")
             + f"short kernels, adapted side (its call of {found[0].get('repeats', '–')} projections) |",
             "|---|---:|---:|---:|---:|" + ("---:|---:|" if triton else "") + "---:|---|"]
    for row in found:
        base, both = (1e6 * row[f"{side}_device_busy_s_per_projection"] for side in ("dense", "concept"))
        kernels = "/".join(_f(row.get(f"{side}_kernel_launches_per_projection"), ".0f") for side in sides)
        ours = row.get("kernels_device_busy_s_per_projection")
        fused = f"{_f(ours and 1e6 * ours, '.1f')} | {_f(ours and 1e6 * ours - base, '.1f')} | " if triton else ""
        lines.append(f"| {row['case'].removeprefix('adapter cost ')} | {row['rows']:,} | {base:.1f} | {both:.1f} | "
                     f"{both - base:.1f} | {fused}{kernels} | {short_kernels_cell(row.get('concept_short_kernels'))} |")
    return lines


def top_device_lines(rows: list[dict], name_chars: int = 56) -> list[str]:
    """What took the device time in the forward rows: per side of each, its kernels with the most own device time
    (``SIDE_top_device``: the profiled call's 8 largest), as one compact cell."""
    forward = [row for row in rows if str(row.get("suite", "")).startswith("forward")
               and not str(row["suite"]).endswith("-dense")]  # (the dense-vs-HF-eager row repeats the compiled row's)
    found = [(row, key[: -len("_top_device")]) for row in forward for key in row
             if key.endswith("_top_device") and row[key]]
    if not found:
        return []
    shorts = [row.get(side + "_short_kernels") for row, side in found]
    lines = ["", "What took the device time in the forward rows (the profiled call of each side: its kernels and "
                 f"copies with the most own device time, ms and calls; its short kernels, {short_under(shorts)} a call):",
             "",
             "| case | side | device busy ms | short kernels | largest kernels: own ms (calls) |", "|---|---|---:|---|---|"]
    for row, side in found:
        kernels = "; ".join(f"`{cell(t['op'], name_chars)}` {t['device_ms']:.2f} ({t['calls']})"
                            for t in row[side + "_top_device"])
        busy = row.get(side + "_device_busy_s")
        lines.append(f"| {row['case']} | {side} | {_f(busy and 1000 * busy, '.2f')} | "
                     f"{short_kernels_cell(row.get(side + '_short_kernels'))} | {kernels} |")
    return lines


def forward_target_lines(rows: list[dict]) -> list[str]:
    """The forward target at 8k, per compiled forward row: the streaming model against the dense backbone
    compiled alike, against HF eager, and against the better of the two (the honest baseline: the best dense
    model a user can run; on the H200, 2026-11-27b, HF eager at 23.1 ms beat the compiled 29.0 ms)."""
    found = [row for row in rows if "speedup_vs_dense_eager" in row]
    if not found:
        return []
    lines = ["", "Forward target at 8k (docs/benchmarks.md; bars: 2x dense compiled alike, 2.5x dense HF eager; "
                 "the best dense: the faster of the two, the honest baseline):", ""]
    for row in found:
        line = (f"- {row['case']}: {row['speedup']:.2f}x dense compiled, {row['speedup_vs_dense_eager']:.2f}x dense "
                f"HF eager")
        if row.get("dense_eager_s") and row.get("concept_s"):
            best, which = min((row["dense_s"], "compiled"), (row["dense_eager_s"], "HF eager"))
            line += (f", **{best / row['concept_s']:.2f}x the best dense** ({which}, {1000 * best:.2f} ms; "
                     f"streaming {1000 * row['concept_s']:.2f} ms)")
        lines.append(line + forward_graphs_text(row))
    return lines


def forward_graphs_text(row: dict) -> str:
    """A compiled forward row's CUDA graphs: whether each compiled side ran its no-grad forward as CUDA graphs, how many
    graphs inductor skipped and recorded again in the timed calls; '' where the row did not record it (the leases
    before 2026-11-28c, whose no-grad forwards ran in inductor's default mode)."""
    if "concept_cuda_graphs" not in row:
        return ""
    sides = ", ".join(f"{name} {'yes' if row.get(f'{key}_cuda_graphs') else 'no'}"
                      for name, key in (("streaming", "concept"), ("dense", "dense")))
    failed = (f" (they failed the forward, measured again without them: {cell(row['no_grad_graphs_failed'], 120)})"
              if row.get("no_grad_graphs_failed") else "")
    return (f"; CUDA graphs: {sides}, {row.get('cudagraph_skips', 0)} skipped, "
            f"{row.get('cudagraph_rerecorded', 0)} recorded again{failed}")


def render_quality(data: dict, image: str | None) -> str:
    r = data["result"]
    if not r.get("plan"):
        return "\n".join([heading(data), ""] + skipped_lines(data))
    plan = r["plan"]
    lines = [heading(data), "",
             f"Recipe: `make demo`'s ({', '.join(f'{k} {v}' for k, v in plan['recipe'].items())}), batch {plan['batch']} x "
             f"{plan['seq_len']} tokens, {plan['steps']} steps (warm-up {plan['warmup']}): "
             f"**{plan['tokens_per_model']:.3g} tokens per model**, the same batches of {training_text(plan)} for every "
             f"model{', compiled (' + json.dumps(plan['compile']) + ')' if plan.get('compile') else ', eager'}; "
             f"held-out: {', '.join(f'`{d}`' for d in plan['domains'])} (`stdlib` and `pydoc` are this "
             f"machine's Python's).", ""]
    lines += training_lines(plan.get("training"))
    lines += [f"- point {p['name']}: split {p['splits']}, ratio {p['ratios']}, planned {_f(p['flop_ratio'], '.3f')}x dense "
              f"FLOPs: {p['state']}" + (f" ({p['reason']})" if p.get("reason") else "") for p in r.get("points", [])]
    if r.get("runs"):
        lines += ["", "| run | steps done | tokens seen | last train loss | last held-out NLL (training data's split) "
                      "| boundaries the budget dropped, per token: mean / most / last tenth |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {x['run']} | {x['step']} / {x['steps']} | {x['tokens']:.3g} | {_f(x['loss'], '.3f')} | "
                  f"{_f(x['heldout_nll'], '.3f')} | {capped_cell(x)} |" for x in r["runs"]]
    if r.get("table"):
        lines += ["", "Held-out evaluation (the frontier's table):", "", r["table"]]
    if image:
        lines += ["", f"![training curves: train loss and held-out NLL against tokens seen]({image})"]
    return "\n".join(lines + [""] + skipped_lines(data))


def training_lines(training: dict | None) -> list[str]:
    """Which way each model trained (eager or compiled), what sized it, and why (plans before 2026-11-27b: none)."""
    if not training:
        return []
    models = "; ".join(f"{kind} {m['ran']}" + (f" (sized by {m['tokens_per_s']:,.0f} tokens/s, {m['sized_by']}"
                                                + (f"; compilation {m['compile_s']:.0f} s" if m.get("compile_s") else "")
                                                + ")" if m.get("tokens_per_s") else "")
                       for kind, m in training["models"].items())
    kernels = ", the adapters in Triton kernels (`--lora-kernel triton`)" if training.get("lora_kernel") == "triton" else ""
    return [f"- training: {models}{kernels}. Why: {training['why']}."]


def training_text(plan: dict) -> str:
    """The plan's training data in words: the corpus of installed sources, or the path (kits before 2026-11-27)."""
    c = plan.get("corpus")
    if not c:
        return f"`{plan.get('data', 'stdlib')}`"
    return (f"the Python sources installed on the machine ({c['files']:,} of the {c['corpus_files']:,} `.py` files "
            f"under `{c['root']}`, {c['bytes'] / 1e6:.0f} of {c['corpus_bytes'] / 1e6:.0f} MB; "
            f"{c['train']['tokens']:.3g} training tokens, one epoch at most: no token twice)")


def free_baseline_path(base: Path, relative: str, data: bytes) -> str:
    """``relative`` (``.../NNNN_NAME.json``), or the next free NNNN where an earlier lease's run is there:
    a saved baseline is never overwritten (``concept bench --compare NAME`` takes the latest)."""
    path = Path(relative)
    number, name = path.name.split("_", 1)
    n = int(number)
    while (base / path).exists() and (base / path).read_bytes() != data:
        n += 1
        path = path.with_name(f"{n:04d}_{name}")
    return path.as_posix()


def machine_slug(found: dict) -> str:
    speed = (found.get("speed") or {}).get("result") or {}
    if speed.get("machine_id"):
        return speed["machine_id"]
    gpu = next((d["machine"].get("gpu") for d in found.values() if (d.get("machine") or {}).get("gpu")), None) or "cpu"
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def run(stage: Stage, args) -> int:
    from concept import fs

    sources = [stage.out] if stage.dry else [Path(s) for s in (args.sources or [RESULTS])]
    found = load(sources)
    if not found:
        stage.problem(f"no stage results (setup.json, exact.json, speed.json, quality.json) in "
                      f"{', '.join(map(str, sources))}: copy the files each device call brought back there (docs/gpu.md)")
        return stage.finish({})
    dry_results = [n for n, d in found.items() if d.get("dry")]
    if dry_results and not stage.dry:
        stage.problem(f"{', '.join(dry_results)}: results of a dry run (CPU, tiny backbone); they are never written into "
                      f"the docs. Remove them from {', '.join(map(str, sources))}")
        return stage.finish({})
    base = stage.out if stage.dry else ROOT
    slug = machine_slug(found)
    quality, speed = found.get("quality"), found.get("speed")
    curves = part_folder(quality, "curves") / "quality-curves.png" if quality else None
    image = "img/" + Path(CURVES).name if curves is not None and curves.is_file() else None
    renders = {"setup": render_setup, "exact": render_exact, "speed": render_speed,
               "quality": lambda d: render_quality(d, image)}
    docs = {}
    try:  # every doc and its markers first: nothing is written unless all of them are fine
        for doc in sorted(set(DOC.values())):
            text = (ROOT / doc).read_text(encoding="utf-8")
            for name in [n for n, d in DOC.items() if d == doc]:
                text = replace_block(text, name, renders[name](found[name]) if name in found else "", doc)
                if name not in found:
                    stage.skip(f"the {name} block of {doc}", f"no {name}.json among the results")
            if doc == DEFAULTS_DOC:  # what the lease says of the defaults that wait for a GPU (setup, exact, speed)
                text = replace_block(text, "defaults", defaults_verdict.render(found), doc)
            docs[doc] = text
    except KitError as exc:
        stage.problem(str(exc))
        return stage.finish({})
    written: list[str] = []

    def place(relative: str, data: bytes) -> None:
        target = base / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.write_atomic(target, data)
        written.append(relative)

    if image:
        place(CURVES, curves.read_bytes())
    baseline = ((speed or {}).get("result") or {}).get("baseline")
    if baseline and (part_folder(speed, "baseline") / baseline["file"]).is_file():
        data = (part_folder(speed, "baseline") / baseline["file"]).read_bytes()
        place(free_baseline_path(base, f"benchmarks/baselines/{baseline['path']}", data), data)
    for name, data in found.items():
        clean = {k: v for k, v in data.items() if not k.startswith("_")}
        place(f"benchmarks/gpu_results/{slug}/{name}.json", (json.dumps(clean, indent=1) + "\n").encode())
    for doc, text in docs.items():
        place(doc, text.encode("utf-8"))
    commit = "git add " + " ".join(sorted({w if not w.startswith("benchmarks/") else "/".join(w.split("/")[:3])
                                           for w in written}))
    for line in defaults_verdict.render(found).splitlines():  # (the defaults block's verdicts, said here too)
        if line.startswith("- "):
            stage.say("defaults: " + line[2:])
    if stage.dry:
        stage.say(f"dry run: rendered {len(written)} files into copies under {base} (the real docs are untouched)")
    else:
        stage.say(f"wrote {len(written)} files; to commit them: {commit}")
    return stage.finish({"stages": {n: found[n]["status"] for n in found}, "sources": [str(s) for s in sources],
                         "written": written, "commit": commit, "machine": slug})
