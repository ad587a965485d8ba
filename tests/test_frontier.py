"""`concept frontier`: streaming runs over splits x ratios, FLOP-matched pruned baselines and dense,
trained with one recipe, evaluated on two domains, plotted and tabulated (tiny backbone, byte tokens)."""
import json
import os

import pytest
from click.testing import CliRunner

import concept.recipes.frontier as fr
from benchmarks import frontier_doc
from concept.training import Trainer
from concept_cli.main import cli
from tests.test_training import STDLIB, corpus  # noqa: F401  (fixture)

TINY = ["--backbone", "tiny-llama", "--attention", "sdpa", "--build-set", "backbone.layers=6",
        "--build-set", "backbone.hidden=32", "--build-set", "backbone.heads=2", "--build-set", "backbone.kv_heads=1",
        "--build-set", "backbone.intermediate=64", "--build-set", "vocabulary.size=32"]
RECIPE = ["--steps", "2", "--seq-len", "16", "--batch", "2", "--lora-rank", "2", "--warmup", "1",
          "--train-set", "calibration_batches=2", "--train-set", "eval_batches=1", "--eval-batches", "1",
          "--eval-batch", "2", "--max-flops", "1.5"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Two held-out domains read whole: Python code and English prose."""
    import pydoc_data.topics

    folder = tmp_path_factory.mktemp("heldout")
    (folder / "code.py").write_text((STDLIB / "fnmatch.py").read_text())
    (folder / "prose.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:3]))
    return ["--eval-data", f"code={folder / 'code.py'}", "--eval-data", f"prose={folder / 'prose.txt'}"]


@pytest.fixture(scope="module")
def frontier(tmp_path_factory, corpus, held_out):  # noqa: F811
    out = tmp_path_factory.mktemp("frontier") / "runs"
    args = ["frontier", *TINY, "--splits", "2,2,2;1,4,1", "--ratios", "0.25", *RECIPE, "--data", corpus, *held_out,
            "--out", out]
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return out, args, json.loads(r.stdout), r.stderr


def test_frontier_trains_evaluates_and_writes_the_plot_and_table(frontier):
    out, _, result, err = frontier
    rows = {row["run"]: row for row in result["rows"]}
    assert list(rows) == ["s2-2-2_r0.25", "s1-4-1_r0.25", "pruned-L5-skip2", "pruned-L3-skip1-3", "dense"]
    assert [rows[n]["kind"] for n in rows] == ["streaming", "streaming", "pruned", "pruned", "dense"]
    pruned = rows["pruned-L3-skip1-3"]  # 3 layers kept: 1..3 skipped, the start of the middle stack
    assert rows["s1-4-1_r0.25"]["pruned_baseline"] == "pruned-L3-skip1-3" and pruned["removed"] == [1, 4]
    assert pruned["matches"] == ["s1-4-1_r0.25"]
    for name, row in rows.items():
        assert (out / name / "train.json").is_file() and row["step"] == 2 and row["trained"] == "trained"
        for label in ("code", "prose"):
            m = row["domains"][label]
            assert m["bits_per_token"] > 0 and 0 < m["flop_ratio"] <= 1.0 + 1e-9
            if row["kind"] == "streaming":
                assert 0 <= m["ratio"] <= 1 and m["delta_nll_shuffle"] is not None
                # the code-only controls and the identity start's gate (the default concept input)
                assert m["delta_nll_codes_shuffled"] is not None and m["delta_nll_codes_zero"] is not None
                assert m["gate_norm"] > 0
            else:
                assert m["ratio"] is None and m["delta_nll_codes_zero"] is None and m["gate_norm"] is None
    dense = rows["dense"]["domains"]
    assert dense["code"]["flop_ratio"] == 1.0 and dense["code"]["gap_bits"] == 0
    assert pruned["domains"]["code"]["flop_ratio"] == pytest.approx(pruned["planned_flop_ratio"])
    s = rows["s1-4-1_r0.25"]["domains"]["prose"]
    assert s["gap_bits"] == pytest.approx(s["bits_per_token"] - dense["prose"]["bits_per_token"])
    assert s["vs_pruned_bits"] == pytest.approx(s["bits_per_token"] - pruned["domains"]["prose"]["bits_per_token"])
    # the best streaming point: the lowest mean bits among those at <= --max-flops
    streaming = [row for row in rows.values() if row["kind"] == "streaming" and row["flop_ratio"] <= 1.5]
    assert result["best"]["run"] == min(streaming, key=lambda row: row["mean_bits"])["run"]
    files = {p.name for p in out.iterdir()}
    assert {"frontier.json", "frontier.md", "frontier.png", "builds"} <= files
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "frontier.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    table = (out / "frontier.md").read_text()
    assert table.count("\n| ") == 1 + 5 and "| pruned-L3-skip1-3 | pruned |" in table and "bits prose" in table
    assert "Best streaming point" in table
    head, cells = fr.table_cells(result)
    streaming_row = cells[[row["run"] for row in result["rows"]].index("s1-4-1_r0.25")]
    gate = rows["s1-4-1_r0.25"]["domains"]["code"]["gate_norm"]
    assert streaming_row[head.index("gate RMS")] == f"{gate:.3f}"
    zero = rows["s1-4-1_r0.25"]["domains"]["prose"]["delta_nll_codes_zero"]
    assert streaming_row[head.index("ΔNLL codes removed prose")] == f"{zero:+.3f}"
    assert cells[[row["run"] for row in result["rows"]].index("dense")][head.index("gate RMS")] == "–"
    assert "concept frontier --splits '2,2,2;1,4,1' --ratios 0.25 --backbone tiny-llama" in table
    assert "--json" not in table
    assert "training" in err and "evaluating" in err  # progress on stderr, data on stdout


def test_rerun_skips_complete_runs_and_the_doc_script_fills_a_doc(frontier, monkeypatch, tmp_path):
    out, args, first, _ = frontier

    def refuse(*_, **__):
        raise AssertionError("a complete run was trained or evaluated again")

    monkeypatch.setattr(Trainer, "start", refuse)
    monkeypatch.setattr(Trainer, "resume", refuse)
    monkeypatch.setattr(fr.running, "evaluate_run", refuse)  # the evaluation is cached in each run folder
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint/state.json")}
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nintro\n\n<!-- frontier:begin -->\nold table\n<!-- frontier:end -->\n\nafter\n")
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert frontier_doc.main([str(out), str(doc)]) == 0  # the library rewrites no docs: the script does
    assert r.stderr.count("skipping") == 5 and "s1-4-1_r0.25" in r.stdout and "Best streaming point" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint/state.json")} == stamps
    text = doc.read_text()
    assert text.startswith("# Results\n\nintro\n\n<!-- frontier:begin -->\n") and text.endswith(
        "<!-- frontier:end -->\n\nafter\n")
    assert "old table" not in text and "| dense | dense |" in text
    assert f"]({os.path.relpath(out / 'frontier.png', tmp_path)})" in text and "concept frontier " in text
    assert json.loads((out / "frontier.json").read_text())["rows"][0]["trained"] == "skipped"

    bad = tmp_path / "nomarkers.md"
    bad.write_text("# no block here\n")
    with pytest.raises(SystemExit, match="<!-- frontier:begin -->"):
        frontier_doc.main([str(out), str(bad)])
    assert bad.read_text() == "# no block here\n"
    r = run(*args, "--update-doc", doc)  # the removed flag: a clear error before anything runs
    assert r.exit_code == 1 and "--update-doc was removed" in r.stderr and "benchmarks.frontier_doc" in r.stderr


def test_tasks_add_accuracy_columns_and_a_plot_and_are_cached(frontier, monkeypatch):
    pytest.importorskip("lm_eval")
    from concept.recipes import harness

    out, args, _, _ = frontier
    monkeypatch.setattr(Trainer, "start", lambda *_, **__: pytest.fail("a complete run was trained again"))
    tasks = ["--tasks", "concept_docstring_name", "--tasks-limit", "2"]
    r = run(*args, *tasks, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    for row in result["rows"]:  # every run, streaming and baselines, on the task
        acc = row["tasks"]["concept_docstring_name"]["acc"]
        assert row["tasks"]["concept_docstring_name"]["samples"] == 2 and acc["value"] in (0.0, 0.5, 1.0)
    head, _ = fr.table_cells(result)
    assert head[-1] == "acc concept_docstring_name" and (out / "frontier-tasks.png").stat().st_size > 1000
    assert "Task columns" in (out / "frontier.md").read_text()
    monkeypatch.setattr(harness, "evaluate_tasks", lambda *_, **__: pytest.fail("evaluated again"))
    again = run(*args, *tasks, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["rows"][0]["tasks"] == result["rows"][0]["tasks"]


def test_another_recipe_is_refused_then_an_interrupted_run_resumes(frontier):
    out, args, _, _ = frontier
    r = run(*args, "--lr", "0.01")
    assert r.exit_code == 2 and "another recipe" in r.stderr and "lr: trained with 0.0002, planned 0.01" in r.stderr
    assert "--force" in r.stderr and "Traceback" not in r.output
    # an interrupted run (its checkpoint before the last step) is resumed, not restarted
    state = out / "dense" / "checkpoint" / "state.json"
    meta = json.loads(state.read_text())
    state.write_text(json.dumps({**meta, "step": 1}))
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["run"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows["dense"]["trained"] == "resumed" and rows["dense"]["step"] == 2
    assert rows["pruned-L3-skip1-3"]["trained"] == "skipped"
    assert "resuming" in r.stderr and "from step 1" in r.stderr
    # --force retrains a run trained with another recipe (here only the one planned)
    r = run(*args, "--splits", "2,2,2", "--baselines", "none", "--lr", "0.01", "--force", "--json")
    assert r.exit_code == 0, r.output
    assert [(row["run"], row["trained"]) for row in json.loads(r.stdout)["rows"]] == [("s2-2-2_r0.25", "trained")]
    assert json.loads((out / "s2-2-2_r0.25" / "train.json").read_text())["lr"] == 0.01 and "replacing" in r.stderr


def test_dry_run_writes_nothing_and_shares_pruned_runs(tmp_path, corpus, held_out):  # noqa: F811
    out = tmp_path / "plan"
    r = run("frontier", *TINY, "--splits", "2,2,2", "--ratios", "0.5,0.25", *RECIPE, "--data", corpus, *held_out,
            "--out", out, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    assert not out.exists()
    plan = json.loads(r.stdout)
    runs = {x["run"]: x for x in plan["runs"]}
    assert list(runs) == ["s2-2-2_r0.5", "s2-2-2_r0.25", "pruned-L5-skip2", "dense"]  # both points remove one layer
    assert runs["pruned-L5-skip2"]["matches"] == ["s2-2-2_r0.5", "s2-2-2_r0.25"]
    assert runs["s2-2-2_r0.25"]["planned_flop_ratio"] < runs["s2-2-2_r0.5"]["planned_flop_ratio"] < 1
    assert runs["s2-2-2_r0.5"]["build_config"]["streaming"]["split"] == "2,2,2" and runs["dense"]["state"]["status"] == "new"
    r = run("frontier", *TINY, "--splits", "2,2,2", "--ratios", "0.5", *RECIPE, "--data", corpus, *held_out,
            "--out", out, "--dry-run")
    assert r.exit_code == 0 and "pruned-L5-skip2" in r.stdout and "builds/s2-2-2" in r.stdout and not out.exists()
    r = run("frontier", *TINY, "--splits", "2,2,2", "--ratios", "0.5", "--baselines", "dense", *RECIPE, "--data", corpus,
            *held_out, "--out", out, "--dry-run", "--json")
    assert [x["kind"] for x in json.loads(r.stdout)["runs"]] == ["streaming", "dense"] and not out.exists()


@pytest.mark.parametrize("change, message", [
    (["--splits", " ; "], "--splits: give at least one split"),
    (["--ratios", "0.5,1.5"], "must be in (0, 1), got 1.5"),
    (["--splits", "2,2,3"], "sums to 7 layers but the backbone has 6"),
    (["--eval-data", "no-such-corpus"], "neither a built-in corpus"),
    (["--train-set", "target_ratio=0.3"], "set by the frontier for each run"),
    (["--train-set", "lr_nwe=0.1"], "Did you mean 'lr_new'?"),
    (["--ratio-warmup", "2"], "ratio-warmup"),
    (["--baselines", "pruned,dens"], "'dens' is not a baseline"),
    (["--tasks-limit", "3"], "--tasks-limit and --include-path go with --tasks"),
    (["--tasks", "concept_clozee"], "did you mean concept_cloze"),
])
def test_bad_input_is_one_clear_error_before_anything_is_written(tmp_path, corpus, held_out, change, message):  # noqa: F811
    out = tmp_path / "x"
    base = {"--splits": "2,2,2", "--ratios": "0.25"}
    args = ["frontier", *TINY, *RECIPE, "--data", corpus, "--out", out]
    for flag, value in base.items():
        if flag not in change:
            args += [flag, value]
    args += change + ([] if "--eval-data" in change else held_out)
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output and not out.exists()
