"""Host syncs per training step of every recipe and objective option (``concept.syncs.HostSyncs``, CPU, tiny
backbones): the streaming family with its options on (``--usage-weight``, ``--placement``, ``--revive-after``,
``--kmeans-init``, ``--distill``, ``--align``, ``--mtp``), the pruned and dense baselines, and the
planner-executor family. Each recipe runs ``--steps`` queued steps (the first included: its calibration and
k-means initialisation) with the step log read outside the counter; the table gives the hidden syncs per step
(by op and by the line of ``concept/`` or ``plugins/`` code that made them) and the declared points; the step
log's read after each step is counted apart (an objective with an ``after_step`` acts there, on the host).

    python benchmarks/step_syncs.py                 # the table (markdown)
    python benchmarks/step_syncs.py --json          # the counts as JSON
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import traceback
import warnings
from collections import Counter

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import concept  # noqa: E402
from concept import BuildConfig, ComponentRef  # noqa: E402
from concept.syncs import HostSyncs  # noqa: E402
from concept.training import TrainConfig, Trainer  # noqa: E402

TINY = {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64}
STDLIB = pathlib.Path(warnings.__file__).parent
PLANNER_TYPES = [{"name": "topic", "size": 8, "max_len": 2}, {"name": "gist", "size": 16, "max_len": 4}]


def builds() -> dict[str, BuildConfig]:
    """The tiny builds the recipes start from (codebooks: codes that can be revived)."""
    streaming = dict(backbone=ComponentRef("tiny-llama", TINY), split="1,2,1",
                     attention=ComponentRef("chunked", {"chunk": 16}))
    codebook = ComponentRef("codebook", {"size": 64, "code_dim": 8})
    planner = dict(backbone=ComponentRef("tiny-llama", {**TINY, "layers": 3}), family="planner-executor",
                   position_scheme=ComponentRef("per-type"), vocabulary=ComponentRef("codebook", {"code_dim": 8}))
    return {"streaming": BuildConfig(**streaming, vocabulary=ComponentRef("embedding", {"size": 32})),
            "codebook": BuildConfig(**streaming, vocabulary=codebook),
            "codebook-2-levels": BuildConfig(**streaming, vocabulary=ComponentRef(
                "codebook", {"size": 16, "code_dim": 8, "levels": 2})),
            "fixed": BuildConfig(**streaming, vocabulary=ComponentRef("embedding", {"size": 32}),
                                 length_policy=ComponentRef("fixed", {"every": 4})),
            "threshold": BuildConfig(**streaming, vocabulary=ComponentRef("embedding", {"size": 32}),
                                     length_policy=ComponentRef("threshold")),
            "planner": BuildConfig(**planner, sections={"planner": {"types": PLANNER_TYPES}}),
            "planner-mtp": BuildConfig(**planner, sections={"planner": {"types": PLANNER_TYPES, "mtp": 2}}),
            "planner-parallel": BuildConfig(**planner, sections={"planner": {"types": PLANNER_TYPES,
                                                                             "parallel": True}})}


CONTINUE = dict(task="continue", context_len=12, seq_len=24)
# recipe -> (build, TrainConfig overrides); revive_after 2: steps 2 and 4 are revival steps
RECIPES = {
    "streaming (default: null policy, PI + ratio loss)": ("streaming", {}),
    "streaming --ratio-control pi": ("streaming", dict(ratio_control="pi")),
    "streaming --ratio-control none": ("streaming", dict(ratio_control="none")),
    "streaming, fixed policy": ("fixed", {}),
    "streaming, threshold policy": ("threshold", {}),
    "streaming --usage-weight 0.1": ("streaming", dict(usage_weight=0.1)),
    "streaming --placement 0.5": ("streaming", dict(placement=0.5)),
    "streaming --distill 1 --align 0.5": ("streaming", dict(distill=1.0, align=0.5)),
    "streaming codebook --revive-after 2": ("codebook", dict(revive_after=2)),
    "streaming codebook --kmeans-init 1": ("codebook", dict(kmeans_init=1)),
    "streaming 2-level codebook --usage-weight 0.1 --revive-after 2 --kmeans-init 1": (
        "codebook-2-levels", dict(usage_weight=0.1, revive_after=2, kmeans_init=1)),
    "pruned": ("streaming", dict(baseline="pruned")),
    "dense --distill 1 --align 0.5 --mtp 0.5 --mtp-heads 2": (
        "streaming", dict(baseline="dense", distill=1.0, align=0.5, align_at="final", mtp=0.5, mtp_heads=2)),
    "planner-executor (reconstruct)": ("planner", {}),
    "planner-executor (continue)": ("planner", CONTINUE),
    "planner-executor --usage-weight 0.1": ("planner", dict(CONTINUE, usage_weight=0.1)),
    "planner-executor --revive-after 2 --kmeans-init 1": ("planner", dict(CONTINUE, revive_after=2, kmeans_init=1)),
    "planner-executor, MTP concepts (planner.mtp 2)": ("planner-mtp", CONTINUE),
    "planner-executor, parallel types": ("planner-parallel", CONTINUE),
    "planner-executor --plan-training hard-em": ("planner", dict(CONTINUE, plan_training="hard-em", estep_every=2)),
    "planner-executor --plan-training hard-em, MTP concepts": (
        "planner-mtp", dict(CONTINUE, plan_training="hard-em", estep_every=2)),
    "planner-executor --plan-training hard-em, parallel types": (
        "planner-parallel", dict(CONTINUE, plan_training="hard-em", estep_every=2)),
}


def corpus(folder: pathlib.Path) -> pathlib.Path:
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    path = folder / "code.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


class Where(HostSyncs):
    """``HostSyncs`` that also notes the innermost line of ``concept/`` or ``plugins/`` code of each hidden sync."""

    def __init__(self):
        super().__init__()
        self.where: Counter = Counter()

    def _sync(self, name: str) -> None:
        before = self.hidden
        super()._sync(name)
        if self.hidden > before:
            ours = ("/concept/", "/plugins/")
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/concept/syncs.py" not in f.filename and any(part in f.filename for part in ours)]
            at = frames[-1] if frames else None
            self.where[f"{name} @ {pathlib.Path(at.filename).relative_to(ROOT)}:{at.lineno}" if at else name] += 1


def count(recipe: str, folder: pathlib.Path, data: pathlib.Path, steps: int) -> dict:
    build, overrides = RECIPES[recipe]
    base = dict(steps=steps + 2, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100,
                warmup=1, data=str(data), lora=concept.lora.LoraSettings(rank=2))
    config = TrainConfig(**{**base, **overrides})
    torch.manual_seed(0)
    trainer = Trainer.start(folder / "builds" / build, folder / "runs" / recipe.replace(" ", "_"), config, force=True)
    steps_seen, logs_seen = [], []
    for _ in range(steps):
        with Where() as seen:
            trainer.queue_step()
        with Where() as read:
            trainer.read_log()  # (the declared step log, and the objectives that act on it: ``after_step``)
        steps_seen.append(seen)
        logs_seen.append(read)
    return {"recipe": recipe, "hidden": [s.hidden for s in steps_seen],
            "where": dict(sum((s.where for s in steps_seen + logs_seen), Counter())),
            "declared": [dict(s.declared) for s in steps_seen],
            "log_hidden": [s.hidden for s in logs_seen], "log_declared": [dict(s.declared) for s in logs_seen]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="queued steps counted per recipe (the first included)")
    parser.add_argument("--only", default=None, help="the recipes whose name contains this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        data = corpus(folder)
        for name, cfg in builds().items():
            torch.manual_seed(0)
            concept.save(concept.build(cfg), folder / "builds" / name)
        for recipe in RECIPES:
            if args.only is None or args.only in recipe:
                results.append(count(recipe, folder, data, args.steps))
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("| recipe | hidden syncs per step (steps 1..n) | declared per step | hidden / declared per log read | where "
          "(op @ line: count over the steps) |")
    print("|---|---|---|---|---|")
    for r in results:
        where = "; ".join(f"{k}: {v}" for k, v in sorted(r["where"].items())) or "-"
        declared = " / ".join(", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-" for d in r["declared"])
        logs = " / ".join(f"{h} / {sum(d.values())}" for h, d in zip(r["log_hidden"], r["log_declared"]))
        print(f"| {r['recipe']} | {' / '.join(map(str, r['hidden']))} | {declared} | {logs} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
