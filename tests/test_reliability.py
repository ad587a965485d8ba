"""Each data-loss and bad-input report, reproduced as a user ran it, and fixed: `train --force` and failed
resumes never destroy a run, paths stored in a run work from any folder, bad input is a clear error
(never a traceback), Ctrl-C exits 130, and ``--json`` is always JSON."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from concept import fs
from concept_cli.output import json_safe
from tests.faults import snapshot
from tests.test_cli_planner_executor import PE
from tests.test_cli_train import FAST, TINY, run
from tests.test_training import corpus  # noqa: F401  (fixture)

STEPS = ["--steps", 2, "--checkpoint-every", 2, "--eval-every", 100, "--calibration-batches", 1]
PE_STEPS = STEPS[:-2]  # a planner-executor run refuses the streaming family's --calibration-batches


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):  # noqa: F811
    """A build and a run trained from it, in one folder `p/`."""
    root = tmp_path_factory.mktemp("reliability")
    assert run("build", *TINY, "-o", root / "p" / "src").exit_code == 0
    r = run("train", root / "p" / "src", "--data", corpus, *STEPS, *FAST, "--out", root / "p" / "run")
    assert r.exit_code == 0, r.output
    return root


def test_force_never_deletes_the_source_or_an_old_run_before_success(trained, corpus, tmp_path):  # noqa: F811
    p = trained / "p"
    before = snapshot(p)
    r = run("train", p / "src", "--data", corpus, *STEPS, *FAST, "--out", p, "--force")
    assert r.exit_code == 1 and "contains the source run" in r.stderr and "Traceback" not in r.output
    assert snapshot(p) == before
    r = run("train", p / "src", "--data", p / "run" / "metrics.jsonl", *STEPS, *FAST, "--out", p / "run", "--force")
    assert r.exit_code == 1 and "contains the training data" in r.stderr
    r = run("train", p / "src", "--data", tmp_path / "nosuch.txt", *STEPS, *FAST, "--out", p / "run", "--force")
    assert r.exit_code == 1 and "does not exist" in r.stderr
    assert snapshot(p) == before
    r = run("build", *TINY, "--seed", 3, "-o", p / "run")  # a rebuild of the same model would replace training
    assert r.exit_code == 1 and "holds more than a build" in r.stderr and snapshot(p) == before


def test_an_interrupted_force_keeps_the_old_run(trained, corpus, monkeypatch):  # noqa: F811
    from concept.training import Trainer

    p = trained / "p"
    before = snapshot(p)

    def interrupted(self, progress=None):
        self.loop.stopping = True  # as the SIGINT handler does
        return real(self, progress)

    real = Trainer.train
    monkeypatch.setattr(Trainer, "train", interrupted)
    r = run("train", p / "src", "--data", corpus, *STEPS, *FAST, "--out", p / "run", "--force")
    assert r.exit_code == 130 and "unchanged" in r.stderr and "discarded" in r.stderr
    assert snapshot(p) == before


def test_ctrl_c_during_start_up_leaves_no_half_written_run(trained, corpus, monkeypatch, tmp_path):  # noqa: F811
    from concept import data

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "PackedSequences", interrupt)
    r = run("train", trained / "p" / "src", "--data", corpus, *STEPS, *FAST, "--out", tmp_path / "new")
    assert r.exit_code == 130 and "interrupted" in r.stderr
    assert sorted(os.listdir(tmp_path)) == []  # neither the run nor its staging folder or lock


def test_ctrl_c_exits_130_from_build_and_export_too(trained, monkeypatch, tmp_path):
    import concept

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(concept, "build", interrupt)
    r = run("build", *TINY, "-o", tmp_path / "b")
    assert r.exit_code == 130 and not (tmp_path / "b").exists()
    from concept import export as export_module

    monkeypatch.setattr(export_module, "model_card", interrupt)
    r = run("export", trained / "p" / "run", "--out", tmp_path / "e")
    assert r.exit_code == 130 and sorted(os.listdir(tmp_path)) == []


def copy_run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(trained / "p" / "run", tmp_path / "run")
    return tmp_path / "run"


def test_a_failed_resume_writes_nothing(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    before = snapshot(run_dir)
    r = run("train", run_dir, "--resume", "--lr", 0.5)  # a finished run: still a conflict, not "nothing to do"
    assert r.exit_code == 2 and "lr: the run was trained with" in r.stderr
    r = run("train", run_dir, "--resume", "--steps", 5, "--device", "cuda")  # no CUDA on the test machine
    assert r.exit_code == 1 and "no CUDA device" in r.stderr and snapshot(run_dir) == before
    record = json.loads((run_dir / "train.json").read_text())
    (run_dir / "train.json").write_text(json.dumps({**record, "data": str(tmp_path / "gone.jsonl")}))
    before = snapshot(run_dir)
    r = run("train", run_dir, "--resume", "--steps", 5)
    assert r.exit_code == 1 and "does not exist" in r.stderr and snapshot(run_dir) == before
    (run_dir / "train.json").write_text(json.dumps(record))
    trainer_pt = run_dir / "checkpoint" / "trainer.pt"
    trainer_pt.write_bytes(trainer_pt.read_bytes()[:100])  # truncated
    before = snapshot(run_dir)
    r = run("train", run_dir, "--resume", "--steps", 5)
    assert r.exit_code == 1 and "unreadable" in r.stderr and snapshot(run_dir) == before
    (run_dir / "checkpoint" / "state.json").unlink()
    r = run("train", run_dir, "--resume", "--steps", 5)
    assert r.exit_code == 1 and "damaged (it has no state.json)" in r.stderr
    r = run("export", run_dir, "--out", tmp_path / "e")
    assert r.exit_code == 1 and "damaged" in r.stderr and not (tmp_path / "e").exists()


def test_paths_are_stored_absolute_and_resume_from_any_folder(trained, corpus, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(corpus.parent)
    r = run("train", trained / "p" / "src", "--data", corpus.name, *STEPS, *FAST, "--out", tmp_path / "rel")
    assert r.exit_code == 0, r.output
    record = json.loads((tmp_path / "rel" / "train.json").read_text())
    assert record["data"] == str(corpus.resolve()) and Path(record["source"]).is_absolute()
    monkeypatch.chdir(tmp_path)  # elsewhere
    r = run("train", tmp_path / "rel", "--resume", "--steps", 3)
    assert r.exit_code == 0, r.output
    # the same data spelled another way is not a change; other data is allowed, with a note
    r = run("train", tmp_path / "rel", "--resume", "--steps", 4, "--data", os.path.relpath(corpus, tmp_path))
    assert r.exit_code == 0 and "data changed" not in r.stderr, r.output
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line + "\n" for line in corpus.read_text().splitlines()[1:]))
    r = run("train", tmp_path / "rel", "--resume", "--steps", 5, "--data", other)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())  # (a status line wraps at the console's width: a long temporary path moves it)
    assert "the data changed" in said and "no longer reproduces" in said
    assert json.loads((tmp_path / "rel" / "train.json").read_text())["data"] == str(other.resolve())


def test_an_older_run_with_a_relative_data_path_still_resumes(trained, corpus, tmp_path, monkeypatch):  # noqa: F811
    run_dir = copy_run(trained, tmp_path)
    record = json.loads((run_dir / "train.json").read_text())
    (run_dir / "train.json").write_text(json.dumps({**record, "data": corpus.name, "source": "p/src"}))
    monkeypatch.chdir(corpus.parent)
    r = run("train", run_dir, "--resume", "--steps", 3)
    assert r.exit_code == 0, r.output


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(trained, tmp_path):
    import shutil

    run_dir = copy_run(trained, tmp_path)
    shutil.rmtree(run_dir / "checkpoint")
    shutil.rmtree(run_dir / "adapter")
    r = run("train", run_dir, "--resume", "--json")
    assert r.exit_code == 0, r.output
    assert "starts again from step 0" in " ".join(r.stderr.split()) and json.loads(r.stdout)["step"] == 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def empty_datasets(root: Path) -> tuple[Path, Path]:
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(root / "empty"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": []})}).save_to_disk(str(root / "empty-dict"))
    return root / "empty", root / "empty-dict"


def test_empty_datasets_folders_are_clear_errors(trained, tmp_path):
    for folder in empty_datasets(tmp_path):
        for args in (["train", trained / "p" / "src", "--data", folder, *STEPS, *FAST, "--out", tmp_path / "x"],
                     ["eval", trained / "p" / "run", "--data", folder],
                     ["build", *TINY, "--calibration-data", folder, "-o", tmp_path / "b"]):
            r = run(*args)
            assert r.exit_code == 1 and "has no rows" in r.stderr and "Traceback" not in r.output, r.output
            assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("option, value", [("--batch", 0), ("--batches", 0), ("--batches", -1), ("--seq-len", 0)])
def test_eval_refuses_sizes_below_one(trained, option, value):
    r = run("eval", trained / "p" / "run", option, value)
    assert r.exit_code == 2 and option in r.stderr and "Traceback" not in r.output


def test_json_never_holds_nan():
    data = {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf"), "e": 2}}
    assert json_safe(data) == {"a": None, "b": [1.0, None], "c": {"d": None, "e": 2}}
    from click.testing import CliRunner

    from concept_cli.output import print_json

    import click

    @click.command()
    def show():
        print_json(data)

    assert json.loads(CliRunner().invoke(show).stdout)["a"] is None


@pytest.fixture(scope="module")
def planner_run(tmp_path_factory, corpus):  # noqa: F811
    root = tmp_path_factory.mktemp("pe-rel")
    assert run("build", *PE, "--set", "backbone.max_positions=64", "-o", root / "pe").exit_code == 0
    r = run("train", root / "pe", "--task", "reconstruct", "--data", corpus, *PE_STEPS, *FAST, "--out", root / "pe-train")
    assert r.exit_code == 0, r.output
    return root


def test_export_names_the_planner_executor_family(planner_run, tmp_path):
    r = run("export", planner_run / "pe-train", "--out", tmp_path / "e", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kind"] == "planner-executor" and "planner-executor model" in r.stderr
    assert json.loads((tmp_path / "e" / "concept.json").read_text())["export"]["kind"] == "planner-executor"
    card = (tmp_path / "e" / "README.md").read_text()
    assert "planner-executor" in card and "a plan of discrete concepts" in card and "length policy" not in card


def test_pruned_baseline_needs_a_block_on_a_planner_executor_run(planner_run, corpus, tmp_path):  # noqa: F811
    r = run("train", planner_run / "pe", "--baseline", "pruned", "--data", corpus, *PE_STEPS, *FAST, "--out", tmp_path / "x")
    assert r.exit_code == 2 and "--prune-layers" in r.stderr and not (tmp_path / "x").exists()


def test_the_planner_may_not_run_past_the_context(planner_run):
    r = run("generate", planner_run / "pe-train", "--prompt", "abc" * 19, "--max-new-tokens", 2)
    assert r.exit_code == 1 and "plan positions" in r.stderr and "shorten the prompt" in r.stderr


def test_an_empty_prompt_file_says_so(trained, tmp_path):
    (tmp_path / "p.txt").write_text("\n\n")
    r = run("generate", trained / "p" / "run", "--prompt-file", tmp_path / "p.txt")
    assert r.exit_code == 2 and "holds no prompt" in r.stderr


def test_every_set_problem_is_reported_at_once(tmp_path):
    r = run("build", "--backbone", "tiny-llama", "--set", "foo.x=1", "--set", "bar.y=2", "--set", "sampler.nope=3",
            "--split", "99,1,1", "-o", tmp_path / "b")
    assert r.exit_code == 2 and "4 problems" in r.stderr
    for part in ("'foo'", "'bar'", "'nope'", "sums to 101"):
        assert part in r.stderr


# -- the filesystem rules themselves ---------------------------------------------------------------
def test_replace_dir_swaps_atomically_and_falls_back(tmp_path, monkeypatch):
    for atomic in (True, False):
        old, new = tmp_path / f"old{atomic}", tmp_path / f"new{atomic}"
        old.mkdir()
        (old / "a").write_text("old")
        new.mkdir()
        (new / "b").write_text("new")
        if not atomic:
            monkeypatch.setattr(fs, "exchange", lambda a, b: False)
        fs.replace_dir(new, old)
        assert [p.name for p in old.iterdir()] == ["b"] and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oldFalse", "oldTrue"]


def test_the_fallback_puts_the_old_folder_back_when_the_swap_fails(tmp_path, monkeypatch):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    (old / "a").write_text("old")
    new.mkdir()
    monkeypatch.setattr(fs, "exchange", lambda a, b: False)
    real = os.rename

    def failing(src, dst):
        if Path(src) == new:
            raise OSError(errno.EIO, "injected")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        fs.replace_dir(new, old)
    assert (old / "a").read_text() == "old"


def test_write_atomic_keeps_the_mode_and_never_tears(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_text("old")
    path.chmod(0o640)
    fs.write_atomic(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640

    def broken(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "disk full")

    with pytest.raises(OSError):
        fs.write_atomic(path, broken)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_second_writer_is_refused_and_a_killed_ones_folder_is_swept(tmp_path):
    from concept.errors import RunFolderError

    first = fs.Staging(tmp_path / "out").open()
    with pytest.raises(RunFolderError, match="another process is writing"):
        fs.Staging(tmp_path / "out").open()
    (first.path / "x").write_text("partial")
    first.lock._fd, fd = None, first.lock._fd  # the writer dies: its lock is released, its folder stays
    os.close(fd)
    second = fs.Staging(tmp_path / "out").open()
    assert second.swept and list(second.path.iterdir()) == []
    (second.path / "y").write_text("whole")
    second.publish()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "y").read_text() == "whole"


def test_an_export_is_not_resumed_in_place(trained, tmp_path):
    r = run("export", trained / "p" / "run", "--out", tmp_path / "e")
    assert r.exit_code == 0, r.output
    before = snapshot(tmp_path / "e")
    r = run("train", tmp_path / "e", "--resume")
    assert r.exit_code == 1 and "is an export" in r.stderr and snapshot(tmp_path / "e") == before


def test_a_local_backbone_folder_is_stored_absolute_and_never_overwritten(trained, corpus, tmp_path, monkeypatch):  # noqa: F811
    """`--backbone hf --set backbone.path=RELATIVE` works from any folder afterwards, and no writing command
    may replace a folder that holds the backbone it reads (even with --force)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    project = tmp_path / "project"
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1))
    hf.save_pretrained(project / "exp" / "bb")
    monkeypatch.chdir(project)
    r = run("build", "--backbone", "hf", "--set", "backbone.path=exp/bb", "--split", "1,1,1", "--no-calibrate",
            "-o", "built")
    assert r.exit_code == 0, r.output
    stored = json.loads((project / "built" / "concept.json").read_text())["config"]["backbone"]["params"]["path"]
    assert stored == str((project / "exp" / "bb").resolve())
    monkeypatch.chdir(tmp_path)  # elsewhere: the run still finds its backbone
    assert run("inspect", project / "built", "--json").exit_code == 0
    monkeypatch.chdir(project)
    before = snapshot(project / "exp")
    r = run("build", "--backbone", "hf", "--set", "backbone.path=exp/bb", "--split", "1,1,1", "--no-calibrate",
            "-o", "exp", "--force")
    assert r.exit_code == 1 and "contains the backbone" in r.stderr and "Traceback" not in r.output, r.output
    r = run("train", "built", "--data", corpus, *STEPS, *FAST, "--out", "exp", "--force")
    assert r.exit_code == 1 and "contains the backbone" in r.stderr and "Traceback" not in r.output, r.output
    r = run("export", "built", "--out", "exp", "--force")
    assert r.exit_code == 1 and "contains the backbone" in r.stderr and "Traceback" not in r.output, r.output
    assert snapshot(project / "exp") == before


def test_the_sweep_still_runs(tmp_path, monkeypatch):
    """The sweep of docs/reliability.md cannot rot unseen: its scratch folder is set up (builds, trains of
    both families, an export, a frontier) and the last input of every command runs, with no traceback and
    no damage (the whole sweep: `python -m benchmarks.reliability_sweep`, several minutes)."""
    from benchmarks import reliability_sweep as sweep

    monkeypatch.chdir(tmp_path)
    sweep.scratch(tmp_path)
    last = {command: (command, argv, writes) for command, argv, writes in sweep.CASES}
    assert set(last) >= {"build", "train", "eval", "lm-eval", "export", "generate", "frontier"}
    rows = sweep.sweep(tmp_path, list(last.values()))
    assert [r for r in rows if r["traceback"] or r["damaged"] or r["litter"]] == []


# -- issue 43: misleading messages and tracebacks on odd input -------------------------------------
def clean_error(r, code: int, *parts: str) -> None:
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    for part in parts:
        assert part in r.stderr, (part, r.stderr)


def test_odd_prompts_are_clean_errors(trained, tmp_path):
    from click.testing import CliRunner

    from concept_cli.main import cli

    r = CliRunner().invoke(cli, ["generate", str(trained / "p" / "run"), "--prompt-file", "-"], input=b"caf\xe9\n")
    clean_error(r, 1, "stdin is not UTF-8 text", "convert it to UTF-8")  # (UnicodeDecodeError)
    r = run("generate", trained / "p" / "run", "--prompt-file", tmp_path)
    clean_error(r, 1, "is a folder")  # ("no such file")
    assert "no such file" not in r.stderr


def test_empty_and_blank_data_say_what_they_are(trained, tmp_path):
    r = run("train", trained / "p" / "src", "--data", "", *STEPS, *FAST, "--out", tmp_path / "x")
    clean_error(r, 2, "data: '' is an empty path")  # (it read the working folder, or the default corpus)
    r = run("eval", trained / "p" / "run", "--data", "")
    clean_error(r, 1, "--data '' is an empty path")  # (it evaluated the run's own data)
    (tmp_path / "blank.txt").write_text("  \n\n\t \n")
    r = run("train", trained / "p" / "src", "--data", tmp_path / "blank.txt", *STEPS, *FAST, "--out", tmp_path / "x")
    clean_error(r, 1, "holds no documents (it holds only whitespace)")  # ("(it is empty)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt"]


def test_a_malformed_datasets_folder_is_a_clean_error(trained, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a b c"] * 4}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "ds" / "dataset_info.json").write_text("[]")  # (AttributeError: 'list' object has no attribute)
    r = run("eval", trained / "p" / "run", "--data", tmp_path / "ds")
    clean_error(r, 1, "cannot read the Hugging Face datasets folder", "save it again with Dataset.save_to_disk")


def test_more_fewshot_examples_than_a_task_has(trained):
    r = run("eval", trained / "p" / "run", "--tasks", "concept_cloze", "--num-fewshot", 100000, "--limit", 1)
    clean_error(r, 2, "--num-fewshot 100000: more examples than a task of concept_cloze has")  # (ValueError)
