"""`quality`: the streaming model against its FLOP-matched pruned baseline and the dense baseline, on
the same tokens, in bf16, sized by the throughput `setup` measured.

1. **The default point**: `make demo`'s recipe (the default build, split 4,18,8 at 0.125 concepts
   per token, ``--lr 3e-3 --lr-new 3e-3``, seq-len 128, warm-up 10%) on a GPU batch, the streaming
   model, its pruned baseline and the dense baseline, each trained on the same number of tokens:
   as many as ``--total-minutes`` allow (at least 1e7 per model is the aim's floor, 3e7 the aim,
   ``--tokens`` caps it).
2. **If time remains**, the frontier point nearest 0.8x dense FLOPs (among a few splits and ratios,
   chosen from ``concept frontier --dry-run``) against its own pruned baseline, on the same tokens.

The training text is the GPU image's installed Python sources (``corpus.py``: 1e8 tokens and more,
selected as the plan needs, tokenised once into the token cache, never a training token twice; the
standard library stays the default elsewhere). Where `setup` measured compiled training faster than eager, the
three models train compiled alike if that fits more tokens into the minutes, their compilations counted
(``--compile auto``; ``on``: compiled wherever it was faster; ``off``: eager); each is sized by its compiled
throughput where `setup` measured one, else by its eager one. Compiled, they train with the adapters in Triton
kernels (``--lora-kernel triton``) where `setup`'s compiled pair with them beat the pair with the matmuls, model for
model. The plan says which way each ran and why.

Both run through ``concept frontier`` (one ``--out`` for both, so the dense run is shared), which
evaluates every run on held-out code (``stdlib``) and prose (``pydoc``). The plan is fixed at the
first call and kept on the machine: a later call resumes where the last one stopped (the frontier
skips complete runs and resumes interrupted ones from their checkpoints). At the call's budget
(``--minutes``) the training is interrupted cleanly (a checkpoint is written). The table comes in
the frontier's format, with training curves (``quality-curves.png``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..compiled import BUDGET
from . import corpus, recipe
from .common import KitError, Stage, kit_env, python_cmd, read_json, run_logged, write_json
from .setup_stage import ADAPTER_KERNEL, measure_throughput, needs_setup, smollm2_ready, throughput

MIN_TOKENS, AIM_TOKENS = 1e7, 1e8  # 1e8: the product's question (issue 39)
TARGET_FLOPS = 0.8
# candidates for the point near 0.8x dense FLOPs (the frontier's dry run gives each one's FLOP ratio)
CANDIDATES = {"splits": ["10,10,10", "8,14,8", "6,18,6", "12,6,12"], "ratios": [0.25, 0.5]}
DRY_CANDIDATES = {"splits": ["3,2,3", "2,4,2"], "ratios": [0.25, 0.5]}
EVAL = {"batches": 6, "batch": 16}  # 12,288 tokens per domain: about all of pydoc's held-out split
DRY_EVAL = {"batches": 2, "batch": 2}
DRY_STEPS = 4
DRY_TRAIN = {"calibration_batches": 2, "eval_batches": 1}  # the dry run's final calibration and evaluations: tiny
KINDS = ("streaming", "pruned", "dense")
COMPILE_GUESS_S = 60  # a model's compilation where `setup` measured none (2026-11-27b: 38 s, the streaming model)
SAFETY = 0.8  # throughput in a real run (evaluations, diagnostics, checkpoints) against `setup`'s steps
OVERHEAD_S = 30  # per run: process start, build, data, the final calibration and evaluation (2026-11-26: ~24)
PLAN_S = 45  # making the plan: the FLOP plans, the tokenizer, the corpus selected and tokenised (~1e7 tokens/10 s)


def folder(stage: Stage) -> Path:
    return stage.work / "quality"


def main_split(dry: bool) -> str:
    return recipe.DRY_SPLIT if dry else "auto"


def frontier_args(stage: Stage, plan: dict, splits: str, ratios: str, baselines: str) -> list[str]:
    """``concept frontier`` with the kit's recipe, the plan's steps, held-out code and prose."""
    dry = stage.dry
    every = plan["steps"] // 20 if plan["steps"] >= 40 else plan["steps"]  # ~20 evaluations and checkpoints a run
    evaluation = DRY_EVAL if dry else EVAL
    args = ["-m", "concept_cli", "frontier", "--splits", splits, "--ratios", ratios, "--baselines", baselines,
            "--steps", str(plan["steps"]), "--seq-len", str(plan["seq_len"]), "--batch", str(plan["batch"]),
            "--lr", str(recipe.DEMO["lr"]), "--lr-new", str(recipe.DEMO["lr_new"]), "--warmup", str(plan["warmup"]),
            "--eval-batches", str(evaluation["batches"]), "--eval-batch", str(evaluation["batch"]),
            "--device", plan["device"], "--out", str(folder(stage) / "runs"), *recipe.build_args(dry),
            "--train-set", f"eval_every={every}", "--train-set", f"checkpoint_every={every}",
            "--train-set", f"log_every={min(every, 50)}"]
    for domain in recipe.domains(dry):
        args += ["--eval-data", domain]
    args += ["--data", plan["data"]]
    if plan.get("compile"):  # a streaming model compiles with a static concept budget only
        args += ["--build-set", f"max_ratio={BUDGET}"]
    for key, value in {**recipe.precision(dry), **(DRY_TRAIN if dry else {}), **(plan.get("compile") or {})}.items():
        args += ["--train-set", f"{key}={json.dumps(value) if isinstance(value, bool) else value}"]
    return args


def planned_flops(stage: Stage, plan: dict, splits: list[str], ratios: list[float]) -> list[dict]:
    """The frontier's plan (what ``concept frontier --dry-run`` shows) of splits x ratios with their pruned
    baselines: ``[{kind, split, target_ratio, flop_ratio, pruned_baseline}]`` in plan order, streaming runs
    first. Loads at most the backbone."""
    from concept.recipes.frontier import FrontierSpec, domains, schedule

    train = recipe.train_config(stage.dry, steps=plan["steps"], batch_size=plan["batch"], device=plan["device"])
    spec = FrontierSpec(build=recipe.build_config(stage.dry), splits=splits, ratios=ratios, train=train,
                        domains=domains(list(recipe.domains(stage.dry)))[0], baselines=("pruned",))
    runs = schedule(spec)
    flops = {r.name: r.planned_flop_ratio for r in runs}
    return [{"kind": r.kind, "split": ",".join(map(str, r.split)) if r.split else None, "target_ratio": r.target_ratio,
             "flop_ratio": r.planned_flop_ratio, "pruned_baseline": r.pruned,
             "pruned_flop_ratio": flops.get(r.pruned)} for r in runs]


def make_plan(stage: Stage, args) -> dict:
    """Tokens per model and the points to train, from the measured throughput, the minutes given and the
    corpus (one epoch of its training split at most)."""
    dry = stage.dry
    batch, seq = args.batch or recipe.batch(dry), recipe.seq_len(dry)
    plan = {"created_at": stage.started_at, "device": "cpu" if dry else "cuda", "batch": batch, "seq_len": seq,
            "tokens_per_step": batch * seq, "total_minutes": args.total_minutes, "used_s": 0.0, "steps": 1,
            "warmup": 1, "recipe": {**recipe.DEMO, **recipe.precision(dry)}, "domains": list(recipe.domains(dry))}
    cands = DRY_CANDIDATES if dry else CANDIDATES
    main = planned_flops(stage, plan, [main_split(dry)], [recipe.DEMO["target_ratio"]])[0]
    near = min((r for r in planned_flops(stage, plan, cands["splits"], cands["ratios"])
                if r["kind"] == "streaming" and r["pruned_baseline"]), key=lambda r: abs(r["flop_ratio"] - TARGET_FLOPS))
    points = [{"name": name, "splits": r["split"], "ratios": str(r["target_ratio"]), "baselines": "pruned,dense",
               "flop_ratio": r["flop_ratio"], "state": "planned"}
              for name, r in (("default", main), (f"near-{TARGET_FLOPS}x", near))]
    if dry:
        steps, reason = DRY_STEPS, ("dry run: one point keeps the self-check within seconds (on the GPU this point "
                                    "runs when the lease's minutes fit it)")
        plan["training"] = {"mode": "eager", "option": None, "models": {k: {"ran": "eager"} for k in KINDS},
                            "why": "a dry run trains eager (setup's dry rows check the compiled step)"}
    else:
        steps, seconds, reason, plan["training"] = size(stage, args, plan["tokens_per_step"], main, near)
        plan["estimate_s"] = {p["name"]: s for p, s in zip(points, seconds)}
    plan["compile"] = plan["training"]["option"]  # (what frontier_args reads)
    steps = min(steps, prepare_corpus(stage, plan, steps))
    if reason:
        points[1].update(state="skipped", reason=reason)
    plan.update(steps=steps, warmup=recipe.warmup(steps), tokens_per_model=steps * plan["tokens_per_step"],
                points=points)
    return plan


def prepare_corpus(stage: Stage, plan: dict, steps: int) -> int:
    """Select and tokenise the training text for ``steps`` steps per model (``plan["data"]``,
    ``plan["corpus"]``); returns the steps one epoch of it holds (a plan never repeats a training token)."""
    import concept
    from concept.train_config import TrainConfig

    where = folder(stage) / "corpus"
    manifest = corpus.prepare(stage, where, steps * plan["tokens_per_step"])
    model = concept.build(recipe.build_config(stage.dry))  # its tokenizer, as the training runs load it
    counts = corpus.tokenize(stage, where, model, plan["seq_len"], TrainConfig.seed)
    epoch = counts["train"]["rows"] // plan["batch"]
    if epoch < steps:
        stage.warn(f"the corpus's training split holds {epoch} steps of {plan['tokens_per_step']} tokens, fewer than "
                   f"the {steps} the minutes fit: the plan trains {epoch} (no training token twice)")
    if epoch < 1:
        raise KitError(f"the training corpus ({manifest['files']} files of {manifest['root']}) holds less than one "
                       f"batch of {plan['tokens_per_step']} tokens")
    plan.update(data=str(where), corpus={**manifest, **counts})
    return epoch


def size(stage: Stage, args, per_step: int, main: dict, near: dict) -> tuple[int, tuple[int, int], str, dict]:
    """Steps per model for the default point (as many tokens as ``--total-minutes`` allow, up to the aim), the
    seconds each point should take, why the near-0.8x point does not fit ('' if it does), and how the three
    models train (:func:`choose_training`: ``option``, None for eager). Seconds per token: the default point's
    three models as `setup` measured them, the way they train; the other point's two scaled by FLOPs."""
    measured = throughput(stage.work) or {}
    if set(measured.get("models", {})) != set(KINDS):
        stage.warn("`setup` did not measure the throughput of all three models on this machine: measuring it now")
        measured = measure_throughput(stage, compiled=False)
        if set(measured["models"]) != set(KINDS):
            raise KitError(f"the training throughput of {', '.join(sorted(measured['failed'])) or 'a model'} could not be "
                           f"measured (the problems above), so quality cannot size its runs; see quality.log")
    available = args.total_minutes * 60 - 3 * OVERHEAD_S - PLAN_S
    cap = min(args.tokens or AIM_TOKENS, AIM_TOKENS)
    training = choose_training(measured, available, cap, getattr(args, "compile", "auto"))
    tp = {k: m["tokens_per_s"] for k, m in training["models"].items()}
    compile_s = {k: m["compile_s"] for k, m in training["models"].items()}
    per_token_main = seconds_per_token(tp)
    per_token_near = (near["flop_ratio"] / main["flop_ratio"] / tp["streaming"]
                      + near["pruned_flop_ratio"] / (main["pruned_flop_ratio"] or 1.0) / tp["pruned"]) / SAFETY
    tokens = max(per_step, min(cap, (available - sum(compile_s.values())) / per_token_main))
    steps = max(1, int(tokens // per_step))
    tokens = steps * per_step
    if tokens < MIN_TOKENS:
        stage.warn(f"only {tokens:.2e} tokens per model fit {args.total_minutes} minutes (the floor is "
                   f"{MIN_TOKENS:.0e}): the quality numbers are indicative only")
    estimate = (round(tokens * per_token_main + 3 * OVERHEAD_S + PLAN_S + sum(compile_s.values())),
                round(tokens * per_token_near + 2 * OVERHEAD_S + compile_s["streaming"] + compile_s["pruned"]))
    left = args.total_minutes * 60 - estimate[0]
    reason = "" if left >= estimate[1] else (
        f"{args.total_minutes:g} minutes fit the default point at {tokens:.2e} tokens per model, not also this point "
        f"(~{estimate[1] / 60:.1f} more minutes)")
    stage.say(f"training {training['mode']}: {training['why']}")
    return steps, estimate, reason, training


def seconds_per_token(tokens_per_s: dict) -> float:
    """Seconds per token of each model, the three trained one after the other, at ``SAFETY`` of `setup`'s rate."""
    return sum(1 / tokens_per_s[k] for k in KINDS) / SAFETY


def compiled_alternative(measured: dict) -> tuple[dict | None, str]:
    """The three models compiled alike, from `setup`'s throughput: per model the tokens/s to size by (its compiled
    row's, else its eager row's: conservative) and its compilation's seconds (its own ``compile_s``, else the
    longest measured, else ``COMPILE_GUESS_S``); or None and why not: no compiled row, a compiled row (or the
    static-budget build) that failed, or no compiled row faster than its eager one. Where `setup`'s rows with the
    adapters in Triton kernels beat the matmuls' (:func:`kernel_alternative`), the three train with them."""
    eager, compiled = measured["models"], measured.get("compiled") or {}
    rows = compiled.get("models") or {}
    failed = sorted(label for label in (measured.get("failed") or {})
                    if "compiled" in label and not label.endswith(ADAPTER_KERNEL))
    if failed:
        return None, f"compiled training failed in `setup` ({', '.join(failed)})"
    if not rows:
        return None, "`setup` measured no compiled training on this machine"
    faster = sorted(k for k, m in rows.items() if k in eager and m["tokens_per_s"] > eager[k]["tokens_per_s"])
    if not faster:
        return None, "compiled training was not faster than eager in `setup`"
    kernels, kernels_why = kernel_alternative(measured)
    known = [m["compile_s"] for m in [*rows.values(), *kernels.values()] if m.get("compile_s") is not None]
    guess = max(known) if known else COMPILE_GUESS_S

    def sized(k: str) -> dict:
        row, how = ((kernels[k], "its compiled rate with the adapters' Triton kernels") if k in kernels else
                    (rows[k], "its compiled rate") if k in rows else
                    ({**eager[k], "compile_s": guess}, "its eager rate: setup measured it eager only"))
        return {"tokens_per_s": row["tokens_per_s"], "sized_by": how, "compile_s": row.get("compile_s", guess)}

    option = {**compiled["option"], **({"lora.kernel": ADAPTER_KERNEL} if kernels else {})}
    return {"option": option, "models": {k: sized(k) for k in KINDS}, "faster": faster,
            "lora_kernel": ADAPTER_KERNEL if kernels else "matmuls", "lora_kernel_why": kernels_why}, ""


def kernel_alternative(measured: dict) -> tuple[dict, str]:
    """`setup`'s compiled rows with the adapters in Triton kernels (``--lora-kernel triton``; the training target's
    pair, streaming and dense), if quality should train with them: each model measured both ways faster with the
    kernels, none of their rows failed; ``({kind: row}, why)``, ``({}, why not)``."""
    compiled = measured.get("compiled") or {}
    rows, kernels = compiled.get("models") or {}, ((compiled.get("lora_kernel") or {}).get("models") or {})
    failed = sorted(label for label in (measured.get("failed") or {}) if label.endswith(f"compiled {ADAPTER_KERNEL}"))
    if failed:
        return {}, f"the adapters' Triton kernels failed in `setup` ({', '.join(failed)}): the matmuls"
    both = [k for k in kernels if k in rows]
    if not both:
        return {}, "`setup` measured no compiled pair with the adapters' Triton kernels and with the matmuls"
    ratios = {k: kernels[k]["tokens_per_s"] / rows[k]["tokens_per_s"] for k in both}
    said = ", ".join(f"{k} {r:.2f}x" for k, r in sorted(ratios.items()))
    if min(ratios.values()) <= 1:
        return {}, f"the adapters' Triton kernels were not faster than the matmuls in `setup` ({said}): the matmuls"
    return dict(kernels), f"the adapters' Triton kernels were faster than the matmuls in `setup` ({said})"


def choose_training(measured: dict, available: float, cap: float, choice: str = "auto") -> dict:
    """Eager or compiled, all three models alike (``choice``, ``--compile``): ``auto``, compiled where `setup`
    measured a compiled row faster than its eager one and compiled training fits more tokens per model into
    ``available`` seconds, its compilations counted (both at ``cap``: the one that takes fewer seconds); ``on``,
    compiled wherever `setup` measured it faster; ``off``, eager. ``{mode, option, models: {kind: {ran,
    tokens_per_s, sized_by, compile_s}}, tokens_fit: {eager, compiled}, why}``."""
    eager = {k: {"tokens_per_s": measured["models"][k]["tokens_per_s"], "sized_by": "its eager rate", "compile_s": 0.0}
             for k in KINDS}
    alternative, why = compiled_alternative(measured) if choice != "off" else (None, "--compile off")

    def fit(models: dict) -> tuple[float, float]:  # tokens per model that fit (capped), -seconds for those
        per_token = seconds_per_token({k: m["tokens_per_s"] for k, m in models.items()})
        compile_s = sum(m["compile_s"] for m in models.values())
        tokens = max(0.0, min(cap, (available - compile_s) / per_token))
        return tokens, -(tokens * per_token + compile_s)

    fits = {"eager": fit(eager)}
    if alternative:
        fits["compiled"] = fit(alternative["models"])
        better = choice == "on" or fits["compiled"] > fits["eager"]
        why = (f"compiled was faster in `setup` ({', '.join(alternative['faster'])}); {fits['compiled'][0]:.3g} tokens "
               f"per model fit compiled, {fits['eager'][0]:.3g} eager, the compilations "
               f"({sum(m['compile_s'] for m in alternative['models'].values()):.0f} s) counted; --compile {choice}; "
               f"{alternative['lora_kernel_why']}")
    mode = "compiled" if alternative and better else "eager"
    chosen = alternative["models"] if mode == "compiled" else eager
    return {"mode": mode, "option": alternative["option"] if mode == "compiled" else None, "choice": choice,
            "lora_kernel": alternative["lora_kernel"] if mode == "compiled" else "matmuls",
            "models": {k: {"ran": mode, **m} for k, m in chosen.items()},
            "tokens_fit": {name: round(f[0]) for name, f in fits.items()}, "why": why}


def run_point(stage: Stage, plan: dict, point: dict) -> None:
    runs = folder(stage) / "runs"
    res = run_logged(stage, python_cmd(*frontier_args(stage, plan, point["splits"], point["ratios"], point["baselines"])),
                     env=kit_env(stage.work, stage.dry), deadline=stage.deadline() - 20)
    if res["returncode"] == 0 and (runs / "frontier.json").is_file():
        point["state"] = "complete"
        write_json(folder(stage) / f"{point['name']}.json", json.loads((runs / "frontier.json").read_text()))
    elif res["interrupted"]:
        point["state"] = "interrupted"
        stage.skip(f"the rest of point {point['name']}", "this call's time budget ran out (checkpoints are saved): "
                                                          "run `quality` again to resume")
    else:
        point["state"] = "failed"
        stage.problem(f"`concept frontier` for point {point['name']} exited with code {res['returncode']} (quality.log)")


def merged(stage: Stage, plan: dict) -> dict | None:
    """The completed points' frontier results as one (rows of later points appended once)."""
    results = [read_json(folder(stage) / f"{p['name']}.json") for p in plan["points"] if p["state"] == "complete"]
    results = [r for r in results if r]
    if not results:
        return None
    combined = dict(results[0])
    names = {r["run"] for r in combined["rows"]}
    combined["rows"] = list(combined["rows"]) + [r for res in results[1:] for r in res["rows"] if r["run"] not in names]
    return combined


def metrics(stage: Stage) -> dict[str, list[dict]]:
    """Every run's logged steps so far (``metrics.jsonl``), complete or not, by run name."""
    out = {}
    for path in sorted((folder(stage) / "runs").glob("*/metrics.jsonl")):
        out[path.parent.name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def progress(runs: dict[str, list[dict]], plan: dict) -> list[dict]:
    """How far each run got: step, tokens seen, the last train loss and held-out NLL; for a run with a static
    concept budget, what the budget dropped of its policy's boundaries (``capped``, per token, over the logged
    steps: its mean, its most, and the last tenth's mean: whether the cap binds as training goes on)."""
    out = []
    for name, rows in runs.items():
        last_eval = next((r["eval"] for r in reversed(rows) if r.get("eval")), {})
        step = rows[-1]["step"] if rows else 0
        out.append({"run": name, "step": step, "steps": plan["steps"], "tokens": step * plan["tokens_per_step"],
                    "loss": rows[-1]["loss"] if rows else None, "heldout_nll": last_eval.get("nll"),
                    **capped_summary(rows)})
    return out


def capped_summary(rows: list[dict]) -> dict:
    """``capped`` (the policy's boundaries the static budget dropped, per token) over a run's logged steps: mean,
    most and the last tenth's mean; {} for a run that logs none (a baseline, or no budget)."""
    values = [float(r["capped"]) for r in rows if r.get("capped") is not None]
    if not values:
        return {}
    tail = values[-max(1, len(values) // 10):]
    return {"capped_mean": sum(values) / len(values), "capped_max": max(values),
            "capped_last_tenth": sum(tail) / len(tail)}


def curves(stage: Stage, runs: dict[str, list[dict]], plan: dict) -> str | None:
    """Train loss and held-out NLL against tokens seen, one line per run: ``quality-curves.png``."""
    if not any(runs.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from concept import fs

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, rows in runs.items():
        axes[0].plot([r["step"] * plan["tokens_per_step"] for r in rows], [r["loss"] for r in rows], lw=0.8, label=name)
        evals = [(r["step"] * plan["tokens_per_step"], r["eval"]["nll"]) for r in rows if r.get("eval")]
        if evals:
            axes[1].plot(*zip(*evals), "o-", ms=3, lw=1, label=name)
    for ax, title in zip(axes, ("train loss (nats / token)", "held-out NLL, training data's split (nats / token)")):
        ax.set_title(title)
        ax.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = stage.out / "quality-curves.png"
    try:
        fs.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path.name


def next_point(stage: Stage, plan: dict) -> dict | None:
    """The next point to train, or None; a later point that no longer fits the minutes left is skipped."""
    for i, point in enumerate(plan["points"]):
        if point["state"] in ("complete", "skipped", "failed"):
            continue
        needed = plan.get("estimate_s", {}).get(point["name"], 0)
        left = plan["total_minutes"] * 60 - plan["used_s"]
        if i and point["state"] == "planned" and needed > left:
            point.update(state="skipped", reason=f"the quality minutes left ({left / 60:.1f}) do not fit it "
                                                 f"(~{needed / 60:.1f} minutes)")
            continue
        return point
    return None


def run(stage: Stage, args) -> int:
    if needs_setup(stage):
        return stage.finish({})
    if not stage.dry and not smollm2_ready(stage.work):
        stage.problem("SmolLM2 is not set up on this machine: make every set-up call first, then `quality`")
        return stage.finish({})
    plan_path = folder(stage) / "plan.json"
    plan = read_json(plan_path)
    if plan is None:
        plan = make_plan(stage, args)
        write_json(plan_path, plan)
        stage.say(f"plan: {plan['tokens_per_model']:.3g} tokens per model ({plan['steps']} steps of "
                  f"{plan['tokens_per_step']}); points: " + ", ".join(f"{p['name']} ({p['state']})" for p in plan["points"]))
    else:
        stage.say(f"continuing the plan of {plan['created_at']} ({plan['used_s'] / 60:.1f} of {plan['total_minutes']} "
                  f"minutes used)")
    while (point := next_point(stage, plan)) is not None:
        if stage.remaining() < 60:
            stage.skip(f"point {point['name']}", "this call's time budget ran out: run `quality` again to continue")
            break
        start = time.monotonic()
        run_point(stage, plan, point)
        plan["used_s"] += time.monotonic() - start
        write_json(plan_path, plan)
        if point["state"] != "complete":
            break
    for point in plan["points"]:
        if point["state"] == "skipped":
            stage.skip(f"point {point['name']}", point["reason"])
    write_json(plan_path, plan)
    result = merged(stage, plan)
    runs = metrics(stage)
    from concept.recipes.frontier import markdown_table

    out = {"plan": plan, "points": [{k: p.get(k) for k in ("name", "splits", "ratios", "flop_ratio", "state", "reason")}
                                    for p in plan["points"]],
           "complete": all(p["state"] in ("complete", "skipped") for p in plan["points"]),
           "runs": progress(runs, plan), "frontier": result, "table": markdown_table(result) if result else None,
           "curves": curves(stage, runs, plan)}
    return stage.finish(out)
