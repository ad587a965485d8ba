"""Run folders of older versions (``concept.migrate``, issue 41 item 4): a run saved by today's writer, rewritten
to each older format the reader still accepts by the explicit transformation below (what that version wrote),
loads with the same config and the same model as today's folder. Negative controls: without the migration the
older record names another model; a format from a newer version is refused with the fix."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import concept
from concept import run_files
from concept.builder import run_kind
from concept.config import BuildConfig
from concept.families import sections
from concept.errors import ConfigError
from concept.migrate import FORMAT_VERSION, migrate_run, sectioned
from concept.train_config import TrainConfig
from tests.test_cli_train import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*args):
    from click.testing import CliRunner

    from concept_cli.main import cli as main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


# concept.json as each older version wrote it, from today's record
def format_2(record: dict) -> dict:
    """Format 2: flat, the streaming family's keys (its slots, split, concept input, budget) beside ``family``."""
    config = dict(record["config"])
    return record | {"format": 2, "config": config | config.pop("streaming")}


def format_1(record: dict) -> dict:
    """Format 1: no ``format`` key, no ``family`` (one family), and no ``concept_input`` / ``tail_fusion`` (built
    with what they were then: the embedding alone, no fusion)."""
    flat = format_2(record)
    config = {k: v for k, v in flat["config"].items() if k not in ("family", "concept_input", "tail_fusion")}
    return {k: v for k, v in flat.items() if k != "format"} | {"config": config}


def format_2_one_family(record: dict) -> dict:
    """Format 2 before the second family: no ``family``."""
    flat = format_2(record)
    return flat | {"config": {k: v for k, v in flat["config"].items() if k != "family"}}


def format_2_empty_sections(record: dict) -> dict:
    """Format 2 as versions wrote it that put every family's section, empty, into every run."""
    flat = format_2(record)
    return flat | {"config": flat["config"] | {section: {} for section in sections() if section != "streaming"}}


OLDER = {"format 1": format_1, "format 2": format_2, "format 2, one family": format_2_one_family,
         "format 2, empty sections": format_2_empty_sections}


@pytest.fixture(scope="module")
def today(tmp_path_factory):
    """A tiny build by today's writer, with the components format 1 implied (embedding input, no fusion)."""
    out = tmp_path_factory.mktemp("migrate") / "today"
    r = cli("build", *TINY, "--concept-input", "embedding", "--no-calibrate", "-o", out)
    assert r.exit_code == 0, r.output
    return out


def logits(folder):
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return concept.load(folder)(ids).logits


def test_every_older_concept_json_loads_as_today_s(today, tmp_path):
    record = json.loads((today / "concept.json").read_text())
    assert record["format"] == FORMAT_VERSION and record["config"]["streaming"]["tail_fusion"]["name"] == "none"
    expected, expected_logits = run_files.read_run(today), logits(today)
    for name, rewrite in OLDER.items():
        old = shutil.copytree(today, tmp_path / name.replace(" ", "-").replace(",", ""))
        (old / "concept.json").write_text(json.dumps(rewrite(record)))
        assert run_files.read_run(old)["config"] == expected["config"], name
        assert run_files.read_run(old)["format"] == FORMAT_VERSION
        torch.testing.assert_close(logits(old), expected_logits, rtol=0, atol=0)
        r = cli("build", "--config", old / "concept.json", "--dry-run", "--json")  # a record as a --config file
        assert r.exit_code == 0 and json.loads(r.stdout)["config"] == expected["config"], (name, r.output)
    # negative controls: read as it is, without the migration, format 1 names another model (today's default input),
    # and format 2's flat keys are refused, naming their section
    raw = sectioned(format_1(record)["config"] | {"family": "streaming"})
    assert BuildConfig.from_dict(raw).to_dict() != expected["config"]
    assert BuildConfig.from_dict(migrate_run(format_1(record))["config"]).to_dict() == expected["config"]
    with pytest.raises(ConfigError, match="split: an option of the streaming section"):
        BuildConfig.from_dict(format_2(record)["config"])
    assert BuildConfig.from_dict(migrate_run(format_2(record))["config"]).to_dict() == expected["config"]


def test_the_flat_to_sectioned_move_is_explicit():
    """Format 2 -> 3 moves exactly the streaming keys (a slot-less family's flat config has none: unchanged); a key
    in both places keeps the section's; negative control: without the move, the keys stay at the top."""
    flat = {"family": "streaming", "backbone": {"name": "tiny-llama"}, "seed": 1, "split": "2,2,2",
            "max_ratio": 0.0, "planner": {"types": []}}
    assert sectioned(flat) == {"family": "streaming", "backbone": {"name": "tiny-llama"}, "seed": 1,
                               "planner": {"types": []}, "streaming": {"split": "2,2,2", "max_ratio": 0.0}}
    assert sectioned(flat | {"streaming": {"split": "1,1,1"}})["streaming"] == {"split": "1,1,1", "max_ratio": 0.0}
    soft = {"family": "soft-prompt", "backbone": {"name": "tiny-llama"}, "seed": 0, "soft_prompt": {"length": 3}}
    assert sectioned(soft) == soft
    migrated = migrate_run({"format": 2, "config": flat})
    assert migrated["format"] == FORMAT_VERSION and "split" not in migrated["config"]
    assert migrate_run({"format": FORMAT_VERSION, "config": flat})["config"]["split"] == "2,2,2"  # (today's: as is)


def test_an_older_train_json_reads_as_today_s(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    current = TrainConfig(baseline="dense", data=str(corpus.resolve()), steps=3).to_dict()
    added_since = {"distill", "distill_temperature", "align", "align_at", "align_loss", "train_only", "ratio_start",
                   "ratio_warmup", "prune_layers", "ce_weight"}
    # train.json before the pruned baseline and before runs stored absolute data paths: a bool baseline, the data
    # path as typed (relative to the working folder), none of the options added since
    older = {k: v for k, v in current.items() if k not in added_since} | {"baseline": True, "data": corpus.name}
    monkeypatch.chdir(tmp_path)
    for name, train in (("today", current), ("older", older)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.json").write_text(json.dumps(train))
    read = {name: run_files.read_train(tmp_path / name) for name in ("today", "older")}
    assert run_files._train_config(read["older"]) == run_files._train_config(read["today"])
    assert "baseline" not in read["older"] and read["older"]["data"] == str(corpus.resolve())
    # its concept.json held the build it was trained from: today, a build of the dense family
    assert run_kind(migrate_run({"config": BuildConfig().to_dict()}, older), read["older"]) == "dense"
    # negative control: the record as it was written differs from today's
    assert older["baseline"] is True and older["data"] != current["data"]
    (tmp_path / "older" / "train.json").write_text(json.dumps(older | {"baseline": False}))
    assert run_files.read_train(tmp_path / "older")["baseline"] is None  # false: no baseline


@pytest.mark.parametrize("version, problem", [
    (FORMAT_VERSION + 1, f"written by a newer concept (format {FORMAT_VERSION + 1}; this one reads up to "
                         f"{FORMAT_VERSION}); upgrade concept"),
    ("two", "'format' is 'two', not a format version"),
])
def test_a_format_this_version_cannot_read_is_one_clear_line(today, tmp_path, version, problem):
    old = shutil.copytree(today, tmp_path / "run")
    record = json.loads((old / "concept.json").read_text())
    (old / "concept.json").write_text(json.dumps(record | {"format": version}))
    for args in (["inspect", old], ["build", "--config", old / "concept.json", "--dry-run"]):
        r = cli(*args)
        assert r.exit_code in (1, 2) and problem in r.stderr and "Traceback" not in r.output, (args, r.output)


def test_a_checkpoint_written_before_the_sections_still_resumes(today, tmp_path):
    """A checkpoint fingerprints its build's config; one written before format 3 fingerprinted it flat: the same
    build, accepted. Negative control: a flat config of another build (another split) is refused."""
    from concept import checkpoint, fingerprint
    from concept.errors import RunFolderError
    from concept.migrate import flat

    config = run_files.read_run(today)["config"]
    state = tmp_path / "checkpoint" / "state.json"
    state.parent.mkdir()
    for written, accepted in ((config, True), (flat(config), True),
                              (flat(config) | {"split": "2,1,1"}, False)):
        state.write_text(json.dumps({"step": 1, "fingerprints": {"build": fingerprint.of_config(written)}}))
        if accepted:
            assert checkpoint.check_origin(tmp_path, config, None)["step"] == 1
        else:
            with pytest.raises(RunFolderError, match="not written for this run's build"):
                checkpoint.check_origin(tmp_path, config, None)


def test_train_json_of_a_family_that_no_longer_has_the_moved_options_reads(tmp_path):
    """Before the training options went by owner, ``target_ratio`` ... ``align_at`` were core options: a
    planner-executor run recorded ``target_ratio`` and ``align_at`` (it reads neither), and a baseline recorded
    every family's options. Read with the run's family's options (``run_files.train_config_of``), they are
    dropped; resume reads the same record. Negative control: without the migration the planner-executor's
    training options have no ``target_ratio``."""
    from concept.migrate import migrate_train
    from concept.train_config import for_family
    from concept.training_run import saved_config

    planner = for_family("planner-executor")
    written = planner(steps=3).to_dict() | {"target_ratio": 0.25, "align_at": "deep-input"}  # (as it was written)
    run = tmp_path / "pe"
    run.mkdir()
    (run / "concept.json").write_text(json.dumps({"format": FORMAT_VERSION, "config": {"family": "planner-executor"}}))
    (run / "train.json").write_text(json.dumps(written))
    read = run_files.read_train(run)
    assert "target_ratio" not in read and "align_at" not in read and read["tau_start"] == 1.0
    assert run_files.train_config_of(run) is planner
    assert saved_config(run, read)[2] == planner(steps=3)
    with pytest.raises(TypeError, match="target_ratio"):  # negative control: the record as it was written
        planner.from_dict(migrate_train(written))
    # a dense baseline of a streaming run recorded every family's options; it is a run of the dense family now
    # (concept.migrate.baseline_build), whose options are the core's
    baseline = TrainConfig(baseline="dense", steps=3, target_ratio=0.25).to_dict()
    assert "task" in baseline and "commitment" in baseline
    (run / "concept.json").write_text(json.dumps({"format": FORMAT_VERSION, "config": {
        "family": "streaming", "backbone": {"name": "tiny", "params": {}}}}))
    (run / "train.json").write_text(json.dumps(baseline))
    read = run_files.read_train(run)
    assert "task" not in read and "target_ratio" not in read and "baseline" not in read
    assert run_files.train_config_of(run) is for_family("dense")
    assert saved_config(run, read)[2] == for_family("dense")(steps=3)
