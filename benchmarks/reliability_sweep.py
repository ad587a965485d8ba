"""A bad-input sweep of every command, the way a new user tries things: count tracebacks (target 0) and
files damaged (target none).

Each input runs in-process (click's runner) inside a scratch folder that already holds data files, a
build, trained runs of both families, an export and a frontier. A traceback is any exception that is not
a clean exit; damage is any file that existed before the input and changed or vanished, outside the one
folder the input is allowed to write. The table and the per-input listing go to stdout as markdown, or
into the marked block of a file::

    .venv/bin/python -m benchmarks.reliability_sweep                        # print
    .venv/bin/python -m benchmarks.reliability_sweep --write docs/reliability.md
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"
STDLIB = Path(os.__file__).parent
TINY = ["--backbone", "tiny-llama", "--split", "1,2,1", "--set", "backbone.layers=4", "--set", "backbone.hidden=32",
        "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=32"]
PE = ["--family", "planner-executor", "--backbone", "tiny-llama", "--set", "backbone.layers=3", "--set",
      "backbone.hidden=32", "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set",
      'planner.types=[{"name":"topic","size":8,"max_len":2},{"name":"gist","size":16,"max_len":4}]']
FAST = ["--seq-len", "32", "--batch", "2", "--lora-rank", "2", "--eval-batches", "1", "--eval-every", "100",
        "--checkpoint-every", "2", "--calibration-batches", "1"]
PE_FAST = FAST[:-2]  # a planner-executor run refuses the streaming family's --calibration-batches
FR = ["--backbone", "tiny-llama", "--build-set", "backbone.layers=4", "--build-set", "backbone.hidden=32",
      "--build-set", "backbone.heads=2", "--build-set", "backbone.kv_heads=1", "--build-set", "vocabulary.size=32",
      "--splits", "1,2,1", "--ratios", "0.5", "--baselines", "none", "--steps", "1", "--seq-len", "16", "--batch",
      "2", "--eval-batches", "1", "--eval-batch", "2", "--data", "code.jsonl", "--eval-data", "code=code.jsonl",
      "--no-controls", "--out", "fr"]


def scratch(root: Path) -> None:
    """Data files of every kind a user may pass, and the runs the inputs act on."""
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py", "fnmatch.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (root / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "notext.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    (root / "badline.jsonl").write_text('{"text": "a"}\n{not json\n')
    (root / "empty.txt").write_text("")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (root / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 500)
    (root / "short.txt").write_text("x = 1\n")
    (root / "emptydir").mkdir()
    (root / "prompts.txt").write_text("def add(a, b):\n")
    (root / "noprompts.txt").write_text("\n\n")
    (root / "notarun").mkdir()
    (root / "notarun" / "concept.json").write_text("{broken")
    (root / "doc.md").write_text("# no markers\n")
    from transformers import LlamaConfig, LlamaForCausalLM  # a local Hugging Face model folder, inside hfproj/

    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(root / "hfproj" / "bb")
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(root / "ds-empty"))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "ds"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(root / "dsd"))
    for argv in (["build", *TINY, "-o", "m"], ["train", "m", "--data", "code.jsonl", "--steps", "2", *FAST, "--out", "run"],
                 ["build", *PE, "-o", "pe"],
                 ["train", "pe", "--task", "reconstruct", "--data", "code.jsonl", "--steps", "2", *PE_FAST, "--out",
                  "pe-run"],
                 ["export", "run", "--out", "exp"], ["frontier", *FR]):
        result = invoke(argv)
        assert result.exit_code == 0, (argv, result.output)
    damaged(root)


def damaged(root: Path) -> None:
    """Copies of the runs with one file damaged or replaced, as issue 43 found them (and whitespace-only data,
    a bench baseline store)."""
    import shutil

    (root / "ws.txt").write_text("  \n\n\t \n")
    for name, source in (("nulltrain", "run"), ("badsection", "run"), ("otherbackbone", "run"), ("badmetrics", "run"),
                         ("zeromodules", "m"), ("fr-damaged", "fr")):
        shutil.copytree(root / source, root / name)
    (root / "nulltrain" / "train.json").write_text("null")
    record = json.loads((root / "badsection" / "concept.json").read_text())
    (root / "badsection" / "concept.json").write_text(json.dumps({**record, "config": {**record["config"], "sampler": 5}}))
    shutil.copyfile(root / "pe" / "backbone.safetensors", root / "otherbackbone" / "backbone.safetensors")
    (root / "badmetrics" / "metrics.jsonl").write_text("[1, 2]\n" + (root / "run" / "metrics.jsonl").read_text())
    (root / "zeromodules" / "modules.safetensors").write_bytes(b"")
    (root / "fr-damaged" / "s1-2-1_r0.5" / "train.json").write_text("{x")
    (root / "bench-store" / "this-machine").mkdir(parents=True)
    (root / "bench-store" / "this-machine" / "0001_base.json").write_text("{}")


# (command, argv, the folder it may write or None); every input below is something a user could type
CASES = [
    # build
    ("build", ["build", "--backbone", "no-such-backbone", "-o", "x"], None),
    ("build", ["build", *TINY, "--split", "9,9,9", "-o", "x"], None),
    ("build", ["build", *TINY, "--split", "a,b,c", "-o", "x"], None),
    ("build", ["build", *TINY, "--split", "0,4,0", "-o", "x"], None),
    ("build", ["build", *TINY, "--length-policy", "nul", "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "sampler.tau=-1", "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "vocabulary.size=0", "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "novalue", "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "slot.key=1", "--set", "other.k=2", "-o", "x"], None),
    ("build", ["build", *TINY, "--target-ratio", "0", "-o", "x"], None),
    ("build", ["build", *TINY, "--target-ratio", "1.5", "-o", "x"], None),
    ("build", ["build", *TINY, "--target-ratio", "nan", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-batches", "0", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-data", "nosuch.txt", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-data", "empty.txt", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-data", "ds-empty", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-data", "binary.bin", "-o", "x"], None),
    ("build", ["build", *TINY, "-o", "code.jsonl"], None),
    ("build", ["build", *TINY, "-o", "run"], None),
    ("build", ["build", *TINY, "-o", "run", "--force", "--calibration-data", "run/metrics.jsonl"], None),
    ("build", ["build", *TINY, "--seed", "5", "-o", "m"], None),
    ("build", ["build", *TINY, "--config", "nosuch.json", "-o", "x"], None),
    ("build", ["build", *TINY, "--config", "notarun", "-o", "x"], None),
    ("build", ["build", *TINY, "--config", "badline.jsonl", "-o", "x"], None),
    ("build", ["build", *TINY], None),
    ("build", ["build", "--family", "planner-executor", "--backbone", "tiny-llama", "--set", "planner.types=[]",
               "-o", "x"], None),
    ("build", ["build", *PE, "--set", "planner.budget=-2", "-o", "x"], None),
    ("build", ["build", *TINY, "--attention", "flexx", "-o", "x"], None),
    ("build", ["build", *TINY, "--dry-run"], None),
    ("build", ["build", *PE, "--target-ratio", "0.2", "-o", "x"], None),
    ("build", ["build", *PE, "--no-calibrate", "--calibration-batches", "3", "-o", "x"], None),
    ("build", ["build", "--backbone", "hf", "--set", "backbone.path=hfproj/bb", "--split", "1,1,1", "-o", "hfproj",
               "--force"], None),
    ("build", ["build", "--backbone", "hf", "--set", "backbone.path=hfproj/nothere", "--split", "1,1,1", "-o", "x"],
     None),
    ("build", ["build", *TINY, "--seed", str(10 ** 23), "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "sampler.tau=inf", "-o", "x"], None),
    ("build", ["build", *TINY, "--set", "vocabulary.size=100000000000", "-o", "x"], None),
    ("build", ["build", *TINY, "--calibration-data", "", "-o", "x"], None),
    ("build", ["build", *TINY, "-o", "new-build", "--json"], "new-build"),
    # inspect
    ("inspect", ["inspect", "nosuch"], None),
    ("inspect", ["inspect", "code.jsonl"], None),
    ("inspect", ["inspect", "notarun"], None),
    ("inspect", ["inspect", "emptydir"], None),
    ("inspect", ["inspect", "m", "--ratio", "0"], None),
    ("inspect", ["inspect", "m", "--ratio", "2"], None),
    ("inspect", ["inspect", "m", "--seq-len", "0"], None),
    ("inspect", ["inspect", "pe", "--json"], None),
    ("inspect", ["inspect", "nulltrain"], None),
    ("inspect", ["inspect", "badsection"], None),
    ("inspect", ["inspect", "otherbackbone"], None),
    ("inspect", ["inspect", "run", "--ratio", "nan"], None),
    ("inspect", ["inspect", "run"], None),
    # train
    ("train", ["train", "nosuch", "--out", "x"], None),
    ("train", ["train", "notarun", "--out", "x"], None),
    ("train", ["train", "m", "--data", "nosuch.txt", "--out", "x"], None),
    ("train", ["train", "m", "--data", "empty.txt", "--out", "x"], None),
    ("train", ["train", "m", "--data", "emptydir", "--out", "x"], None),
    ("train", ["train", "m", "--data", "binary.bin", "--out", "x"], None),
    ("train", ["train", "m", "--data", "latin1.txt", "--steps", "1", *FAST, "--out", "x"], None),
    ("train", ["train", "m", "--data", "notext.jsonl", "--out", "x"], None),
    ("train", ["train", "m", "--data", "badline.jsonl", "--out", "x"], None),
    ("train", ["train", "m", "--data", "short.txt", "--seq-len", "512", "--out", "x"], None),
    ("train", ["train", "m", "--data", "ds-empty", "--out", "x"], None),
    ("train", ["train", "m", "--data", "dsd", "--out", "x"], None),
    ("train", ["train", "m", "--data", "dsd:test", "--out", "x"], None),
    ("train", ["train", "m", "--data", "ds:train", "--out", "x"], None),
    ("train", ["train", "m", "--steps", "0", "--out", "x"], None),
    ("train", ["train", "m", "--steps", "-5", "--out", "x"], None),
    ("train", ["train", "m", "--batch", "0", "--out", "x"], None),
    ("train", ["train", "m", "--seq-len", "1", "--out", "x"], None),
    ("train", ["train", "m", "--seq-len", "100000", "--out", "x"], None),
    ("train", ["train", "m", "--lr", "-1", "--out", "x"], None),
    ("train", ["train", "m", "--lr", "nan", "--out", "x"], None),
    ("train", ["train", "m", "--target-ratio", "0", "--out", "x"], None),
    ("train", ["train", "m", "--target-ratio", "2", "--out", "x"], None),
    ("train", ["train", "m", "--warmup", "-1", "--out", "x"], None),
    ("train", ["train", "m", "--min-lr", "2", "--out", "x"], None),
    ("train", ["train", "m", "--grad-accum", "0", "--out", "x"], None),
    ("train", ["train", "m", "--lora-rank", "0", "--out", "x"], None),
    ("train", ["train", "m", "--lora-targets", "nothing", "--data", "code.jsonl", "--out", "x"], None),
    ("train", ["train", "m", "--lora-dropout", "1.5", "--out", "x"], None),
    ("train", ["train", "m", "--device", "cuda", "--out", "x"], None),
    ("train", ["train", "m", "--device", "tpu", "--out", "x"], None),
    ("train", ["train", "m", "--curriculum", "bad", "--out", "x"], None),
    ("train", ["train", "m", "--prune-layers", "3:1", "--baseline", "pruned", "--out", "x"], None),
    ("train", ["train", "m", "--prune-layers", "1:3", "--out", "x"], None),
    ("train", ["train", "m", "--task", "continue", "--out", "x"], None),
    ("train", ["train", "m", "--plan-training", "hard-em", "--out", "x"], None),
    ("train", ["train", "pe", "--baseline", "pruned", "--data", "code.jsonl", "--out", "x"], None),
    ("train", ["train", "pe", "--placement", "1", "--out", "x"], None),
    ("train", ["train", "pe", "--task", "continue", "--context-len", "32", "--seq-len", "32", "--out", "x"], None),
    ("train", ["train", "m", "--data", "code.jsonl", "--out", "run"], None),
    ("train", ["train", "m", "--data", "code.jsonl", "--out", "m"], None),
    ("train", ["train", "m", "--data", "code.jsonl", "--out", ".", "--force"], None),
    ("train", ["train", "m", "--data", "run/metrics.jsonl", "--out", "run", "--force"], None),
    ("train", ["train", "m", "--data", "nosuch.txt", "--out", "run", "--force"], None),
    ("train", ["train", "m", "--data", "code.jsonl", "--out", "code.jsonl", "--force"], None),
    ("train", ["train", "run", "--data", "code.jsonl", "--out", "run"], None),
    ("train", ["train", "run", "--resume", "--out", "other"], None),
    ("train", ["train", "m", "--resume"], None),
    ("train", ["train", "run", "--resume", "--steps", "5", "--device", "cuda"], None),
    ("train", ["train", "run", "--resume", "--lr", "0.5"], None),
    ("train", ["train", "run", "--resume", "--seq-len", "64"], None),
    ("train", ["train", "run", "--resume", "--steps", "1"], None),
    ("train", ["train", "run", "--resume", "--data", "nosuch.txt", "--steps", "5"], None),
    ("train", ["train", "run", "--resume", "--batch", "3", "--steps", "5"], None),
    ("train", ["train", "exp", "--resume"], None),
    ("train", ["train", "m", "--lr", "inf", "--out", "x"], None),
    ("train", ["train", "m", "--lora-alpha", "nan", "--out", "x"], None),
    ("train", ["train", "m", "--ratio-loss-weight", "nan", "--out", "x"], None),
    ("train", ["train", "m", "--tau-start", "inf", "--out", "x"], None),
    ("train", ["train", "m", "--seed", str(10 ** 23), "--out", "x"], None),
    ("train", ["train", "m", "--device", "meta", "--out", "x"], None),
    ("train", ["train", "m", "--device", "mps", "--out", "x"], None),
    ("train", ["train", "m", "--seq-len", "16", "--batch", "100000000", "--out", "x"], None),
    ("train", ["train", "m", "--data", "", "--out", "x"], None),
    ("train", ["train", "m", "--data", "ws.txt", "--out", "x"], None),
    ("train", ["train", "zeromodules", "--data", "code.jsonl", "--out", "x"], None),
    ("train", ["train", "run", "--data", "code.jsonl", "--out", "x"], None),
    ("train", ["train", "nulltrain", "--resume", "--steps", "5"], None),
    ("train", ["train", "m", "--data", "code.jsonl", "--steps", "1", *FAST, "--out", "new-run", "--json"], "new-run"),
    # eval
    ("eval", ["eval", "nosuch"], None),
    ("eval", ["eval", "notarun"], None),
    ("eval", ["eval", "run", "--batch", "0"], None),
    ("eval", ["eval", "run", "--batches", "0"], None),
    ("eval", ["eval", "run", "--batches", "-1", "--json"], None),
    ("eval", ["eval", "run", "--seq-len", "0"], None),
    ("eval", ["eval", "run", "--seq-len", "100000"], None),
    ("eval", ["eval", "run", "--data", "nosuch.txt"], None),
    ("eval", ["eval", "run", "--data", "empty.txt"], None),
    ("eval", ["eval", "run", "--data", "ds-empty"], None),
    ("eval", ["eval", "run", "--data", "binary.bin"], None),
    ("eval", ["eval", "run", "--data", "notext.jsonl"], None),
    ("eval", ["eval", "run", "--data", "code.jsonl", "--text-field", "nothere"], None),
    ("eval", ["eval", "run", "--data", "latin1.txt", "--encoding-errors", "strict"], None),
    ("eval", ["eval", "run", "--device", "cuda"], None),
    ("eval", ["eval", "run", "--device", "gpu9"], None),
    ("eval", ["eval", "run", "m", "--data", "short.txt", "--batches", "1", "--batch", "1", "--json"], None),
    ("eval", ["eval", "pe-run", "--data", "code.jsonl", "--batches", "1", "--batch", "2", "--show-map"], None),
    ("eval", ["eval", "run", "--tasks", "concept_clozee"], None),
    ("eval", ["eval", "run", "--tasks", "concept_cloze", "--limit", "0"], None),
    ("eval", ["eval", "run", "--tasks", "concept_cloze", "--include-path", "nosuch-dir"], None),
    ("eval", ["eval", "notarun", "--tasks", "concept_cloze", "--limit", "2"], None),
    ("eval", ["eval", "run", "--tasks", ",", "--json"], None),
    ("eval", ["eval", "run", "pe-run", "--tasks", "concept_docstring_name", "--limit", "2", "--json"], None),
    ("eval", ["eval", "run", "--seq-len", "5000"], None),
    ("eval", ["eval", "run", "--batch", "100000000"], None),
    ("eval", ["eval", "run", "--data", ""], None),
    ("eval", ["eval", "run", "--device", "xpu"], None),
    ("eval", ["eval", "nulltrain"], None),
    ("eval", ["eval", "badmetrics"], None),
    ("eval", ["eval", "run", "--tasks", "concept_cloze", "--num-fewshot", "100000", "--limit", "1"], None),
    ("eval", ["eval", "--tasks", "list"], None),
    # lm-eval (its own command line, with the concept model)
    ("lm-eval", ["lm-eval", "run", "--model", "concept", "--model_args", "run=nosuch", "--tasks", "concept_cloze"],
     None),
    ("lm-eval", ["lm-eval", "run", "--model", "concept", "--model_args", "pretrained=run", "--tasks", "concept_cloze"],
     None),
    ("lm-eval", ["lm-eval", "run", "--model", "concept", "--model_args", "run=run", "--tasks", "nosuch_task"], None),
    ("lm-eval", ["lm-eval", "--model", "concept", "--model_args", "run=run,batch_size=0", "--tasks", "concept_cloze",
                 "--limit", "1"], None),
    # export
    ("export", ["export", "nosuch", "--out", "x"], None),
    ("export", ["export", "notarun", "--out", "x"], None),
    ("export", ["export", "run", "--out", "run"], None),
    ("export", ["export", "run", "--out", "."], None),
    ("export", ["export", "run", "--out", "code.jsonl"], None),
    ("export", ["export", "run", "--out", "exp"], None),
    ("export", ["export", "nulltrain", "--out", "x"], None),
    ("export", ["export", "badmetrics", "--out", "x"], None),
    ("export", ["export", "otherbackbone", "--out", "x"], None),
    ("export", ["export", "run"], None),
    ("export", ["export", "m", "--out", "m-exp", "--merge-lora", "--json"], "m-exp"),
    ("export", ["export", "pe-run", "--out", "pe-exp", "--json"], "pe-exp"),
    # generate
    ("generate", ["generate", "run"], None),
    ("generate", ["generate", "nosuch", "--prompt", "x"], None),
    ("generate", ["generate", "run", "--prompt", ""], None),
    ("generate", ["generate", "run", "--prompt-file", "nosuch.txt"], None),
    ("generate", ["generate", "run", "--prompt-file", "noprompts.txt"], None),
    ("generate", ["generate", "run", "--prompt-file", "binary.bin"], None),
    ("generate", ["generate", "run", "--prompt-file", "badline.jsonl"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--max-new-tokens", "0"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--max-new-tokens", "-3"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--temperature", "-1"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--top-p", "2"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--top-k", "-1"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--repetition-penalty", "0"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--batch-size", "0"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--mtp", "verify"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--show-plan"], None),
    ("generate", ["generate", "pe-run", "--prompt", "x", "--show-concepts"], None),
    ("generate", ["generate", "pe-run", "--prompt", "abc" * 1400], None),
    ("generate", ["generate", "run", "--prompt", "x", "--temperature", "nan"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--seed", str(10 ** 23), "--temperature", "0.5"], None),
    ("generate", ["generate", "run", "--prompt-file", "emptydir"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--device", "xpu"], None),
    ("generate", ["generate", "run", "--prompt", "x", "--device", "cuda"], None),
    ("generate", ["generate", "run", "--prompt", "def f(", "--max-new-tokens", "4", "--json"], None),
    ("generate", ["generate", "pe-run", "--prompt-file", "prompts.txt", "--max-new-tokens", "4", "--show-plan"], None),
    # bench
    ("bench", ["bench", "--smoke", "--save", "x"], None),
    ("bench", ["bench", "--compare", "never-saved", "-k", "nothing"], None),
    ("bench", ["bench", "--fail-on", "fast:5%"], None),
    ("bench", ["bench", "--device", "cuda"], None),
    ("bench", ["bench", "--suite", "forward", "-k", "no_such_case", "--save", "x", "--storage", "bench-store"], None),
    ("bench", ["bench", "--suite", "forward", "-k", "no_such_case", "--compare", "base", "--fail-on", "mean:1%",
               "--storage", "bench-store"], None),
    ("bench", ["bench", "--suite", "nope"], None),
    # frontier
    ("frontier", ["frontier", "--splits", " ; ", "--dry-run"], None),
    ("frontier", ["frontier", "--ratios", "0,2", "--dry-run"], None),
    ("frontier", ["frontier", *FR[:-2], "--out", "fr", "--lr", "0.5"], None),
    ("frontier", ["frontier", *FR[:-2], "--out", "code.jsonl"], None),
    ("frontier", ["frontier", *FR, "--update-doc", "doc.md"], None),
    ("frontier", ["frontier", *FR, "--update-doc", "nosuch.md"], None),
    ("frontier", ["frontier", *FR, "--train-set", "lr_nwe=1"], None),
    ("frontier", ["frontier", *FR, "--eval-data", "nosuch-corpus"], None),
    ("frontier", ["frontier", *FR, "--baselines", "pruned,dens"], None),
    ("frontier", ["frontier", *FR[:-2], "--out", "./fr-damaged"], None),
    ("frontier", ["frontier", *FR, "--dry-run", "--json"], None),
    # plugins
    ("plugins", ["plugins", "list", "--kind", "nope"], None),
    ("plugins", ["plugins", "list", "--json"], None),
    ("plugins", ["nosuchcommand"], None),
]


def invoke(argv: list[str]):
    from click.testing import CliRunner

    from concept_cli.main import cli

    return CliRunner().invoke(cli, argv, catch_exceptions=True)


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): ("<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


def first_line(result) -> str:
    """The error line (with the first problem of a config error), else the last status line."""
    text = (result.stderr or result.output or "").strip().splitlines()
    at = next((i for i, line in enumerate(text) if line.startswith(("error:", "Error:"))), None)
    line = text[at] if at is not None else (text[-1] if text else "")
    if at is not None and line.endswith(":") and at + 1 < len(text):
        line += " " + text[at + 1].strip()
    return line[:160].replace("|", "\\|")


ABBREVIATIONS = {"$TINY": TINY, "$PE": PE, "$FAST": FAST, "$FR": FR}


def shown(argv: list[str]) -> str:
    """``argv`` as a shell line, the long shared option lists written as their names."""
    text = " ".join(argv)
    for name, options in ABBREVIATIONS.items():
        text = text.replace(" ".join(options), name)
    return text if len(text) < 120 else text[:117] + "..."


def sweep(root: Path, cases: list | None = None) -> list[dict]:
    rows = []
    for command, argv, writes in CASES if cases is None else cases:
        before = snapshot(root)
        start = time.perf_counter()
        result = invoke(argv)
        seconds = time.perf_counter() - start
        after = snapshot(root)
        allowed = (lambda rel: writes is not None and (rel == writes or rel.startswith(writes + "/")))
        damaged = [rel for rel, digest in before.items() if after.get(rel) != digest and not allowed(rel)]
        litter = [rel for rel in after if rel not in before and not allowed(rel)]
        exc = result.exception
        traceback = exc is not None and not isinstance(exc, SystemExit)
        rows.append({"command": command, "input": shown(argv),
                     "exit": result.exit_code, "traceback": traceback,
                     "error": f"{type(exc).__name__}: {exc}"[:150] if traceback else first_line(result),
                     "damaged": damaged, "litter": litter, "seconds": round(seconds, 2)})
        print(f"{rows[-1]['exit']:>3} {'TRACEBACK ' if traceback else ''}{'DAMAGE ' if damaged else ''}"
              f"{rows[-1]['input'][:90]}", file=sys.stderr)
    return rows


def markdown(rows: list[dict], command_line: str) -> str:
    by = collections.defaultdict(list)
    for r in rows:
        by[r["command"]].append(r)
    lines = [f"Command: `{command_line}` ({time.strftime('%Y-%m-%d')}, {len(rows)} inputs).", "",
             "| command | inputs | exit 0 | exit 1 | exit 2 | other exits | tracebacks | files damaged | stray files |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for command, rs in list(by.items()) + [("**all**", rows)]:
        codes = collections.Counter(r["exit"] for r in rs)
        other = sum(n for c, n in codes.items() if c not in (0, 1, 2))
        lines.append(f"| {command} | {len(rs)} | {codes[0]} | {codes[1]} | {codes[2]} | {other} | "
                     f"{sum(r['traceback'] for r in rs)} | {sum(len(r['damaged']) for r in rs)} | "
                     f"{sum(len(r['litter']) for r in rs)} |")
    lines += ["", "<details><summary>Every input, its exit code and the first line it printed</summary>", "",
              "`$TINY`, `$PE`, `$FAST`, `$FR`: the tiny streaming build, planner-executor build, training and "
              "frontier options of `benchmarks/reliability_sweep.py`.", "",
              "| command | input | exit | first line |", "|---|---|---:|---|"]
    for r in rows:
        flag = " **traceback**" if r["traceback"] else ""
        lines.append(f"| {r['command']} | `{r['input'].replace('|', '/')}` | {r['exit']}{flag} | {r['error']} |")
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
    with tempfile.TemporaryDirectory(prefix="concept-sweep-") as tmp:
        root = Path(tmp)
        os.chdir(root)
        try:
            scratch(root)
            rows = sweep(root)
        finally:
            os.chdir(cwd)
    report = markdown(rows, "python -m benchmarks.reliability_sweep --write docs/reliability.md")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        write_block(args.write, report)
    else:
        print(report)
    bad = sum(r["traceback"] for r in rows) + sum(len(r["damaged"]) for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
