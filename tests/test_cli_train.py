"""`concept train` / `concept eval` as a user runs them (tiny backbone, byte tokenizer)."""
import json
import pathlib

import pytest
from click.testing import CliRunner

from concept_cli.main import cli
from tests.test_training import corpus  # noqa: F401  (fixture)

TINY = ["--backbone", "tiny-llama", "--split", "1,2,1", "--set", "backbone.layers=4", "--set", "backbone.hidden=32",
        "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=32"]
FAST = ["--seq-len", "32", "--batch", "2", "--lora-rank", "2", "--eval-batches", "1", "--log-every", "2"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    assert run("build", *TINY, "-o", out).exit_code == 0
    return out


def test_train_resume_eval(built, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "m-train"
    r = run("train", built, "--data", corpus, "--steps", 4, *FAST, "--eval-every", 2, "--checkpoint-every", 2,
            "--out", out, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["step"] == 4 and result["eval"]["nll"] > 0
    assert "train" in r.stderr and "done" in r.stderr  # status on stderr, data on stdout
    assert {"metrics.jsonl", "curves.png", "checkpoint", "train.json", "concept.json"} <= {p.name for p in out.iterdir()}

    r = run("train", out, "--resume", "--steps", 6, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 6
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]

    r = run("eval", out, "--batches", 2, "--batch", 2, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    for key in ("bits_per_token", "ratio", "delta_nll_shuffle", "delta_nll_random", "usage_perplexity",
                "nll_by_position", "train_tokens_per_s"):
        assert key in report

    r = run("eval", out, "--batches", 1, "--batch", 2, "--show-map", "--no-controls")
    assert r.exit_code == 0 and "compression map" in r.stdout and "bits / token" in r.stdout


def test_baseline_and_comparison(built, corpus, tmp_path, monkeypatch):  # noqa: F811
    # (runs named by short relative paths: the table's cells wrap a path longer than they are wide, e.g. under the
    # image check's long --basetemp, and the row's name must be found whole)
    monkeypatch.chdir(tmp_path)
    dense, streaming = pathlib.Path("dense"), pathlib.Path("stream")
    for extra, out in ((["--baseline"], dense), ([], streaming)):
        r = run("train", built, *extra, "--data", corpus, "--steps", 2, *FAST, "--out", out)
        assert r.exit_code == 0, r.output
    r = run("eval", streaming, dense, "--batches", 1, "--batch", 2, "--json")
    both = json.loads(r.stdout)
    assert set(both) == {str(streaming), str(dense)}
    assert "ratio" in both[str(streaming)] and "ratio" not in both[str(dense)]
    r = run("eval", streaming, dense, "--batches", 1, "--batch", 2, "--no-controls")
    assert str(dense) in r.stdout and "concepts / token" in r.stdout
    assert "training speed vs dense" in r.stdout and both[str(streaming)]["train_tokens_per_s"] > 0


def test_train_bad_input(built, corpus, tmp_path):  # noqa: F811
    r = run("train", built, "--data", tmp_path / "nope", "--steps", 1, *FAST, "--out", tmp_path / "x")
    assert r.exit_code != 0 and "does not exist" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()
    r = run("train", built, "--data", corpus, "--steps", 1, *FAST[2:], "--seq-len", 10**6, "--out", tmp_path / "y")
    assert r.exit_code == 2 and "above the backbone's maximum" in r.stderr
    r = run("train", built, "--data", corpus, "--target-ratio", 1.5, "--steps", 1, *FAST, "--out", tmp_path / "z")
    assert r.exit_code == 2 and "target-ratio" in r.stderr
    r = run("train", tmp_path / "missing-run", "--steps", 1, "--out", tmp_path / "w")
    assert r.exit_code == 1 and "not a concept run folder" in r.stderr
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    r = run("train", built, "--data", bad, "--steps", 1, *FAST, "--out", tmp_path / "v")
    assert r.exit_code != 0 and "encoding-errors replace" in r.stderr
    r = run("train", built, "--resume", "--steps", 1)
    assert r.exit_code != 0 and "not a training run" in r.stderr


def _files(folder):
    """Every file under a run folder: contents and mtime (nothing may change)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_new_options_reach_the_config_and_resume_below_the_reached_step_changes_nothing(built, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "m-train"
    r = run("train", built, "--data", corpus, "--steps", 2, *FAST, "--weight-decay", 0.01, "--min-lr", 0.05,
            "--pi-ki", 0.1, "--lora-dropout", 0.1, "--out", out)
    assert r.exit_code == 0, r.output
    saved = json.loads((out / "train.json").read_text())
    assert (saved["weight_decay"], saved["min_lr"], saved["pi_ki"], saved["lora"]["dropout"]) == (0.01, 0.05, 0.1, 0.1)

    before = _files(out)
    for steps in ([], ["--steps", 2], ["--steps", 1]):  # at or below step 2: nothing to train
        r = run("train", out, "--resume", *steps)
        assert r.exit_code == 0, r.output
        said = " ".join(r.stderr.split())  # (the console wraps long lines where the tmp path's length puts them)
        assert "already at step 2" in said and "--resume --steps 12" in said
        assert r.stdout == "" and "training" not in r.stderr
    r = run("train", out, "--resume", "--steps", 1, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["step"] == 2 and report["steps"] == 1 and report["trained"] is False and "already at step 2" in report["message"]
    # the new options are part of the saved recipe: a different value on --resume is refused
    r = run("train", out, "--resume", "--steps", 3, "--weight-decay", 0.5)
    assert r.exit_code == 2 and "weight_decay: the run was trained with 0.01" in r.stderr
    assert _files(out) == before  # nothing in the run folder changed

    r = run("train", out, "--resume", "--steps", 3, "--lora-dropout", 0.1, "--json")  # same value: fine
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 3


def test_new_options_are_validated(built, corpus, tmp_path):  # noqa: F811
    for flag, value, message in (("--min-lr", 2, "min-lr: must be in [0, 1], got 2.0"),
                                 ("--weight-decay", -1, "weight-decay: must be >= 0, got -1.0"),
                                 ("--pi-ki", -0.1, "pi-ki: must be >= 0"),
                                 ("--lora-dropout", 1, "lora-dropout: must be in [0, 1), got 1.0")):
        r = run("train", built, "--data", corpus, "--steps", 1, *FAST, flag, value, "--out", tmp_path / "x")
        assert r.exit_code == 2 and message in r.stderr, (flag, r.stderr)
        assert not (tmp_path / "x").exists()


def test_anti_collapse_as_a_user_runs_it(built, corpus, tmp_path):  # noqa: F811
    """`--kmeans-init` / `--revive-after` from the command line: logged in metrics.jsonl, kept in train.json
    (so --resume revives the same way); a vocabulary without code rows is a clear error that writes nothing."""
    out = tmp_path / "revived"
    r = run("train", built, "--data", corpus, "--steps", 3, *FAST, "--kmeans-init", 1, "--revive-after", 1,
            "--eval-every", 3, "--out", out)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kmeans_codes"] > 0 and all("revived" in row and "idle_share" in row for row in rows)
    saved = json.loads((out / "train.json").read_text())
    assert (saved["revive_after"], saved["kmeans_init"]) == (1, 1)
    fsq = tmp_path / "fsq"
    assert run("build", *TINY[:-2], "--vocabulary", "fsq", "--set", "vocabulary.levels_per_dim=[4,4]",
               "-o", fsq).exit_code == 0
    r = run("train", fsq, "--data", corpus, "--steps", 1, *FAST, "--revive-after", 5, "--out", tmp_path / "no")
    assert r.exit_code != 0 and "has no code rows to revive" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "no").exists()
