"""The corruption sweep: every file of one run of each kind, damaged in each of six ways, read by every command
that reads it. Expected: no traceback; a refusal is exit 1 with one error line, and leaves the folder as it
was (SHA-256 of every file before and after); a file a command must trust (the records, the weights, the
checkpoint's state) is refused by it.

Kinds: a build, a trained run, a planner-executor run, a pruned baseline, an export, a frontier folder.
Damage: zero bytes; the first half; a flipped byte (in a weights file's header); a key removed (a tensor of a
weights file); a wrong type (an integer tensor); another build's file (of the same name, from a model of other
dimensions). Commands: inspect, eval, export, generate, ``train SRC --out``, ``train --resume``, a frontier
re-run; each in-process (click's runner), the training loop itself skipped (everything is read before the
first step; damage only the model can tell is asked of one of the four commands that load through
``concept.load``, in turn, and a harmless one of one command, in turn: the whole cross product takes minutes).
``make test`` runs it (``tests/test_corruption_sweep.py``); the table in docs/reliability.md::

    .venv/bin/python -m benchmarks.corruption_sweep --write docs/reliability.md
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BEGIN, END = "<!-- corruption:begin -->", "<!-- corruption:end -->"
STDLIB = Path(os.__file__).parent
TINY = ["--backbone", "tiny-llama", "--split", "1,2,1", "--set", "backbone.layers=4", "--set", "backbone.hidden=32",
        "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=32"]
OTHER = ["--backbone", "tiny-llama", "--split", "1,1,1", "--set", "backbone.layers=3", "--set", "backbone.hidden=48",
         "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=16"]
PE = ["--family", "planner-executor", "--backbone", "tiny-llama", "--set", "backbone.layers=3", "--set",
      "backbone.hidden=32", "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set",
      'planner.types=[{"name":"topic","size":8,"max_len":2},{"name":"gist","size":16,"max_len":4}]']
FAST = ["--data", "code.jsonl", "--steps", "2", "--seq-len", "16", "--batch", "2", "--lora-rank", "2",
        "--eval-batches", "1", "--eval-every", "100", "--checkpoint-every", "2"]
FR = ["frontier", "--backbone", "tiny-llama", "--build-set", "backbone.layers=4", "--build-set", "backbone.hidden=32",
      "--build-set", "backbone.heads=2", "--build-set", "backbone.kv_heads=1", "--build-set", "vocabulary.size=32",
      "--splits", "1,2,1", "--ratios", "0.5", "--baselines", "none", "--steps", "1", "--seq-len", "16", "--batch",
      "2", "--eval-batches", "1", "--eval-batch", "2", "--data", "code.jsonl", "--eval-data", "code=heldout.txt",
      "--no-controls", "--out", "{run}"]

# kind -> (the folder, the commands that set it up, the folder whose same-named files are "another build's")
KINDS = {
    "build": ("m", [["build", *TINY, "--no-calibrate", "-o", "m"]], "m2"),
    "trained": ("run", [["train", "m", *FAST, "--out", "run"]], "run2"),
    "planner-executor": ("pe-run", [["build", *PE, "-o", "pe"],
                                    ["train", "pe", "--task", "reconstruct", *FAST, "--out", "pe-run"]], "run2"),
    "pruned": ("pruned", [["train", "m", "--baseline", "pruned", *FAST, "--out", "pruned"]], "run2"),
    "export": ("exp", [["export", "run", "--out", "exp", "--no-check"]], "exp2"),
    "frontier": ("fr", [[a.replace("{run}", "fr") for a in FR]], "run2"),
}
OTHERS = [["build", *OTHER, "--no-calibrate", "-o", "m2"],
          ["train", "m2", *FAST, "--lora-rank", "4", "--out", "run2"],  # (the last --lora-rank counts)
          ["export", "run2", "--out", "exp2", "--no-check"]]
# a frontier folder: its own files, and those of its run a re-run reads (the run's other files: "trained")
FRONTIER_FILES = ("frontier.json", "builds/s1-2-1/concept.json", "builds/s1-2-1/modules.safetensors",
                  "s1-2-1_r0.5/concept.json", "s1-2-1_r0.5/train.json", "s1-2-1_r0.5/frontier-eval.json",
                  "s1-2-1_r0.5/checkpoint/state.json", "s1-2-1_r0.5/checkpoint/modules.safetensors")

EVAL = ["--data", "heldout.txt", "--batches", "1", "--batch", "1", "--seq-len", "8", "--no-controls"]
TRAIN_FROM = ["--data", "code.jsonl", "--steps", "1", "--seq-len", "8", "--batch", "1", "--eval-batches", "1",
              "--lora-rank", "2"]
# command -> argv ({run}: the damaged folder; {out}: a new folder outside it)
COMMANDS = {
    "inspect": ["inspect", "{run}", "--seq-len", "16", "--json"],
    "eval": ["eval", "{run}", *EVAL],
    "export": ["export", "{run}", "--out", "{out}", "--no-check"],
    "generate": ["generate", "{run}", "--prompt", "def f(", "--max-new-tokens", "1"],
    "train --out": ["train", "{run}", *TRAIN_FROM, "--out", "{out}"],
    "train --resume": ["train", "{run}", "--resume", "--steps", "3"],
    "frontier": FR,
}
READERS = {  # kind -> the commands that read it (--resume: the trained run's; the other kinds resume alike)
    "build": ("inspect", "eval", "export", "generate", "train --out"),
    "trained": ("inspect", "eval", "export", "generate", "train --out", "train --resume"),
    "planner-executor": ("inspect", "eval", "export", "generate", "train --out"),
    "pruned": ("inspect", "eval", "export", "generate", "train --out"),
    "export": ("inspect", "eval", "export", "generate", "train --out"),
    "frontier": ("frontier",),
}
LOADERS = ("inspect", "eval", "export", "generate")  # each reads the run through concept.load
EXTRA = {("planner-executor", "train --out"): ["--task", "reconstruct"],
         ("pruned", "train --out"): ["--baseline", "pruned"]}
DAMAGES = ("zero bytes", "half", "flipped byte", "key removed", "wrong type", "another build's")
# a JSON file's key that "key removed" drops and "wrong type" retypes (else its first key)
KEYS = {"concept.json": "config", "train.json": "steps", "state.json": "step", "adapter_config.json": "r",
        "config.json": "hidden_size", "frontier-eval.json": "domains", "frontier.json": "rows"}
# files no reader trusts: logs, plots, caches, model cards (a reader may ignore, rebuild or refuse them)
UNTRUSTED = ("curves.png", "planner.png", "frontier.png", "frontier.md", "README.md", "frontier.json",
             "frontier-eval.json", "ratio_control.json", "generation_config.json")
# an export's remote-code files at its top: read by transformers' Auto classes, never by concept's commands
REMOTE_CODE = ("config.json", "configuration_concept.py", "modeling_concept.py")
RESUME_ONLY = ("trainer.pt",)  # read by --resume only
METRICS_READERS = ("eval", "export", "train --resume")


def invoke(argv: list[str]):
    from click.testing import CliRunner

    from concept_cli.main import cli

    return CliRunner().invoke(cli, argv, catch_exceptions=True)


@contextlib.contextmanager
def no_training():
    """Skip the training loop (``Trainer.train`` returns at once) and the frontier's plot: a command has read
    everything by then, and a sweep of reading is neither a sweep of training nor of drawing."""
    from concept.recipes.frontier import reporting
    from concept.training import Trainer

    train, plot = Trainer.train, reporting.plot
    Trainer.train = lambda self, progress=None: {}
    reporting.plot = lambda result, path: path
    try:
        yield
    finally:
        Trainer.train, reporting.plot = train, plot


def setup(root: Path) -> None:
    """Data, the run of each kind and the other model's runs, in ``root`` (the working folder)."""
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py", "fnmatch.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (root / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "heldout.txt").write_text("\n".join(docs[:3]))
    for _, argvs, _ in KINDS.values():
        for argv in argvs:
            result = invoke(argv)
            assert result.exit_code == 0, (argv, result.output)
    for argv in OTHERS:
        result = invoke(argv)
        assert result.exit_code == 0, (argv, result.output)


def files_of(kind: str, folder: Path) -> list[str]:
    """The files of the kind's folder that the sweep damages: all of them for a build, a trained run and an
    export; of a planner-executor run and a pruned baseline, those read differently than a trained run's (the
    records and the weights; their logs, plots and optimizer state are the trained run's kind of file)."""
    if kind == "frontier":
        return [f for f in FRONTIER_FILES if (folder / f).is_file()]
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    if kind in ("planner-executor", "pruned"):
        files = [f for f in files if f.endswith((".safetensors", "concept.json", "train.json", "state.json"))
                 and not f.startswith("adapter/")]
    return files


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): ("<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*"))}


# -- damage -------------------------------------------------------------------------------------
def _tensors(file: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(file))


def _write_tensors(file: Path, tensors: dict, metadata=None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata=metadata)


def _metadata(file: Path):
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.metadata()


def _retyped(value):
    return 5 if isinstance(value, str) else "not a number" if isinstance(value, (int, float)) else "not an object"


def applies(rel: str, how: str) -> bool:
    """Whether damage ``how`` exists for a file like ``rel`` (a key or a type: of JSON and weights files)."""
    return how not in ("key removed", "wrong type") or rel.endswith((".json", ".jsonl", ".safetensors"))


def damage(file: Path, how: str, other: Path | None) -> bool:
    """Damage ``file`` in place; False where the damage does not apply to this kind of file."""
    data = file.read_bytes()
    suffix = file.suffix
    if how == "zero bytes":
        file.write_bytes(b"")
    elif how == "half":
        file.write_bytes(data[:len(data) // 2])
    elif how == "flipped byte":
        at = len(data) // 2
        if suffix == ".safetensors":  # in the header (the data has no checksum: a flip there is invisible)
            at = 8 + int.from_bytes(data[:8], "little") // 2
        file.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    elif how in ("key removed", "wrong type") and suffix == ".safetensors":
        tensors = _tensors(file)
        name = sorted(tensors)[0]
        if how == "key removed":
            del tensors[name]
        else:
            tensors[name] = tensors[name].to(__import__("torch").int32)
        _write_tensors(file, tensors, _metadata(file))
    elif how in ("key removed", "wrong type") and suffix == ".json":
        value = json.loads(data)
        if not isinstance(value, dict) or not value:
            return False
        key = KEYS.get(file.name) if KEYS.get(file.name) in value else next(iter(value))
        if how == "key removed":
            del value[key]
        else:
            value[key] = _retyped(value[key])
        file.write_text(json.dumps(value))
    elif how in ("key removed", "wrong type") and suffix == ".jsonl":
        lines = data.decode().splitlines()
        if not lines:
            return False
        row = json.loads(lines[-1])
        if how == "key removed":
            row.pop("step", None)
        else:
            row = [row.get("step")]
        file.write_text("\n".join([*lines[:-1], json.dumps(row)]) + "\n")
    elif how == "another build's":
        if other is None or not other.is_file() or other.read_bytes() == data:
            return False
        shutil.copyfile(other, file)
    else:
        return False
    return True


# -- expectations -------------------------------------------------------------------------------
def must_refuse(kind: str, rel: str, how: str, command: str) -> bool:
    """Whether ``command`` must refuse the folder with ``rel`` damaged ``how`` (else any clean outcome)."""
    name = rel.rsplit("/", 1)[-1]
    if name in UNTRUSTED or rel in REMOTE_CODE:
        return False
    if rel.startswith("adapter/") and kind != "export":  # a trained run's adapters for peft users: a copy
        return False
    if kind == "pruned" and rel == "modules.safetensors":  # its build's modules, which a baseline does not have
        return False
    if name in RESUME_ONLY:
        return command == "train --resume"
    if name == "metrics.jsonl":  # an empty log is a fresh run's; a torn last line, a killed writer's
        return command in METRICS_READERS and how in ("flipped byte", "key removed", "wrong type")
    if name == "state.json" and how == "another build's":  # (the same step: nothing tells them apart)
        return False
    if kind == "frontier":  # a re-run checks each run's files; a run it need not train reads no build
        return not rel.startswith("builds/")
    return True


def case_row(kind: str, rel: str, how: str, command: str, result, before: dict, after: dict) -> dict:
    exc = result.exception
    traceback = exc is not None and not isinstance(exc, SystemExit)
    text = (result.stderr or "").strip().splitlines()
    errors = [i for i, line in enumerate(text) if line.startswith(("error:", "Error:"))]
    one_line = len(errors) == 1 and errors[0] == len(text) - 1
    if result.exit_code == 2 and len(errors) == 1 and text[errors[0]] == "error: invalid config (1 problem):":
        one_line = errors[0] == len(text) - 2  # a conflict with the command's own options: exit 2, one problem
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    refused = result.exit_code != 0
    ok = (not traceback and (not refused or (result.exit_code in (1, 2) and one_line and not changed))
          and (refused or not must_refuse(kind, rel, how, command))
          and (refused or command in ("train --resume", "frontier") or not changed))
    return {"kind": kind, "file": rel, "damage": how, "command": command, "exit": result.exit_code,
            "traceback": traceback, "one_line": one_line, "changed": changed, "ok": ok,
            "expected": "refuse" if must_refuse(kind, rel, how, command) else "any",
            "message": f"{type(exc).__name__}: {exc}"[:300] if traceback else (text[errors[0]] if errors else
                                                                                  (text[-1] if text else ""))[:300]}


def cases(root: Path) -> list[tuple]:
    """(kind, file, damage, command) of the whole sweep: every command that must refuse the damaged file, and one
    of those that need not (in turn: a file no reader trusts leaves every command as an undamaged one does, so one
    of them, a different one each time, shows that it is harmless; the whole cross product would take minutes)."""
    out, turn = [], collections.Counter()
    for kind, (name, _, other) in KINDS.items():
        for rel in files_of(kind, root / name):
            for how in (how for how in DAMAGES if applies(rel, how)):
                refusing = [c for c in READERS[kind] if must_refuse(kind, rel, how, c)]
                if model_checked(rel, how) and set(LOADERS) <= set(refusing):  # one loader, in turn, for them all
                    loader = LOADERS[turn[kind, "loader"] % len(LOADERS)]
                    turn[kind, "loader"] += 1
                    refusing = [c for c in refusing if c not in LOADERS or c == loader]
                rest = [c for c in READERS[kind] if not must_refuse(kind, rel, how, c)]
                if rest:
                    refusing.append(rest[turn[kind] % len(rest)])
                    turn[kind] += 1
                out += [(kind, rel, how, command) for command in READERS[kind] if command in refusing]
    return out


def model_checked(rel: str, how: str) -> bool:
    """Damage only the model can tell (a weights file whose header reads well, another build's record): the
    loaders find it in the same place (``concept.load``'s checks of names, shapes and dtypes), after building the
    model (a fifth of a second each), so the sweep asks one of them, a different one each time."""
    return (rel.endswith(".safetensors") and how in ("key removed", "wrong type", "another build's")) or (
        rel.endswith("concept.json") and how == "another build's")


def run_case(root: Path, kind: str, rel: str, how: str, commands: list[str]) -> list[dict]:
    """Damage ``rel`` of a copy of the kind's run ``how``; run each command on the copy."""
    name, _, other_name = KINDS[kind]
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    damaged = work / name
    shutil.copytree(root / name, damaged, symlinks=True)
    other = (root / other_name / rel) if kind != "frontier" else _frontier_other(root, rel)
    if not damage(damaged / rel, how, other):
        return []
    rows = []
    for command in commands:
        before = snapshot(damaged)
        argv = [a.replace("{run}", str(damaged)).replace("{out}", str(work / "new")) for a in COMMANDS[command]]
        argv[2:2] = EXTRA.get((kind, command), [])
        began = time.perf_counter()
        with no_training():
            result = invoke(argv)
        rows.append(case_row(kind, rel, how, command, result, before, snapshot(damaged)))
        rows[-1]["seconds"] = round(time.perf_counter() - began, 3)
        shutil.rmtree(work / "new", ignore_errors=True)
        for leftover in work.glob(".new*"):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        if result.exit_code == 0 and command in ("train --resume", "frontier"):  # it wrote: start again from a copy
            shutil.rmtree(damaged)
            shutil.copytree(root / name, damaged, symlinks=True)
            damage(damaged / rel, how, other)
    return rows


def _frontier_other(root: Path, rel: str) -> Path | None:
    head, _, tail = rel.partition("/")
    if head == "builds":
        return root / "m2" / rel.rsplit("/", 1)[-1]
    return root / "run2" / tail if tail else None


def sweep(root: Path, only: list[tuple] | None = None) -> list[dict]:
    """Every case (or ``only`` those ``(kind, file, damage)``), from the folder ``setup`` filled."""
    grouped = collections.defaultdict(list)
    for kind, rel, how, command in cases(root):
        if only is None or (kind, rel, how) in only:
            grouped[kind, rel, how].append(command)
    rows = []
    for (kind, rel, how), commands in grouped.items():
        rows += run_case(root, kind, rel, how, commands)
    return rows


def markdown(rows: list[dict], command_line: str, seconds: float) -> str:
    by = collections.defaultdict(list)
    for r in rows:
        by[r["kind"]].append(r)
    lines = [f"Command: `{command_line}` ({time.strftime('%Y-%m-%d')}, {len(rows)} cases in {seconds:.0f} s).", "",
             "| run | files | cases | must refuse | refused in one line | read fine (exit 0) | tracebacks | "
             "refusals that changed the folder | failed: readers | failed: `--resume` |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, rs in list(by.items()) + [("**all**", rows)]:
        resume = [r for r in rs if r["command"] == "train --resume"]
        lines.append(f"| {kind} | {len({(r['kind'], r['file']) for r in rs})} | {len(rs)} | "
                     f"{sum(r['expected'] == 'refuse' for r in rs)} | {sum(r['exit'] != 0 and r['one_line'] for r in rs)} | "
                     f"{sum(r['exit'] == 0 for r in rs)} | {sum(r['traceback'] for r in rs)} | "
                     f"{sum(bool(r['changed']) and r['exit'] != 0 for r in rs)} | "
                     f"{sum(not r['ok'] for r in rs if r not in resume)} | {sum(not r['ok'] for r in resume)} |")
    commands = collections.Counter(r["command"] for r in rows)
    damages = collections.Counter(r["damage"] for r in rows)
    lines += ["", "By command: " + ", ".join(f"{c} {n}" for c, n in commands.items()) + ".",
              "By damage: " + ", ".join(f"{d} {n}" for d, n in damages.items()) + "."]
    bad = [r for r in rows if not r["ok"]]
    if bad:
        lines += ["", "<details><summary>The cases that failed</summary>", "",
                  "| run | file | damage | command | exit | expected | what happened |", "|---|---|---|---|---:|---|---|"]
        for r in bad:
            what = r["message"].replace("|", "/")
            if r["changed"]:
                what += f" (changed: {', '.join(r['changed'][:3])})"
            lines.append(f"| {r['kind']} | {r['file']} | {r['damage']} | {r['command']} | {r['exit']} | "
                         f"{r['expected']} | {what[:200]} |")
        lines += ["", "</details>"]
    return "\n".join(lines)


def write_block(path: Path, block: str) -> None:
    from concept import fs

    try:
        fs.write_atomic(path, fs.replace_marked(path.read_text(), BEGIN, END, block))
    except ValueError as exc:
        raise SystemExit(f"{path} {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help=f"replace the {BEGIN} block of this file with the report")
    parser.add_argument("--json", type=Path, help="also write every row as JSON here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cwd = Path.cwd()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="concept-corruption-") as tmp:
        root = Path(tmp)
        os.chdir(root)
        try:
            setup(root)
            rows = sweep(root)
        finally:
            os.chdir(cwd)
    seconds = time.perf_counter() - start
    report = markdown(rows, "python -m benchmarks.corruption_sweep --write docs/reliability.md", seconds)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        write_block(args.write, report)
    else:
        print(report)
    return 1 if any(not r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
