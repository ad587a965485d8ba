"""One name per concept across the commands (old spellings hidden but still parsed), --device auto everywhere,
concept markers that survive a pipe, and outputs that say what they measure (issue 42, item 7)."""
import json
import re

import click
import pytest
from click.testing import CliRunner

from concept.baselines import describe_prune
from concept.flops import Shape, matched_prune
from concept_cli.main import cli
from concept_cli.output import marked_plain
from tests.test_training import built, corpus  # noqa: F401  (fixtures)

# (command, the shown spelling, the old hidden one, the parameter, the arguments it needs besides)
RENAMED = [("train", "--output", "--out", "out", ["RUN"]), ("export", "--output", "--out", "out", ["RUN"]),
           ("frontier", "--output", "--out", "out", []), ("generate", "--batch", "--batch-size", "batch_size", ["RUN"]),
           ("eval", "--eval-batches", "--batches", "batches", []), ("eval", "--tasks-limit", "--limit", "limit", []),
           ("serve", "--max-new-tokens", "--max-tokens", "max_tokens", ["RUN"])]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def options_of(name: str) -> list[click.Option]:
    command = cli.commands[name]
    with click.Context(command, info_name=name) as ctx:
        return [p for p in command.get_params(ctx) if isinstance(p, click.Option)]


@pytest.mark.parametrize("name,new,old,param,args", RENAMED, ids=[f"{r[0]}{r[2]}" for r in RENAMED])
def test_a_renamed_option_shows_its_new_name_and_still_parses_the_old_one(name, new, old, param, args):
    command = cli.commands[name]
    shown = run(name, "--help").stdout
    assert re.search(rf"{re.escape(new)}\b", shown) and not re.search(rf"{re.escape(old)}\b(?!-)", shown)
    value = "runs/x" if param == "out" else "3"
    for spelling in (new, old):
        ctx = command.make_context(name, [*args, spelling, value])
        assert str(ctx.params[param]) == value, spelling


def test_the_old_spelling_says_the_new_one():
    r = run("eval", "--limit", 3)  # (refused: no --tasks; the note comes first)
    assert "note: --limit is now --tasks-limit" in r.stderr and "--tasks-limit and --num-fewshot go with --tasks" in r.stderr
    r = run("eval", "--tasks-limit", 3)
    assert "note:" not in r.stderr
    r = run("eval", "--tasks", "concept_cloze", "--limit", 0)  # an error names the shown spelling only
    assert "'--tasks-limit'" in r.stderr and "'--limit'" not in r.stderr.split("note:")[-1].split("\n", 1)[1]


def test_every_command_names_an_output_folder_and_the_device_the_same_way():
    for name in cli.commands:
        if name == "lm-eval":  # (lm-eval's own argument parser, passed through)
            continue
        for option in options_of(name):
            if option.name in ("out", "output"):
                assert option.opts[:2] == ["-o", "--output"], (name, option.opts)
            if option.name == "device":
                # (frontier's options are unset, None, so that TrainConfig's default applies: its help names it)
                assert option.default == "auto" or "[default: auto]" in option.help, name
            if option.name == "batch_size":
                assert "--batch" in option.opts, name


def test_concept_marks_survive_a_pipe():
    from rich.text import Text

    text = Text("a")
    text.append("bc", style="bold reverse")
    text.append("d\n")
    text.append("concept", style="bold reverse")
    text.append(" = legend", style="dim")
    assert marked_plain(text) == "a[[bc]]d\n[[concept]] = legend"


def test_eval_show_map_in_a_pipe_and_as_html(built):  # noqa: F811
    r = run("eval", built, "--eval-batches", 1, "--batch", 2, "--seq-len", 32, "--no-controls", "--show-map")
    assert r.exit_code == 0, r.output
    assert "\x1b[" not in r.stdout  # no terminal styling in a pipe
    legend = re.search(r"\[\[concept\]\] = token emitted a concept; ratio \S+ \((\d+) concepts / (\d+) tokens\)", r.stdout)
    assert legend, r.stdout
    shown = r.stdout[:legend.start()]
    assert shown.count("[[") == shown.count("]]") == int(legend.group(1))  # each concept token marked once
    r = run("eval", built, "--eval-batches", 1, "--batch", 2, "--seq-len", 32, "--no-controls", "--show-map", "html")
    assert r.exit_code == 0, r.output
    page = r.stdout
    assert page.lstrip().startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "held-out evaluation" in page and "compression map" in page and "<span style=" in page  # tables and map
    r = run("eval", built, "--show-map", "html", "--json")
    assert r.exit_code == 2 and "choose one" in r.stderr


def test_train_says_how_many_tokens_it_trains_on_and_the_corpus_size():
    from concept_cli.train_cmd import training_line
    from concept.train_config import TrainConfig

    line = training_line(TrainConfig(steps=10, batch=4, seq_len=32, grad_accum=2), 4, 8, 123_456)
    assert line == ("steps 4->10, 4x2x32 tokens/step, 1,536 tokens to train on (from a corpus of 123,456 tokens)")
    curriculum = training_line(TrainConfig(steps=4, batch=1, seq_len=32, curriculum="8:0.5"), 0, 1, 10)
    assert "92 tokens to train on" in curriculum  # rows of 8, 20, 32, 32 tokens (curriculum_len)
    # (the command's line: test_an_empty_pruned_block_is_said_and_the_run_is_not_called_dense)

def test_an_empty_pruned_block_is_said_and_the_run_is_not_called_dense(built, corpus, tmp_path):  # noqa: F811
    tiny = Shape(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=256)
    plan = matched_prune(tiny, (1, 2, 1), 4097, 0.9, 32)  # a head dearer than every layer: nothing removed
    assert plan.removed[0] == plan.removed[1]
    text = describe_prune(plan, "the streaming model's ideal")
    assert "no layer removed (all 4 kept" in text and ".." not in text.split(",")[0]
    fast = ["--data", corpus, "--steps", 1, "--seq-len", 32, "--batch", 2, "--lora-rank", 2, "--eval-batches", 1]
    r = run("train", built, "--baseline", "pruned", "--target-ratio", 0.99, *fast, "-o", tmp_path / "p")
    assert r.exit_code == 0, r.output
    assert "no layer removed" in r.stderr and "(0 of" not in r.stderr
    assert "64 tokens to train on (from a corpus of" in r.stderr and "training tokens" not in r.stderr
    r = run("eval", tmp_path / "p", built, "--eval-batches", 1, "--batch", 2, "--no-controls", "--json")
    assert r.exit_code == 0, r.output
    results = json.loads(r.stdout)
    assert results[str(tmp_path / "p")]["model"] == "pruned"  # (the loaded model runs every layer: it said dense)
    assert not any("train_speed_vs_dense" in v for v in results.values())  # no dense run: no speed reference


def test_bench_names_the_sides_of_a_comparison_without_a_flop_ideal(capsys):
    from concept_cli.bench_cmd import render

    row = {"dense_s": 0.5, "concept_s": 0.05, "speedup": 10.0, "ratio": 0.125}
    render([{**row, "case": "null tracker: step loop vs host scan", "ideal_speedup": None, "fraction_of_ideal": None,
             "sides": ["step loop", "host scan"]},
            {**row, "case": "forward tiny", "ideal_speedup": 2.0, "fraction_of_ideal": 5.0}])
    out = capsys.readouterr().out
    policy, forward = out.split("concept vs dense")
    assert "host scan vs step loop" in policy and "step loop s" in policy and "of ideal" not in policy
    assert "dense" not in policy.replace("concept vs dense", "")
    assert "of ideal" in forward and "500%" in forward
    assert out.count("null tracker") == 1


@pytest.mark.slow  # 33 s (a pytest-benchmark subprocess)
def test_bench_policy_prints_its_table_once():
    r = run("bench", "--suite", "policy", "-k", "B16", "--device", "cpu", "--storage", "/tmp/concept-bench-unused")
    assert r.exit_code == 0, r.output
    assert (r.stdout + r.stderr).count("B=16 T=128") == 1, r.output  # (pytest-benchmark's own table names the test)
    assert "of ideal" not in r.stdout and "step loop s" in r.stdout
