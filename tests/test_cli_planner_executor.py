"""The planner-executor as a user runs it (issue: build / train --task / eval / generate --show-plan)."""
import json
import math

import pytest

from tests.test_cli_train import FAST, TINY, run
from tests.test_training import corpus  # noqa: F401  (fixture)

TYPES = '[{"name":"topic","size":8,"max_len":2},{"name":"gist","size":16,"max_len":4}]'
PE = ["--family", "planner-executor", "--backbone", "tiny-llama", "--set", "backbone.layers=3", "--set",
      "backbone.hidden=32", "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", f"planner.types={TYPES}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    root = tmp_path_factory.mktemp("pe-cli")
    built, rec, cont = root / "pe", root / "pe-train", root / "pe-cont"
    r = run("build", *PE, "-o", built, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["family"] == "planner-executor" and [t["name"] for t in info["plan"]["planner"]["types"]] == ["topic", "gist"]
    r = run("train", built, "--task", "reconstruct", "--data", corpus, "--steps", 2, *FAST, "--out", rec)
    assert r.exit_code == 0, r.output
    r = run("train", built, "--task", "continue", "--context-len", 16, "--data", corpus, "--steps", 2, *FAST, "--out", cont)
    assert r.exit_code == 0, r.output
    return built, rec, cont


def test_eval_reports_plan_and_controls(runs, corpus):  # noqa: F811
    _, rec, cont = runs
    r = run("eval", rec, "--data", corpus, "--batches", 1, "--batch", 2, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    for key in ("nll", "nll_nothing", "nll_dense_given_u", "nll_dense", "plan_len", "plan_per_token",
                "plan_len/topic", "plan_len/gist", "delta_nll_shuffle", "delta_nll_mask", "delta_nll_random",
                "entropy/gist", "usage_perplexity/topic"):
        assert key in result, key
    assert result["model"] == "planner-executor" and result["task"] == "reconstruct"
    table = run("eval", cont, rec, "--data", corpus, "--batches", 1, "--batch", 2, "--no-controls")
    assert table.exit_code == 0, table.output
    assert "NLL(y | empty plan)" in table.stdout and "plan length (topic)" in table.stdout
    short = run("eval", cont, "--data", corpus, "--seq-len", 16, "--batches", 1, "--batch", 2)  # = its context length
    assert short.exit_code != 0 and "--seq-len > 16" in short.output


def test_generate_shows_the_plan_then_the_text(runs, tmp_path):
    _, _, cont = runs
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nimport os\n")
    r = run("generate", cont, "--prompt-file", prompts, "--show-plan", "--max-new-tokens", 6)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("plan topic: [") == 2 and "plan of" in r.stderr
    j = run("generate", cont, "--prompt", "import os", "--max-new-tokens", 4, "--json")
    row = json.loads(j.stdout)
    assert [p["type"] for p in row["plan"]] == ["topic", "gist"] and row["new_tokens"] == 4


def test_options_of_the_other_family_are_refused(runs, corpus, tmp_path):  # noqa: F811
    built, rec, _ = runs
    r = run("generate", rec, "--prompt", "x", "--show-concepts")
    assert r.exit_code == 2 and "--show-concepts" in r.output and "planner-executor" in r.output
    streaming = tmp_path / "s"
    assert run("build", *TINY, "-o", streaming).exit_code == 0
    r = run("generate", streaming, "--prompt", "x", "--show-plan")
    assert r.exit_code == 2 and "only planner-executor runs write one" in r.output
    r = run("train", streaming, "--task", "continue", "--context-len", 8, "--data", corpus, "--steps", 1, *FAST,
            "--out", tmp_path / "t")
    assert r.exit_code == 2 and "planner-executor runs" in r.output and not (tmp_path / "t").exists()
    r = run("frontier", "--config", built, "--steps", 1, "--dry-run")
    assert r.exit_code == 2 and "frontier trains streaming models" in r.output
    r = run("train", built, "--task", "continue", "--context-len", 32, "--data", corpus, "--steps", 1, *FAST,
            "--out", tmp_path / "u")
    assert r.exit_code == 2 and "context-len" in r.output and not (tmp_path / "u").exists()


@pytest.mark.parametrize("types, message", [
    ("[]", "non-empty list"),
    ('[{"name":"a","size":4,"max_len":2},{"name":"a","size":4,"max_len":2}]', "duplicate type name"),
    ('[{"name":"a","size":1,"max_len":2}]', "at least 2 concept ids"),
    ('[{"name":"a","size":4,"max_len":0}]', "at least 1 concept per type"),
])
def test_bad_plan_types_fail_before_anything_is_written(types, message, tmp_path):
    r = run("build", "--family", "planner-executor", "--backbone", "tiny-llama", "--set", f"planner.types={types}",
            "-o", tmp_path / "x")
    assert r.exit_code == 2 and message in r.output and not (tmp_path / "x").exists()


def test_inspect_shows_plan_types_and_length_control(runs):
    _, _, cont = runs
    r = run("inspect", cont, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["family"] == "planner-executor" and info["planner"]["task"] == "continue"
    assert [t["max_len"] for t in info["planner"]["types"]] == [2, 4] and "eos_bias" in info["planner"]
    assert "plan types" in run("inspect", cont).stdout


@pytest.mark.parametrize("speedup", [["--set", "planner.mtp=2"], ["--set", "planner.parallel=true"]])
def test_hard_em_with_a_planner_speedup_as_a_user_runs_it(speedup, corpus, tmp_path):  # noqa: F811
    built, out = tmp_path / "pe", tmp_path / "hem"
    assert run("build", *PE, *speedup, "-o", built).exit_code == 0
    r = run("train", built, "--plan-training", "hard-em", "--beam", 2, "--estep-every", 2, "--curriculum", "16:0.5",
            "--data", corpus, "--steps", 2, *FAST, "--log-every", 1, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in rows] == [16, 32]
    expected = {"plan_ce", "estep_share", "estep_margin", "delta_nll_shuffle", "cos_soft_hard"}
    expected |= {"plan_mtp"} if "planner.mtp=2" in speedup else set()
    assert expected <= set(rows[0]), expected - set(rows[0])
    r = run("eval", out, "--data", corpus, "--batches", 1, "--batch", 2, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert {"nll_zstar", "estep_margin", "delta_nll_dropout", "cos_soft_hard"} <= set(result)
    # finite NLLs of a real plan (NaN or inf fail); the E-step's beam and its scores are tested directly
    # in tests/test_hard_em.py (the margin, top-1 minus top-2 of sorted scores, is >= 0 by construction)
    assert 0 < result["nll_zstar"] < 20 and math.isfinite(result["estep_margin"])
    g = run("generate", out, "--prompt", "import os", "--max-new-tokens", 3, "--show-plan")
    assert g.exit_code == 0, g.output


def test_bad_speedup_options_as_a_user_sees_them(runs, tmp_path):
    built, rec, _ = runs
    r = run("build", *PE, "--set", "planner.mtp=0", "-o", tmp_path / "x")
    assert r.exit_code != 0 and "planner.mtp" in r.output and "Traceback" not in r.output
    r = run("train", built, "--plan-training", "hard-em", "--estep-every", 0, "--beam", 0, "--out", tmp_path / "y")
    assert r.exit_code != 0 and "estep-every" in r.output and "beam" in r.output and not (tmp_path / "y").exists()
