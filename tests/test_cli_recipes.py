"""Recipe files (--config FILE.yaml / .json for build, train, eval, frontier), --print-config, the shipped
recipes and --help grouped by owner (issue 42, item 3)."""
import json
import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from concept_cli.main import cli

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# `make demo` as the Makefile spelt it in flags before recipes/demo.yaml (the recipe must resolve the same)
DEMO_TRAIN = ["--steps", "30", "--seq-len", "128", "--batch", "4", "--lr", "3e-3", "--lr-new", "3e-3", "--warmup", "3",
              "--target-ratio", "0.125", "--eval-every", "30", "--eval-batches", "2", "--checkpoint-every", "30"]
DEMO_EVAL = ["runs/demo-train", "runs/demo-pruned", "runs/demo-dense", "--data", "stdlib", "--data", "pydoc",
             "--batches", "6", "--batch", "4", "--show-map"]
# the frontier of docs/frontier.md (and docs/results.md), in flags
FRONTIER = ["--splits", "4,22,4;6,18,6;8,14,8;10,10,10", "--ratios", "0.5,0.25", "--steps", "30", "--seq-len", "128",
            "--batch", "4", "--lr", "1e-3", "--lr-new", "3e-3", "--distill", "1", "--ratio-warmup", "0.3",
            "--eval-data", "stdlib", "--eval-data", "pydoc", "--eval-batches", "8", "--eval-batch", "4",
            "-o", "runs/frontier"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def printed(*args) -> dict:
    r = run(*args, "--print-config")
    assert r.exit_code == 0, r.output
    return yaml.safe_load(r.stdout)


def test_train_recipe_round_trip_and_flags_override_the_file(tmp_path):
    flags = ["runs/m1", "-o", "runs/m1-x", "--steps", "7", "--lora-rank", "2", "--data", "corpus/",
             "--baseline", "pruned", "--prune-layers", "1:3"]
    recipe = printed("train", *flags)
    assert recipe["run_dir"] == "runs/m1" and recipe["output"] == "runs/m1-x" and recipe["lora"]["rank"] == 2
    assert recipe["baseline"] == "pruned" and "lora_rank" not in recipe  # train.json's sections
    saved = tmp_path / "r.yaml"
    saved.write_text(yaml.safe_dump(recipe))
    assert printed("train", "--config", saved) == recipe  # the same run config
    changed = printed("train", "--config", saved, "--steps", "9", "--lora-rank", "4")
    assert changed == {**recipe, "steps": 9, "lora": {**recipe["lora"], "rank": 4}}  # the flags win
    assert printed("train", "runs/other", "--config", saved)["run_dir"] == "runs/other"
    as_json = tmp_path / "r.json"
    as_json.write_text(json.dumps({"train": recipe}))  # a JSON file, its train: section
    assert printed("train", "--config", as_json) == recipe


def test_an_unknown_key_is_named_with_the_nearest_valid_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stpes: 3\n  lora:\n    rnak: 2\n")
    r = run("train", "runs/x", "--config", bad)
    assert r.exit_code == 2
    assert "unknown key 'stpes'. Did you mean 'steps'?" in r.stderr
    assert "unknown key 'lora.rnak'. Did you mean 'lora.rank'?" in r.stderr
    bad.write_text("build: {}\ntrian:\n  steps: 3\n")  # (a file with sections: each must be a command)
    r = run("train", "runs/x", "--config", bad)
    assert r.exit_code == 2 and "unknown section 'trian'. Did you mean 'train'?" in r.stderr
    bad.write_text("eval_batchs: 3\n")
    r = run("eval", "runs/x", "--config", bad)
    assert r.exit_code == 2 and "Did you mean 'eval_batches'?" in r.stderr
    bad.write_text("steps: [3\n")
    r = run("train", "runs/x", "--config", bad)
    assert r.exit_code == 2 and "not valid YAML at line 2" in r.stderr and "Traceback" not in r.output
    bad.write_text("target_ratoi: 0.2\n")
    r = run("build", "--config", bad, "--dry-run")
    assert r.exit_code == 2 and "Did you mean 'target_ratio'?" in r.stderr
    r = run("train", "runs/x", "--resume", "--config", RECIPES / "demo.yaml")
    assert r.exit_code == 2 and "drop --config" in r.stderr


def test_build_reads_a_yaml_recipe_with_its_family_options_and_output(tmp_path):
    recipe = tmp_path / "b.yaml"
    recipe.write_text("backbone: tiny-llama\nstreaming:\n  split: 2,4,2\n  sampler: {name: gumbel-st, params: {tau: 0.7}}"
                      "\ntarget_ratio: 0.2\noutput: runs/t\n")
    got = printed("build", "--config", recipe)
    streaming = got["streaming"]  # (the streaming family's build options: a section of their own)
    assert streaming["split"] == "2,4,2" and streaming["sampler"]["params"] == {"tau": 0.7}
    assert got["target_ratio"] == 0.2 and got["output"] == "runs/t"
    assert "split" not in got and "sampler" not in got
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(got))
    assert printed("build", "--config", again) == got  # round trip
    flags = printed("build", "--config", again, "--split", "1,6,1", "--target-ratio", "0.3")
    assert flags == {**got, "streaming": {**streaming, "split": "1,6,1"}, "target_ratio": 0.3}
    # a recipe written flat (before the sections: format 2) reads the same; negative control: another split differs
    flat = tmp_path / "flat.yaml"
    flat.write_text("backbone: tiny-llama\nsplit: 2,4,2\nsampler: {name: gumbel-st, params: {tau: 0.7}}\n"
                    "target_ratio: 0.2\noutput: runs/t\n")
    assert printed("build", "--config", flat) == got
    flat.write_text(flat.read_text().replace("2,4,2", "1,6,1"))
    assert printed("build", "--config", flat) != got
    r = run("build", "--config", recipe, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["split"] == {"shallow": 2, "middle": 4, "deep": 2}


def test_the_demo_recipe_resolves_to_the_demo_flags():
    demo = RECIPES / "demo.yaml"
    assert printed("train", "--config", demo, "-o", "runs/demo-train") == printed(
        "train", "runs/demo", "-o", "runs/demo-train", *DEMO_TRAIN)
    for baseline in ("pruned", "dense"):
        assert printed("train", "--config", demo, "--baseline", baseline) == printed(
            "train", "runs/demo", "--baseline", baseline, *DEMO_TRAIN)
    assert printed("eval", "--config", demo) == printed("eval", *DEMO_EVAL)
    assert printed("build", "--config", demo) == printed("build", "-o", "runs/demo")
    makefile = (RECIPES.parent / "Makefile").read_text()
    assert makefile.count("--config $(DEMO)") == 5 and "DEMO := recipes/demo.yaml" in makefile


def test_the_frontier_recipe_resolves_to_the_documented_command(tmp_path):
    recipe = printed("frontier", "--config", RECIPES / "frontier.yaml")
    assert recipe == printed("frontier", *FRONTIER)
    saved = tmp_path / "f.yaml"
    saved.write_text(yaml.safe_dump(recipe))
    assert printed("frontier", "--config", saved) == recipe
    base = tmp_path / "base.json"  # a bare build config: the builds start from it, as before
    base.write_text(json.dumps({"backbone": "tiny-llama", "split": "2,4,2"}))
    assert printed("frontier", "--config", base)["build"]["backbone"]["name"] == "tiny-llama"


def test_help_is_grouped_by_owner():
    for name, sections in (("train", ("Options", "Data", "LoRA adapters", "Evaluation, checkpoints and logs",
                                      "Device and precision", "Streaming family", "Planner-executor family")),
                           ("build", ("Options", "Model", "Streaming family", "Streaming family: components",
                                      "Streaming family: calibration")),
                           ("frontier", ("Options", "Data", "LoRA adapters", "Streaming family")),
                           ("eval", ("Options", "Data", "Evaluation, checkpoints and logs", "Device and precision",
                                     "Downstream tasks (--tasks, lm-eval)"))):
        text = run(name, "--help").stdout
        found = re.findall(r"^(\S[^\n]*):$", text, flags=re.M)
        assert all(s in found for s in sections), (name, found)
        flags = re.findall(r"^  (?:-\w, )?(--[\w-]+)", text[text.index("\nOptions:"):], flags=re.M)
        assert len(flags) == len(set(flags))  # each option once
    text = run("train", "--help").stdout
    lora = text.split("LoRA adapters:")[1].split("\n\n")[0]
    assert "--lora-rank" in lora and "--lora-targets" in lora and "--steps" not in lora
    assert "--task " in text.split("Planner-executor family:")[1]
    # eval's options shared with train are in train's sections, from the same declarations (CoreTrainConfig's groups)
    train, evals = (sections_of(run(name, "--help").stdout) for name in ("train", "eval"))
    shared = ["--data", "--data-split", "--seq-len", "--text-field", "--eval-batches", "--log-every", "--device",
              "--compile"]
    assert [evals[f] for f in shared] == [train[f] for f in shared]
    assert evals["--batch"] == evals["--json"] == "Options" != train["--batch"]  # (train's catch-all: not eval's)


def sections_of(text: str) -> dict[str, str]:
    """Flag -> the --help section it is listed in."""
    found, section = {}, None
    for line in text.splitlines():
        if re.match(r"^\S[^\n]*:$", line):
            section = line[:-1]
        elif (flag := re.match(r"^  (?:-\w, )?(--[\w-]+)", line)) and section:
            found[flag.group(1)] = section
    return found
