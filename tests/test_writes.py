"""Issue 43, the writing half: each example of the report that a writing command could hit, as a user ran
it, now refused in one line before anything is written, or survived with nothing lost.

- outputs: ``--force`` replaces only a run folder (never the working folder, one that holds it, or a folder
  of other files); odd output paths are refused before any work; a folder that appears at the output while
  a command runs is never replaced; an interrupted command removes the parent folders it created;
- locks: every writer of a run holds its lock, tried with two real processes (one stopped in the middle of
  a checkpoint write, then killed with SIGKILL: the next writer sweeps what it left);
- check, then write: a resume that finds any damaged file exits 1 with one line and leaves every file
  byte-identical; a resume short of disk space leaves train.json as it was;
- fingerprints: a checkpoint from another build, data changed under the same name, replaced backbone weights;
- resources: full disks, file-size limits and quotas as one line naming the folder (a child process under
  ``RLIMIT_FSIZE``).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import concept
from concept import checkpoint, fs
from tests.faults import snapshot, start_paused
from tests.test_cli_train import FAST, TINY, run
from tests.test_nothing_lost import FRONTIER
from tests.test_training import corpus  # noqa: F401  (fixture)

RECIPE = [*FAST, "--steps", 2, "--checkpoint-every", 2, "--eval-every", 100, "--calibration-batches", 1]

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):  # noqa: F811
    """``src`` (a build), ``run`` (trained 2 steps from it, on ``data.jsonl``) and an older build ``old``."""
    root = tmp_path_factory.mktemp("writes")
    shutil.copy(corpus, root / "data.jsonl")
    assert run("build", *TINY, "-o", root / "src").exit_code == 0
    assert run("build", *TINY, "--seed", 2, "-o", root / "old").exit_code == 0
    r = run("train", root / "src", "--data", root / "data.jsonl", *RECIPE, "--out", root / "run")
    assert r.exit_code == 0, r.output
    return root


def error_line(r, code: int = 1) -> str:
    """The one ``error:`` line of a refused command (exit ``code``, no traceback), without the prefix."""
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), r.output
    assert sum(line.startswith("error:") for line in lines) == 1, r.output
    return lines[-1][len("error: "):]


def copy_run(trained: Path, where: Path, name: str = "run") -> Path:
    shutil.copytree(trained / "run", where / name)
    return where / name


# -- outputs ---------------------------------------------------------------------------------------
def test_force_replaces_only_a_run_folder(trained, tmp_path, monkeypatch):
    """`mkdir p && echo hi > p/f && cd p && concept build ... -o ../p --force` deleted f; a folder that is not a
    run is refused with or without --force, and the refusal does not suggest --force."""
    def never(*args, **kwargs):
        raise AssertionError("the refusal came after the build")

    monkeypatch.setattr(concept, "build", never)  # every refusal below comes before any work
    p = tmp_path / "p"
    p.mkdir()
    (p / "f").write_text("hi")
    copy_run(trained, tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.chdir(p)
    assert "current working folder" in error_line(run("build", *TINY, "-o", "../p", "--force"))
    monkeypatch.chdir(tmp_path / "run")  # the working folder, even when it is a run
    assert "current working folder" in error_line(run("build", *TINY, "-o", "../run", "--force"))
    assert "current working folder" in error_line(run("export", ".", "--out", tmp_path, "--force"))
    monkeypatch.chdir(tmp_path)
    for args in (["build", *TINY, "-o", "p"], ["build", *TINY, "-o", "p", "--force"],
                 ["train", trained / "src", "--data", trained / "data.jsonl", *RECIPE, "--out", "p", "--force"],
                 ["export", "run", "--out", "p", "--force"]):
        line = error_line(run(*args))
        assert "not a concept run folder (it holds f)" in line and "--force" not in line, line
    assert snapshot(tmp_path) == before


def test_odd_output_paths_are_refused_before_any_work(trained, tmp_path, monkeypatch):
    """Dangling links and link loops used to build fully and then fail, leaving .NAME.partial; --force onto a
    link broke every later write there; `-o .` said "PosixPath('.') has an empty name"; a 255-character name
    failed only after building."""
    def never(*args, **kwargs):
        raise AssertionError("the refusal came after the build")

    monkeypatch.setattr(concept, "build", never)
    monkeypatch.chdir(tmp_path)
    copy_run(trained, tmp_path)
    Path("dangling").symlink_to("nowhere")
    Path("loop").symlink_to("loop")
    Path("link").symlink_to("run")
    Path("file").write_text("x")
    before = snapshot(tmp_path)
    cases = {"dangling": "which does not exist", "loop": "symbolic link loop", "link": "is a symbolic link (to run)",
             ".": "not a folder name", "..": "not a folder name", "x" * 250: "choose a shorter name",
             "file/x": "file is a file, not a folder"}
    for i, (out, expected) in enumerate(cases.items()):  # (one check for all: build each time, the others in turn)
        other = (["export", "run", "--out", out, "--force"] if i % 2 else
                 ["train", trained / "src", "--data", trained / "data.jsonl", "--out", out, "--force"])
        for args in (["build", *TINY, "-o", out, "--force"], other):
            assert expected in error_line(run(*args)), (args, expected)
    monkeypatch.setattr(fs.os, "access", lambda path, mode: False)  # (the tests may run as root)
    assert "no permission to create files in" in error_line(run("build", *TINY, "-o", "new"))
    assert snapshot(tmp_path) == before


def test_train_dot_from_inside_a_run(trained, tmp_path, monkeypatch):
    """`cd runs/t && concept train .` said "PosixPath('.') has an empty name"; it trains into ../t-train."""
    shutil.copytree(trained / "src", tmp_path / "t")
    monkeypatch.chdir(tmp_path / "t")
    r = run("train", ".", "--data", trained / "data.jsonl", *RECIPE, "--steps", 1)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t-train" / "checkpoint" / "state.json").is_file()
    assert "not a folder name" in error_line(run("train", ".", "--out", ".", "--steps", 1))


def test_an_interrupted_output_leaves_no_new_parent_folders(trained, tmp_path, monkeypatch):
    """An interrupted `-o a/b/x` left the new empty parents a/b; a failure removes what it created."""
    from concept import builder, data, export

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "injected")

    monkeypatch.chdir(tmp_path)
    Path("kept").mkdir()
    with monkeypatch.context() as m:
        m.setattr(builder, "save_file", interrupt)
        assert run("build", *TINY, "-o", "a/b/x").exit_code == 130
        assert run("build", *TINY, "-o", "kept/b/x").exit_code == 130
        m.setattr(builder, "save_file", fail)
        assert run("build", *TINY, "-o", "a/b/x").exit_code == 1
    with monkeypatch.context() as m:
        m.setattr(export, "model_card", interrupt)
        assert run("export", trained / "run", "--out", "a/b/x").exit_code == 130
    with monkeypatch.context() as m:
        m.setattr(data, "PackedSequences", interrupt)
        assert run("train", trained / "src", "--data", trained / "data.jsonl", *RECIPE, "--out", "a/b/x").exit_code == 130
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir("kept") == []


def test_a_folder_another_program_puts_at_the_output_is_never_replaced(trained, tmp_path, monkeypatch):
    """A folder created at -o by another program while a build ran was replaced without --force."""
    from concept import builder

    real_build, real_save = concept.build, builder.save_file
    monkeypatch.chdir(tmp_path)

    def build_while_another_writes(*args, **kwargs):  # during the build: a folder with a file of its own
        Path("x").mkdir()
        Path("x", "mine.txt").write_text("mine")
        return real_build(*args, **kwargs)

    monkeypatch.setattr(concept, "build", build_while_another_writes)
    assert "not a concept run folder (it holds mine.txt)" in error_line(run("build", *TINY, "-o", "x"))
    monkeypatch.setattr(concept, "build", real_build)

    def save_while_another_writes(state, path, *args, **kwargs):  # while saving: an empty folder
        Path("y").mkdir(exist_ok=True)
        return real_save(state, path, *args, **kwargs)

    monkeypatch.setattr(builder, "save_file", save_while_another_writes)
    assert "was created by another program" in error_line(run("build", *TINY, "-o", "y"))
    assert sorted(os.listdir(tmp_path)) == ["x", "y"] and os.listdir("x") == ["mine.txt"] and os.listdir("y") == []


# -- locks -----------------------------------------------------------------------------------------
def test_a_second_writer_is_refused_by_a_new_run_training_in_place(trained, tmp_path):
    """`concept train runs/t --out k ... &` then `concept train OTHER --out k --force`: k ended with the second
    run's records, the first run's checkpoint and interleaved metrics. A run trains under its lock."""
    from concept.training import TrainConfig, Trainer

    config = TrainConfig(steps=1, seq_len=32, batch=2, eval_batches=1, data=str(trained / "data.jsonl"),
                         calibration_batches=1, lora=concept.lora.LoraSettings(rank=2))
    trainer = Trainer.start(trained / "src", tmp_path / "k", config)  # published, trained in place
    before = snapshot(tmp_path)
    line = error_line(run("train", trained / "old", "--data", trained / "data.jsonl", *RECIPE, "--out",
                          tmp_path / "k", "--force"))
    assert line.startswith("another process is writing") and f"process {os.getpid()}" in line, line
    assert error_line(run("train", tmp_path / "k", "--resume", "--steps", 2)).startswith("another process is writing")
    assert error_line(run("build", *TINY, "-o", tmp_path / "k", "--force")).startswith("another process is writing")
    assert snapshot(tmp_path) == before
    trainer.train()
    assert not (tmp_path / ".k.lock").exists()
    fs.Lock(tmp_path / "k").acquire().release()  # free for the next writer


def test_two_processes_one_killed_mid_checkpoint(trained, tmp_path):
    """Two real processes: a resume stopped in the middle of writing its checkpoint holds the run's lock, so a
    second resume, a `--force` train and a `--force` build into it are refused in one line (two concurrent
    resumes both exited 0 with steps logged twice); a reader (export) still works and sweeps nothing. The
    first is then killed with SIGKILL: its .checkpoint-XXXX folder stays, and the next resume sweeps it."""
    k = copy_run(trained, tmp_path, "k")
    paused = tmp_path.parent / f"{tmp_path.name}-paused"
    child = start_paused(tmp_path, "trainer.pt", ["train", "k", "--resume", "--steps", 4, "--checkpoint-every", 1],
                         paused)
    try:
        deadline = time.monotonic() + 300
        while not paused.exists():
            assert child.poll() is None, paused.with_suffix(".log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the child never reached its checkpoint"
            time.sleep(0.2)
        leftover = [p for p in k.iterdir() if p.name.startswith(".checkpoint-")]
        assert len(leftover) == 1 and (tmp_path / ".k.lock").exists()
        before = snapshot(tmp_path)
        for args in (["train", "k", "--resume", "--steps", 6],
                     ["train", trained / "src", "--data", trained / "data.jsonl", *RECIPE, "--out", "k", "--force"],
                     ["build", *TINY, "-o", "k", "--force"]):
            line = error_line(run(*[a if a != "k" else k for a in args]))
            assert line.startswith(f"another process is writing {k} (process {child.pid} holds"), line
        r = run("export", k, "--out", tmp_path.parent / f"{tmp_path.name}-export")
        assert r.exit_code == 0, r.output
        assert snapshot(tmp_path) == before  # nothing swept under a writer that is alive
    finally:
        child.kill()  # a real SIGKILL, in the middle of its step-3 checkpoint
        child.wait()
    assert leftover[0].is_dir()
    r = run("train", k, "--resume", "--steps", 4)
    assert r.exit_code == 0, r.output
    assert f"removed {leftover[0].name}" in r.stderr
    assert not [p for p in k.iterdir() if p.name.startswith(".")] and not (tmp_path / ".k.lock").exists()
    assert [json.loads(line)["step"] for line in (k / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


# -- check, then write ---------------------------------------------------------------------------------
def with_field(data: bytes, **fields) -> bytes:
    return json.dumps({**json.loads(data), **fields}).encode()


def flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


STATE = "checkpoint/state.json"
DAMAGE = {  # what a user found (the first seven of the issue) and more of the same: file -> how it is damaged
    "state.json {x": (STATE, lambda b: b"{x"),
    "state.json {}": (STATE, lambda b: b"{}"),
    'state.json {"step": "three"}': (STATE, lambda b: with_field(b, step="three")),
    'state.json {"step": -5}': (STATE, lambda b: with_field(b, step=-5)),
    'state.json {"step": 2.5}': (STATE, lambda b: with_field(b, step=2.5)),
    "state.json null": (STATE, lambda b: b"null"),
    "state.json empty": (STATE, lambda b: b""),
    "metrics.jsonl a non-object line": ("metrics.jsonl", lambda b: b"[1, 2]\n" + b),
    "metrics.jsonl a number as the last line": ("metrics.jsonl", lambda b: b + b"3\n"),
    "metrics.jsonl a line that is not JSON": ("metrics.jsonl", lambda b: b"{x\n" + b),
    "metrics.jsonl a row without a step": ("metrics.jsonl", lambda b: b'{"loss": 1.0}\n' + b),
    "train.json null": ("train.json", lambda b: b"null"),
    "train.json a list": ("train.json", lambda b: b"[]"),
    "train.json {x": ("train.json", lambda b: b"{x"),
    'train.json "steps": "many"': ("train.json", lambda b: with_field(b, steps="many")),
    "modules.safetensors empty": ("checkpoint/modules.safetensors", lambda b: b""),
    "modules.safetensors half": ("checkpoint/modules.safetensors", lambda b: b[:len(b) // 2]),
    "modules.safetensors removed": ("checkpoint/modules.safetensors", lambda b: None),
    "adapter.safetensors a flipped byte": ("checkpoint/adapter.safetensors", flip),
    "trainer.pt a flipped byte": ("checkpoint/trainer.pt", flip),
}


def damage(run_dir: Path, case: str) -> str:
    rel, how = DAMAGE[case]
    new = how((run_dir / rel).read_bytes())
    if new is None:
        (run_dir / rel).unlink()
    else:
        (run_dir / rel).write_bytes(new)
    return Path(rel).name


def resume_problems(trained: Path, where: Path, case: str) -> list[str]:
    """Resume a copy of the run with ``case``'s damage: the ways it broke the rule (exit 1, one line naming the
    damaged file, no traceback, every file byte-identical)."""
    run_dir = copy_run(trained, where, case.replace(" ", "_").replace('"', "").replace("/", "_"))
    name = damage(run_dir, case)
    before = snapshot(where)
    r = run("train", run_dir, "--resume", "--steps", 5)
    problems = [] if snapshot(where) == before else ["the folder changed"]
    if r.exit_code != 1 or "Traceback" in r.output:
        problems.append(f"exit {r.exit_code}: {r.output[-300:]}")
    elif not r.stderr.splitlines()[-1].startswith("error: ") or name not in r.stderr.splitlines()[-1]:
        problems.append(f"not one line naming {name}: {r.stderr[-300:]}")
    return problems


def test_a_resume_checks_every_file_before_it_writes(trained, tmp_path):
    """Damaged state.json, metrics.jsonl, train.json and checkpoint files: tracebacks, a metrics.jsonl emptied
    and a train.json rewritten before the failure, `{"step": 2.5}` training steps 3.5, 4.5, 5.5. Now exit 1,
    one line, and the SHA-256 of every file is the same before and after."""
    failures = {case: resume_problems(trained, tmp_path, case) for case in DAMAGE}
    assert not {case: p for case, p in failures.items() if p}, json.dumps(failures, indent=1)


def test_negative_control_a_resume_that_writes_first_is_caught(trained, tmp_path, monkeypatch):
    """The same check, with the state.json check switched off and training skipped: `{"step": -5}` empties
    metrics.jsonl and exits 0, and the check says so."""
    from concept.training import Trainer

    monkeypatch.setattr(checkpoint, "meta_problem", lambda meta: None)
    monkeypatch.setattr(Trainer, "train", lambda self, progress=None: {})
    problems = resume_problems(trained, tmp_path, 'state.json {"step": -5}')
    assert "the folder changed" in problems and any(p.startswith("exit 0") for p in problems), problems


def test_a_resume_short_of_disk_space_leaves_train_json(trained, tmp_path, monkeypatch):
    """A resume that failed for lack of disk space left train.json rewritten. Too little free space is refused
    before anything is written; a disk that fills during the checkpoint write leaves train.json and the
    checkpoint as they were, with one line naming the disk."""
    from collections import namedtuple

    run_dir = copy_run(trained, tmp_path)
    before = snapshot(tmp_path)
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(fs.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
        line = error_line(run("train", run_dir, "--resume", "--steps", 3))
    assert line.startswith(f"the disk holding {run_dir} has 1000 B free") and snapshot(tmp_path) == before

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save_file", full)
    line = error_line(run("train", run_dir, "--resume", "--steps", 3))
    assert line.startswith(f"could not write the checkpoint at step 3: the disk holding {run_dir} is full"), line
    assert "the previous checkpoint (step 2) is intact" in line
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "run/metrics.jsonl"} == \
        {k: v for k, v in before.items() if k != "run/metrics.jsonl"}  # (the log holds step 3: resume drops it)


# -- fingerprints ----------------------------------------------------------------------------------
def test_a_checkpoint_from_another_build_is_refused(trained, tmp_path, monkeypatch):
    """A checkpoint copied from another build (another split, or tiny-qwen2) resumed and evaluated with exit 0."""
    others = {"split": [a if a != "1,2,1" else "2,1,1" for a in TINY],
              "qwen": [a if a != "tiny-llama" else "tiny-qwen2" for a in TINY]}
    for name, build in others.items():
        folder = tmp_path / name
        assert run("build", *build, "-o", folder).exit_code == 0
        for part in ("train.json", "metrics.jsonl", "checkpoint", "adapter"):
            (shutil.copytree if (trained / "run" / part).is_dir() else shutil.copy)(trained / "run" / part, folder / part)
        before = snapshot(tmp_path)
        for args in (["eval", folder, "--data", trained / "data.jsonl", "--batches", 1, "--batch", 2],
                     ["train", folder, "--resume", "--steps", 5], ["export", folder, "--out", tmp_path / "e"]):
            line = error_line(run(*args))
            assert line.startswith(f"{folder / 'checkpoint'} was not written for this run's build"), line
        assert snapshot(tmp_path) == before
    monkeypatch.setattr(checkpoint, "check_origin", lambda *args: None)  # negative control: what the issue saw
    r = run("eval", tmp_path / "split", "--data", trained / "data.jsonl", "--batches", 1, "--batch", 2)
    assert r.exit_code == 0, r.output


def test_data_changed_under_the_same_name_warns_on_resume(trained, tmp_path):
    """The --data file edited between train and --resume gave no note. Now a warning; --accept-data-change
    accepts it (a note); unchanged data says nothing."""
    def said(r) -> str:  # (status lines wrap at the console's width)
        assert r.exit_code == 0, r.output
        return " ".join(r.stderr.split())

    run_dir = copy_run(trained, tmp_path)
    shutil.copy(trained / "data.jsonl", tmp_path / "data.jsonl")
    record = json.loads((run_dir / "train.json").read_text())
    (run_dir / "train.json").write_text(json.dumps({**record, "data": str(tmp_path / "data.jsonl")}))
    text = said(run("train", run_dir, "--resume", "--steps", 3))
    assert "warning" not in text and "the data" not in text, text
    lines = (tmp_path / "data.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "data.jsonl").write_text("".join(lines[1:]))
    text = said(run("train", run_dir, "--resume", "--steps", 4))
    assert f"warning: the documents of --data {tmp_path / 'data.jsonl'} changed since the checkpoint at step 3" \
        in text and "pass --accept-data-change to accept the change" in text, text
    (tmp_path / "data.jsonl").write_text("".join(lines[2:]))
    text = said(run("train", run_dir, "--resume", "--steps", 5, "--accept-data-change"))
    assert "warning:" not in text and "(accepted with --accept-data-change)" in text, text
    r = run("train", trained / "src", "--accept-data-change", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "--accept-data-change is for --resume" in r.stderr


def test_replaced_backbone_weights_are_refused(trained, tmp_path):
    """Replaced weights in an hf backbone folder that a run uses only produced a transformers load report."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def backbone(seed: int) -> None:
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "bb")

    backbone(0)
    assert run("build", "--backbone", "hf", "--set", f"backbone.path={tmp_path / 'bb'}", "--split", "1,1,1",
               "--no-calibrate", "-o", tmp_path / "b").exit_code == 0
    r = run("train", tmp_path / "b", "--data", trained / "data.jsonl", *RECIPE, "--steps", 1, "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    concept.load(tmp_path / "r")  # (the same weights: loads)
    backbone(1)  # other weights, the same shapes
    before = snapshot(tmp_path)
    for args in (["eval", tmp_path / "r", "--data", trained / "data.jsonl", "--batches", 1, "--batch", 2],
                 ["train", tmp_path / "r", "--resume", "--steps", 2]):
        line = error_line(run(*args))
        assert line.startswith(f"the backbone folder {tmp_path / 'bb'} changed since") and \
            "model.safetensors changed" in line, line
    assert snapshot(tmp_path) == before


# -- resources -------------------------------------------------------------------------------------
FSIZE_CHILD = """
import json, resource, signal, sys
from click.testing import CliRunner
from concept_cli.main import cli
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
results = [CliRunner().invoke(cli, argv) for argv in json.loads(sys.argv[2])]
print(json.dumps([[r.exit_code, r.stderr, repr(r.exception)] for r in results]))
"""


def test_a_full_disk_is_one_line_and_changes_nothing(trained, tmp_path):
    """`ulimit -f` (or a full disk) during build, export or a checkpoint write: tracebacks ("File too large"),
    and "unexpected pos 434176 vs 434068" for a checkpoint. Now one line naming the folder, nothing left behind,
    nothing existing changed. A child process writes under RLIMIT_FSIZE (100 kB: less than the tiny backbone's
    weights and a checkpoint's trainer.pt)."""
    shutil.copytree(trained / "old", tmp_path / "b_old")
    run_dir = copy_run(trained, tmp_path)
    before = snapshot(tmp_path)
    argv = [["build", *TINY, "-o", str(tmp_path / "b_old"), "--force"],
            ["export", str(run_dir), "--out", str(tmp_path / "a" / "e")],
            ["train", str(run_dir), "--resume", "--steps", "3"]]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(100_000), json.dumps(argv)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout.splitlines()[-1])
    for (code, stderr, exception), folder in zip(results, (tmp_path / "b_old", tmp_path / "a" / "e", run_dir)):
        last = stderr.strip().splitlines()[-1]
        assert code == 1 and "Traceback" not in stderr and "unexpected pos" not in stderr, (code, stderr, exception)
        assert f"a file in {folder} would exceed this shell's file-size limit (97.7 KiB, `ulimit -f`)" in last, last
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "run/metrics.jsonl"} == \
        {k: v for k, v in before.items() if k != "run/metrics.jsonl"}


def test_full_disks_and_quotas_name_the_folder(trained, tmp_path, monkeypatch):
    """ENOSPC and EDQUOT (no child needed: the error is raised where the write happens)."""
    from concept import builder, export

    def raising(code):
        def write(*args, **kwargs):
            raise OSError(code, os.strerror(code))
        return write

    monkeypatch.chdir(tmp_path)
    shutil.copytree(trained / "old", "b_old")
    before = snapshot(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(builder, "save_file", raising(errno.ENOSPC))
        line = error_line(run("build", *TINY, "-o", "b_old", "--force"))
        assert line == (f"the disk holding b_old is full ({os.strerror(errno.ENOSPC)}); free some space or choose a "
                        f"folder on another disk; nothing was written (b_old is unchanged)"), line
    with monkeypatch.context() as m:
        m.setattr(export, "model_card", raising(errno.EDQUOT))
        line = error_line(run("export", trained / "run", "--out", "e"))
        assert line.startswith("your disk quota on the disk holding e is used up"), line
    assert snapshot(tmp_path) == before


def test_the_frontier_never_replaces_a_folder_that_is_not_a_run(trained, tmp_path):
    """`frontier --force` replaced any folder in --out that was not one of its runs."""
    fr = tmp_path / "fr"
    (fr / "s1-2-1_r0.5").mkdir(parents=True)
    (fr / "s1-2-1_r0.5" / "notes.txt").write_text("mine")
    argv = [a.replace("CORPUS", str(trained / "data.jsonl")) for a in FRONTIER]
    r = run(*argv[:-1], fr, "--ratios", "0.5", "--force", "--dry-run")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    problem = r.stderr.splitlines()[-1]
    assert "is not a run folder" in problem and "--force" not in problem, r.stderr
    assert (fr / "s1-2-1_r0.5" / "notes.txt").read_text() == "mine"
