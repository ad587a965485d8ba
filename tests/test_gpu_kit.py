"""The GPU kit (docs/gpu.md) does not rot: its dry run writes every stage's JSON on this CPU, and the
pack's split, join and checksums hold, a damaged part included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_pack
from benchmarks.gpu_kit import __main__ as kit
from benchmarks.gpu_kit import quality_stage, report_stage, setup_stage
from benchmarks.gpu_kit.common import KitError, Stage, write_json
from benchmarks.gpu_kit.parts import MANIFEST, PackError, describe, even_sizes, reassemble, split_file

ROOT = Path(__file__).resolve().parents[1]
ENVELOPE = {"stage", "kit_version", "status", "dry", "started_at", "seconds", "budget_s", "command", "machine",
            "skipped", "problems", "warnings", "result"}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """``python -m benchmarks.gpu_kit --dry`` once: every stage on the CPU with the tiny backbone."""
    out = tmp_path_factory.mktemp("dry")
    docs = {p: (ROOT / p).read_bytes() for p in ("docs/benchmarks.md", "docs/results.md")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "--dry", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p: (ROOT / p).read_bytes() for p in docs} == docs, "a dry run must never write the real docs"
    return out


def stage(out: Path, name: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert set(data) == ENVELOPE and data["stage"] == name and data["dry"] is True
    assert data["status"] in ("ok", "partial"), data["problems"]
    assert (out / f"{name}.log").stat().st_size > 0
    return data["result"]


def test_dry_setup_reports_the_machine_and_throughput(dry):
    result = stage(dry, "setup")
    env = result["environment"]
    assert env["cuda_available"] is False and env["flex"]["available"] is True
    assert all({"required", "found", "ok"} <= set(d) for d in env["dependencies"].values())
    models = result["throughput"]["models"]
    assert set(models) == {"streaming", "pruned", "dense"} and all(m["tokens_per_s"] > 0 for m in models.values())
    for m in models.values():  # one profiled step each: where the time goes, for the next lease to read
        p = m["profile"]
        assert p["wall_s"] > 0 and p["device_s"] > 0 and p["ops"] > 100 and p["top_device"] and p["top_cpu"]
        assert p["top_device"][0]["device_ms"] >= p["top_device"][-1]["device_ms"]


def test_dry_exact_runs_the_cuda_tests_which_skip_here(dry):
    result = stage(dry, "exact")
    assert "tests/test_cuda.py" in result["files"]
    ids = [t["id"] for t in result["tests"]]
    assert any(i.startswith("tests/test_cuda.py::test_backend_matches_the_naive_reference_on_cuda[") for i in ids)
    assert result["counts"]["skipped"] == len(ids) > 0  # no CUDA here: every one skips, none fails
    assert set(result["tolerances"]["relative_l2"]) == {"fp32", "bf16"}


def test_dry_speed_writes_rows_a_baseline_and_a_recommendation(dry):
    result = stage(dry, "speed")
    suites = {r["suite"] for r in result["rows"]}
    assert suites == {"attention", "forward", "train", "prefill", "policy-scan"}
    for row in result["rows"]:
        assert {"case", "dense_s", "concept_s", "speedup", "ideal_speedup", "fraction_of_ideal", "T"} <= set(row)
    assert result["fastest"]["attention"]["1024"]["fastest"] == "chunked"
    assert {"current_choice_on_cuda", "training", "prefill / evaluation"} <= set(result["auto_recommendation"])
    assert result["baseline"]["path"].endswith(f"_{result['machine_id']}.json")
    assert json.loads((dry / "speed-baseline.json").read_text())["benchmarks"]


def test_dry_quality_trains_the_three_models_and_plots_them(dry):
    result = stage(dry, "quality")
    assert [p["name"] for p in result["points"]][0] == "default" and result["points"][0]["state"] == "complete"
    kinds = sorted(r["kind"] for r in result["frontier"]["rows"])
    assert kinds == ["dense", "pruned", "streaming"]
    assert result["table"].startswith("| run | kind |")
    assert (dry / result["curves"]).stat().st_size > 0


def test_dry_report_fills_every_block_of_copies_of_the_docs(dry):
    result = stage(dry, "report")
    for doc, names in (("docs/benchmarks.md", ("setup", "exact", "speed")), ("docs/results.md", ("quality",))):
        text = (dry / doc).read_text()
        for name in names:
            block = text.split(f"<!-- gpu-kit:{name}:begin -->")[1].split(f"<!-- gpu-kit:{name}:end -->")[0]
            assert block.strip().startswith("Measured "), (doc, name)
    assert "docs/img/gpu-quality-curves.png" in result["written"] and result["commit"].startswith("git add ")


def test_report_never_writes_dry_results_into_the_docs(dry, tmp_path):
    before = (ROOT / "docs/benchmarks.md").read_bytes()
    assert kit.main(["report", "--from", str(dry), "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert "dry run" in report["problems"][0]
    assert (ROOT / "docs/benchmarks.md").read_bytes() == before


def test_quality_sizes_its_runs_from_the_measured_throughput(tmp_path):
    """Tokens per model from the minutes given and setup's throughput: capped at the aim, and the point
    near 0.8x FLOPs only when it fits too."""
    from types import SimpleNamespace

    stage = Stage("quality", tmp_path, tmp_path / "work", dry=False, budget_s=60)
    tokens_per_s = {"streaming": 150_000, "pruned": 180_000, "dense": 110_000}
    write_json(tmp_path / "work" / "setup.json",
               {"result": {"throughput": {"models": {k: {"tokens_per_s": v} for k, v in tokens_per_s.items()}}}})
    main, near = {"flop_ratio": 0.596, "pruned_flop_ratio": 0.604}, {"flop_ratio": 0.81, "pruned_flop_ratio": 0.8}
    per_step = 16_384
    steps, seconds, reason = quality_stage.size(stage, SimpleNamespace(total_minutes=14, tokens=None), per_step, main, near)
    assert 1e7 < steps * per_step < 3e7 and seconds[0] <= 14 * 60 and "not also this point" in reason
    steps, seconds, reason = quality_stage.size(stage, SimpleNamespace(total_minutes=60, tokens=None), per_step, main, near)
    assert 3e7 - per_step < steps * per_step <= 3e7 and reason == "" and sum(seconds) <= 60 * 60
    assert not stage.warnings
    steps, _, _ = quality_stage.size(stage, SimpleNamespace(total_minutes=4, tokens=None), per_step, main, near)
    assert steps * per_step < 1e7 and "indicative only" in stage.warnings[0]
    stage.finish({})


def test_report_replaces_exactly_one_marked_block():
    text = "a\n<!-- gpu-kit:speed:begin -->\nold\n<!-- gpu-kit:speed:end -->\nb\n"
    assert report_stage.replace_block(text, "speed", "new", "doc") == text.replace("old", "new")
    for broken in (text.replace("<!-- gpu-kit:speed:end -->", ""), text + text):
        with pytest.raises(KitError, match="needs exactly one line <!-- gpu-kit:speed:begin -->"):
            report_stage.replace_block(broken, "speed", "new", "doc")


def test_report_never_overwrites_an_earlier_baseline(tmp_path):
    earlier = tmp_path / "benchmarks/baselines/gpu/Linux-CPython-3.12-64bit/0001_gpu.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("an earlier lease")
    relative = "benchmarks/baselines/gpu/Linux-CPython-3.12-64bit/0001_gpu.json"
    assert report_stage.free_baseline_path(tmp_path, relative, b"this lease").endswith("/0002_gpu.json")
    assert report_stage.free_baseline_path(tmp_path, relative, b"an earlier lease") == relative  # the same run again


# -- the pack -----------------------------------------------------------------------------------------
def test_split_then_reassemble_gives_the_file_back(tmp_path):
    source = tmp_path / "big.whl"
    source.write_bytes(os.urandom(100_003))
    parts = split_file(source, [tmp_path / f"call{i}" for i in (1, 2, 3)])
    assert [p["size"] for p in parts] == even_sizes(100_003, 3) == [33_335, 33_334, 33_334]
    whole = {**describe(source), "parts": parts}
    joined = reassemble([Path(p["folder"]) / p["name"] for p in parts], whole, tmp_path / "out" / "big.whl")
    assert joined.read_bytes() == source.read_bytes()


def test_a_corrupted_or_missing_part_is_refused_by_name(tmp_path):
    source = tmp_path / "big.whl"
    source.write_bytes(os.urandom(50_000))
    parts = split_file(source, [tmp_path / "call1", tmp_path / "call2"])
    paths = [Path(p["folder"]) / p["name"] for p in parts]
    whole = {**describe(source), "parts": parts}
    data = bytearray(paths[1].read_bytes())
    data[1234] ^= 0xFF  # one flipped byte, same size
    paths[1].write_bytes(bytes(data))
    dest = tmp_path / "joined.whl"
    with pytest.raises(PackError, match="part2of2 is corrupted"):
        reassemble(paths, whole, dest)
    paths[1].write_bytes(bytes(data[:-10]))
    with pytest.raises(PackError, match="has 24990 bytes, the manifest says 25000"):
        reassemble(paths, whole, dest)
    paths[1].unlink()
    with pytest.raises(PackError, match="is missing"):
        reassemble(paths, whole, dest)
    assert not dest.exists()


def test_joined_parts_that_differ_from_the_whole_are_refused(tmp_path):
    """Parts that are each intact but belong to another file (a stale manifest) fail the whole's sha256."""
    source = tmp_path / "big.whl"
    source.write_bytes(os.urandom(20_000))
    parts = split_file(source, [tmp_path / "a", tmp_path / "b"])
    whole = {**describe(source), "sha256": "0" * 64, "parts": parts}
    with pytest.raises(PackError, match="do not match the manifest"):
        reassemble([Path(p["folder"]) / p["name"] for p in parts], whole, tmp_path / "joined.whl")
    assert not (tmp_path / "joined.whl").exists()


def test_calls_are_as_few_as_fit_under_the_limit():
    mib = 2**20
    assert gpu_pack.plan_calls(tree=2 * mib, wheels=mib // 2, large=93 * mib, margin_mib=8) == 2
    assert gpu_pack.plan_calls(tree=20 * mib, wheels=mib // 2, large=93 * mib, margin_mib=8) == 3
    with pytest.raises(KitError, match="does not fit 3 calls"):
        gpu_pack.plan_calls(tree=40 * mib, wheels=mib // 2, large=93 * mib, margin_mib=8)


def test_setup_refuses_call_folders_of_two_packs(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_stage, "KIT", tmp_path)
    for i, pack_id in ((1, "aaaa"), (2, "bbbb")):
        (tmp_path / f"call{i}").mkdir()
        (tmp_path / f"call{i}" / MANIFEST).write_text(json.dumps({"pack_id": pack_id}))
    with pytest.raises(KitError, match="different `make gpu-pack` runs"):
        setup_stage.load_pack()


def test_bad_arguments_are_named(capsys):
    assert kit.main(["sideways"]) == 2
    assert kit.main([]) == 2
    assert kit.main(["speed", "quality", "--minutes", "6"]) == 2  # 12 minutes: more than one device call
    err = capsys.readouterr().err
    assert "unknown stage 'sideways'" in err and "name a stage" in err and "more than one device call" in err


def test_junit_of_an_interrupted_session_counts_only_real_tests(tmp_path):
    """The deadline's Ctrl-C makes pytest write a nameless case for the interruption (seen on the
    H100, 2026-11-26): it is not a passed test; real cases keep their outcome and message."""
    from benchmarks.gpu_kit.pytest_run import counts, read_junit
    junit = tmp_path / "exact.xml"
    junit.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a[chunked]" time="8.4"/>'
        '<testcase classname="tests.test_cuda" name="test_b" time="0.1"><failure message="off by 0.2">x</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_c" time="0.0"><skipped message="no xformers"/></testcase>'
        '<testcase classname="" name="" time="0.001"/>'
        '</testsuite></testsuites>')
    tests = read_junit(junit)
    assert [t["id"] for t in tests] == ["tests/test_cuda.py::test_a[chunked]", "tests/test_cuda.py::test_b",
                                        "tests/test_cuda.py::test_c"]
    assert counts(tests) == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert tests[1]["message"] == "off by 0.2"
