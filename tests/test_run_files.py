"""One validating reader for run files (``concept.run_files``, issue 43 item 6): each example of the issue, as a
user ran it, is now one error line naming the file, what is wrong and what to do, and changes nothing; and the
reader's checks themselves, each against a file that passes (the negative control: the same check on an
undamaged file says nothing)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from concept import run_files
from concept.errors import RunFolderError
from tests.faults import snapshot
from tests.test_cli_train import TINY
from tests.test_reliability import STEPS
from tests.test_training import corpus  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--seq-len", 16, "--batch", 2, "--lora-rank", 2, "--eval-batches", 1, "--log-every", 2]
OTHER = ["--backbone", "tiny-llama", "--split", "1,1,1", "--set", "backbone.layers=3", "--set", "backbone.hidden=48",
         "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=16"]


def run(*args):
    from click.testing import CliRunner

    from concept_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


def one_error_line(r) -> str:
    """The refusal's one line (exit 1, no traceback, nothing after it)."""
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), (r.exception, r.output)
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, r.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    root = tmp_path_factory.mktemp("run-files")
    for args in (["build", *TINY, "--no-calibrate", "-o", root / "m"], ["build", *OTHER, "--no-calibrate", "-o", root / "m2"],
                 ["train", root / "m", "--data", corpus, *STEPS, *FAST, "--out", root / "run"]):
        r = run(*args)
        assert r.exit_code == 0, r.output
    return root


@pytest.fixture()
def copy(runs, tmp_path):
    def make(name: str):
        shutil.copytree(runs / name, tmp_path / name)
        return tmp_path / name
    return make


def test_train_from_a_zero_byte_or_truncated_modules_file(copy, corpus, tmp_path):  # noqa: F811
    for damage in (lambda b: b"", lambda b: b[:len(b) // 2]):
        src = copy("m")
        data = (src / "modules.safetensors").read_bytes()
        (src / "modules.safetensors").write_bytes(damage(data))
        before = snapshot(tmp_path)
        line = one_error_line(run("train", src, "--data", corpus, *STEPS, *FAST, "--out", tmp_path / "x"))
        assert f"{src / 'modules.safetensors'}:" in line and "rebuild with `concept build" in line
        assert ("is empty (0 bytes)" if not damage(data) else "not a readable safetensors file") in line
        assert snapshot(tmp_path) == before  # no staging folder, no lock, no run
        shutil.rmtree(src)


@pytest.mark.parametrize("content, problem", [
    ("{x", "is not valid JSON (Expecting property name"),
    ("null", "holds null, not a training record"),
    ('{"steps": "three", "seq_len": 16, "batch": 2, "lr": 0.1, "lora": {"rank": 2}, "seed": 0}',
     "steps: expected an integer, got 'three'"),
    ('{"steps": 2}', "no 'seq_len', 'batch', 'lr', 'lora', 'seed'"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
])
def test_a_damaged_train_json_is_one_line_for_every_reader(copy, tmp_path, content, problem):
    run_dir = copy("run")
    (run_dir / "train.json").write_bytes(content.encode() if isinstance(content, str) else content)
    before = snapshot(run_dir)
    for args in (["eval", run_dir], ["export", run_dir, "--out", tmp_path / "e"], ["inspect", run_dir],
                 ["generate", run_dir, "--prompt", "x"], ["train", run_dir, "--resume", "--steps", 3]):
        line = one_error_line(run(*args))
        assert f"{run_dir / 'train.json'}:" in line and problem in line and "restore it" in line, (args, line)
        assert "no train.json" not in line  # (train.json = null said "not a training run (no train.json)")
    assert snapshot(run_dir) == before and not (tmp_path / "e").exists()


@pytest.mark.parametrize("edit, problem", [
    (lambda r: r["config"]["streaming"].update(sampler=5), "sampler: expected {'name'"),
    (lambda r: r["config"]["streaming"].update(vocabulary={"name": "embedding", "params": [1]}),
     "vocabulary.params: expected an object"),
    (lambda r: r["config"].update(backbone={"name": 3}), "backbone: expected {'name'"),
    (lambda r: r.update(config="oops"), "'config' is a string, not an object"),
    (lambda r: r.pop("config"), "has no 'config'"),
    (lambda r: r.update(format=9), "written by a newer concept (format 9"),
    (lambda r: r["config"].update(seed="one"), "seed: expected an integer"),
])
def test_a_concept_json_with_a_section_of_the_wrong_type(copy, edit, problem):
    run_dir = copy("run")
    record = json.loads((run_dir / "concept.json").read_text())
    edit(record)
    (run_dir / "concept.json").write_text(json.dumps(record))
    for args in (["eval", run_dir], ["inspect", run_dir]):
        line = one_error_line(run(*args))  # (a wrong-type section was `invalid config` over three lines, exit 2)
        assert f"{run_dir / 'concept.json'}:" in line and problem in line, line


def test_a_backbone_file_of_another_model_is_one_line_not_hundreds(copy, runs):
    run_dir = copy("run")
    shutil.copyfile(runs / "m2" / "backbone.safetensors", run_dir / "backbone.safetensors")
    for args in (["eval", run_dir], ["inspect", run_dir], ["export", run_dir, "--out", run_dir.parent / "e"]):
        r = run(*args)
        line = one_error_line(r)  # ("Unexpected key(s) in state_dict", hundreds of names)
        assert "backbone.safetensors: does not hold the weights of this run's backbone" in line
        assert re.search(r"of another shape \(e\.g\. '[a-z_.]+weight': 256x48 in the file, 256x32 in the model\)", line)
        assert len(line) < 500


def test_invalid_metrics_lines_for_eval_and_export(copy, tmp_path):
    run_dir = copy("run")
    rows = (run_dir / "metrics.jsonl").read_text()
    for bad, problem in (("[1, 2]\n", "line 1 holds a list, not an object"), ('{"loss": 1}\n', "line 1 has no step"),
                         ("{x\n", "line 1 is not valid JSON")):
        (run_dir / "metrics.jsonl").write_text(bad + rows)
        for args in (["eval", run_dir, "--batches", 1, "--batch", 1], ["export", run_dir, "--out", tmp_path / "e"]):
            line = one_error_line(run(*args))
            assert f"{run_dir / 'metrics.jsonl'}: {problem}" in line, line
    (run_dir / "metrics.jsonl").write_text(rows + '{"step": 3, "lo')  # a torn last line: a killed writer's
    assert [r["step"] for r in run_files.read_metrics(run_dir)] == [1, 2]


def test_a_frontier_rerun_names_a_damaged_run(tmp_path):
    from concept import fs
    from concept.recipes import frontier

    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "concept.json").write_text("{x")
    fs.write_atomic(folder / "train.json", "{}")
    state = frontier.run_state(folder, None)
    assert state["status"] == "damaged" and "concept.json: is not valid JSON" in state["detail"]


# -- the reader's checks, unit by unit ----------------------------------------------------------
def test_weights_checks_name_the_first_difference_of_each_kind(runs, tmp_path):
    state = load_file(runs / "m" / "modules.safetensors")
    expected = {k: v.clone() for k, v in state.items()}
    assert run_files.weights_problems(state, expected) == []  # the control: the file against its own model
    name = sorted(state)[0]
    odd = {**state, "extra.weight": torch.zeros(2)}
    odd[name] = odd[name].to(torch.int32)
    del odd[sorted(state)[1]]
    shaped = sorted(state)[2]
    odd[shaped] = torch.zeros(3, 3)
    problems = run_files.weights_problems(odd, expected)
    assert problems[0].startswith("1 of the model's tensors missing") and "1 tensors the model does not have" in problems[1]
    assert "of another shape" in problems[2] and "3x3 in the file" in problems[2]
    assert "of another dtype" in problems[3] and "torch.int32 in the file" in problems[3]
    save_file(odd, tmp_path / "odd.safetensors")
    with pytest.raises(run_files.RunFileError, match="odd.safetensors: does not hold the weights of this run's new"):
        run_files.check_weights(run_files.read_weights(tmp_path / "odd.safetensors"), expected,
                                tmp_path / "odd.safetensors", "new modules")


def test_headers_are_read_without_the_data(runs, tmp_path):
    file = tmp_path / "w.safetensors"
    shutil.copyfile(runs / "m" / "modules.safetensors", file)
    header = run_files.weights_header(file)
    assert header and all(dtype == "F32" for dtype, _ in header.values())
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    for damaged, problem in ((b"", "is empty (0 bytes)"), (data[:len(data) // 2], "incomplete metadata"),
                             (data[:8 + size // 2] + bytes([data[8 + size // 2] ^ 0xFF]) + data[9 + size // 2:], "invalid")):
        file.write_bytes(damaged)
        with pytest.raises(run_files.RunFileError, match=re.escape(problem)):
            run_files.weights_header(file)


def test_check_files_cross_checks_the_copies_and_the_lora_rank(copy, runs):
    run_dir = copy("run")
    record, train = run_files.check_files(run_dir)  # the control: an undamaged run passes
    assert train["lora"]["rank"] == 2 and record["config"]["family"] == "streaming"
    shutil.copyfile(runs / "m2" / "modules.safetensors", run_dir / "modules.safetensors")
    with pytest.raises(RunFolderError, match="does not hold the tensors of the run's checkpoint"):
        run_files.check_files(run_dir)
    shutil.copyfile(runs / "m" / "modules.safetensors", run_dir / "modules.safetensors")
    train["lora"]["rank"] = 4
    (run_dir / "train.json").write_text(json.dumps(train))
    with pytest.raises(RunFolderError, match="LoRA adapters of another rank than train.json's 4"):
        run_files.check_files(run_dir)


def test_a_training_record_of_another_family(copy):
    run_dir = copy("run")
    train = json.loads((run_dir / "train.json").read_text())
    (run_dir / "train.json").write_text(json.dumps({**train, "task": "reconstruct"}))
    with pytest.raises(RunFolderError, match="sets task 'reconstruct' \\(planner-executor\\), which this streaming run"):
        run_files.check_files(run_dir)


def test_allocation_failures_are_one_line(copy, monkeypatch):
    import concept

    run_dir = copy("run")
    for exc in (MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate "
                                            "memory: you tried to allocate 25600000000 bytes. Error code 12\n(a trace)")):
        def fail(*args, **kwargs):
            raise exc

        monkeypatch.setattr(concept, "load", fail)
        line = one_error_line(run("inspect", run_dir))
        assert line.startswith("error: out of memory (inspect)") and "lower --batch" in line
