"""`concept train` / `concept eval` as a user runs them (tiny backbone, byte tokenizer)."""
import json

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


def test_baseline_and_comparison(built, corpus, tmp_path):  # noqa: F811
    dense, streaming = tmp_path / "dense", tmp_path / "stream"
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
