"""The GPU kit (docs/gpu.md) does not rot: its dry run writes every stage's JSON on this CPU, and the
pack's split, join and checksums hold, a damaged part included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import concept.compiled
from benchmarks import gpu_pack
from benchmarks.gpu_kit import __main__ as kit
from benchmarks.gpu_kit import flex_diagnosis, quality_stage, report_stage, setup_stage, speed_stage
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
        assert p["host_syncs"] == 0 and p["kernel_launches"] == 0  # a CPU: no CUDA synchronisation, no kernel
        assert (dry / p["table"]).stat().st_size > 0
    compiled = result["throughput"]["compiled"]  # the same step compiled (a static concept budget), measured too
    assert set(compiled["models"]) and all(m["tokens_per_s"] > 0 for m in compiled["models"].values())
    regions = concept.compiled.regions()  # (on where this torch runs them: concept.compiled.REGIONS_FROM)
    assert compiled["layer_regions"] is regions  # (recorded)
    assert compiled["region_options"] == ({"allow_buffer_reuse": False} if regions else None)
    # the training forward as CUDA graphs on CUDA only; each compiled row counts the graphs inductor ran without them
    assert compiled["training_cuda_graphs"] is False and all(m["cudagraph_skips"] == 0 for m in compiled["models"].values())
    assert result["throughput"]["failed"] == {}  # (a row that fails: tests/test_gpu_kit_setup.py)


def test_dry_exact_runs_the_cuda_tests_which_skip_here(dry):
    result = stage(dry, "exact")
    assert "tests/test_cuda.py" in result["files"]
    ids = [t["id"] for t in result["tests"]]
    assert any(i.startswith("tests/test_cuda.py::test_backend_matches_the_naive_reference_on_cuda[") for i in ids)
    assert result["counts"]["skipped"] == len(ids) > 0  # no CUDA here: every one skips, none fails
    # collected and dealt into shards as on the device (2026-11-27 the collection found no id: `-q` twice)
    assert [s["tests"] for s in result["shards"]] == [len(ids)] and len(ids) > len(result["files"])
    assert "collected no test ids" not in " ".join(json.loads((dry / "exact.json").read_text())["warnings"])
    xformers = [s for s in stage_skips(dry, "exact") if "xformers tests" in s["what"]]  # no kernel here: deselected
    assert len(xformers) == 1 and "CUDA" in xformers[0]["reason"] and not any("xformers" in i for i in ids)
    assert set(result["tolerances"]["relative_l2"]) == {"fp32", "bf16"}


def test_dry_speed_writes_rows_a_baseline_and_a_recommendation(dry):
    result = stage(dry, "speed")
    suites = {r["suite"] for r in result["rows"]}
    assert suites == {"attention", "forward", "train", "prefill", "policy-scan", "decode-compiled", "adapter-cost"}
    decode = next(r for r in result["rows"] if r["suite"] == "decode-compiled")
    assert all(decode[f"{side}_tokens_per_s"] > 0 for side in ("dense_eager", "dense", "concept_eager", "concept"))
    for row in result["rows"]:
        assert {"case", "dense_s", "concept_s", "speedup", "ideal_speedup", "fraction_of_ideal", "T"} <= set(row)
    assert result["fastest"]["attention"]["1024"]["fastest"] == "chunked"
    assert {"current_choice_on_cuda", "training", "prefill / evaluation"} <= set(result["auto_recommendation"])
    assert result["baseline"]["path"].endswith(f"_{result['machine_id']}.json")
    assert json.loads((dry / "speed-baseline.json").read_text())["benchmarks"]
    # the plan's cases ran first, in its order (the compiled forward and step skip: no --compile in a dry run)
    plan = [node for node, _ in speed_stage.DRY_PLAN]
    assert result["plan"] == plan and [c["id"] for c in result["cases"]][:len(plan)] == plan
    assert all(c["seconds"] >= 0 for c in result["cases"])
    assert any("xformers cases" in s["what"] for s in stage_skips(dry, "speed"))
    # where each side's host syncs came from, for the forward's case (on the GPU: forced flex, decided, cascade at 8k)
    stacks = result["sync_stacks"]["forward tiny-llama T=512 r=0.25 chunked"]
    assert set(stacks) == {"dense", "concept"} and all(isinstance(found, list) for found in stacks.values())
    assert all({"call", "count", "ops", "ours", "torch", "stack"} == set(r) for found in stacks.values() for r in found)
    # then the flex diagnosis, with what the suites left
    assert {r["variant"] for r in result["flex_diagnosis"]["variants"]} == set(flex_diagnosis.VARIANTS)
    log = (dry / "speed.log").read_text()
    assert log.index("benchmarks.gpu_kit.flex_diagnosis") > log.index("-m pytest")


SPEED_PLAN_KINDS = ["test_forward_default_point_vs_dense", "test_forward_compiled_vs_dense_compiled",
                    "test_train_step_default_point_vs_dense", "test_train_step_compiled_vs_dense_compiled",
                    "test_host_scan_vs_device_scan_on_the_gpu", "test_adapter_cost_on_the_gpu",
                    "test_compiled_decode_vs_dense"]


def test_the_speed_plan_names_existing_cases_most_decisive_first():
    """Each planned GPU case is a parametrized case of its suite within the stage's selection (8k tokens, the
    default build; the adapters' cost at the demo recipe's rows), in the decisive order: forward eager, compiled;
    train step eager, compiled; the policy scan; the adapters' cost; compiled decode.
    (The dry run shows pytest runs a plan first, in its order; the slow test below collects this one.)"""
    import importlib

    plan = [node for node, _ in speed_stage.GPU_PLAN]
    for node in plan:
        path, name = node.split("::")
        fn = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name.split("[")[0])
        ids = [i for m in fn.pytestmark if m.name == "parametrize" for i in m.kwargs["ids"]]
        assert name.split("[")[1].rstrip("]") in ids, node
        assert ("T8192" in node or "adapter_cost" in node) and "default" in node
        assert path.split("/")[1] in speed_stage.SUITES
    assert [n.split("::")[1].split("[")[0] for n in plan] == SPEED_PLAN_KINDS
    assert plan[0].endswith("-flex]") and plan[2].endswith("-flex]")
    assert [cap for _, cap in speed_stage.GPU_PLAN][0] == 0 and sum(c for _, c in speed_stage.GPU_PLAN) < 150


def test_under_model_the_compiled_8k_training_step_waits_for_a_longer_stage():
    """``--compile model`` compiles a training step at 8k anew, about 3 minutes for both models: its cap exceeds the
    suites' share of the default stage (so the cases after it run), the compiled forward's cap is raised, and the
    other caps are the plan's. Negative control: under ``on`` the plan is :data:`GPU_PLAN` itself."""
    plan = dict(speed_stage.gpu_plan("model"))
    suites_s = 60 * kit.BUDGET_MIN["speed"] * (1 - speed_stage.DIAGNOSIS_SHARE)
    train, forward = speed_stage.GPU_PLAN[3][0], speed_stage.GPU_PLAN[1][0]
    assert "compiled" in train and "train_step" in train and plan[train] > suites_s
    assert "compiled" in forward and plan[forward] > dict(speed_stage.GPU_PLAN)[forward]
    assert list(plan) == [node for node, _ in speed_stage.GPU_PLAN]
    assert all(plan[n] == cap for n, cap in speed_stage.GPU_PLAN if n not in speed_stage.WHOLE_CAPS)
    assert plan[forward] < suites_s - 15  # (second in the plan, after the eager forward's ~15 s: it starts)
    assert speed_stage.gpu_plan("on") == speed_stage.GPU_PLAN


def test_the_sync_stacks_name_existing_forward_cases_in_the_selection():
    import importlib

    for node in speed_stage.GPU_SYNC_STACKS:
        path, name = node.split("::")
        fn = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name.split("[")[0])
        ids = [i for m in fn.pytestmark if m.name == "parametrize" for i in m.kwargs["ids"]]
        assert name.split("[")[1].rstrip("]") in ids and "T8192" in node and path == "benchmarks/test_forward.py", node


@pytest.mark.slow  # two collections of the six suites: 10-20 s on an idle machine, minutes on a loaded one
def test_the_speed_plan_runs_first_on_the_gpu_in_its_order():
    """Given the plan, pytest runs the GPU plan's cases first in its order (their collection with the stage's
    `-q`, as `exact` collects: it would find no id with `-q` twice); without it, the suites' own order."""
    from benchmarks.conftest import PLAN_ENV
    from benchmarks.gpu_kit.pytest_run import collect

    plan = [node for node, _ in speed_stage.GPU_PLAN]
    args = [*(f"benchmarks/{s}" for s in speed_stage.SUITES), "-q", "-k", speed_stage.GPU_SELECTION, "--device=cuda",
            "--dtype=bf16", "--smollm2", "--long", "--compile=on"]
    ids = collect(args, {**os.environ, PLAN_ENV: json.dumps(speed_stage.GPU_PLAN)})
    assert ids[:len(plan)] == plan, ids[:8]
    assert len(ids) > len(plan) and not any("T2048" in i or "T16384" in i for i in ids)
    assert collect(args, dict(os.environ))[:2] != plan[:2]  # without the plan: the suites' own order


def test_collection_lists_ids_with_the_stages_own_quiet_flag():
    """`exact` passes `-q` in its args; the collection adds its own: one in all (two list `file: count`)."""
    from benchmarks.gpu_kit.pytest_run import collect_command

    command = collect_command(["-m", "cuda", "-q", "-rfEs", "tests/test_cuda.py"])
    assert command.count("-q") == 1 and "-qq" not in command and "--collect-only" in command
    assert command[-3:] == ["-m", "cuda", "-rfEs", "tests/test_cuda.py"][-3:]


def stage_skips(out: Path, name: str) -> list[dict]:
    return json.loads((out / f"{name}.json").read_text())["skipped"]


def test_dry_quality_trains_the_three_models_and_plots_them(dry):
    result = stage(dry, "quality")
    plan = result["plan"]  # the corpus: a prefix of the stand-in's sources, tokenised, one epoch at most
    assert plan["data"].endswith("corpus") and 0 < plan["corpus"]["files"] < plan["corpus"]["corpus_files"]
    assert plan["steps"] * plan["batch"] <= plan["corpus"]["train"]["rows"]
    assert f"--data {plan['data']}" in (dry / "quality.log").read_text()
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
    steps, seconds, reason, option = quality_stage.size(stage, SimpleNamespace(total_minutes=14, tokens=None), per_step,
                                                        main, near)
    assert 1e7 < steps * per_step < 3e7 and seconds[0] <= 14 * 60 and "not also this point" in reason
    assert option["option"] is None and option["mode"] == "eager"  # setup measured no compiled training: eager
    assert {m["ran"] for m in option["models"].values()} == {"eager"} and "no compiled" in option["why"]
    steps, seconds, reason, _ = quality_stage.size(stage, SimpleNamespace(total_minutes=90, tokens=None), per_step,
                                                   main, near)
    assert 1e8 - per_step < steps * per_step <= 1e8 and reason == "" and sum(seconds) <= 90 * 60
    assert not stage.warnings
    steps, _, _, _ = quality_stage.size(stage, SimpleNamespace(total_minutes=4, tokens=None), per_step, main, near)
    assert steps * per_step < 1e7 and "indicative only" in stage.warnings[0]
    stage.finish({})


@pytest.mark.parametrize("compile_s,chosen", [(60, True), (400, False)])
def test_quality_trains_compiled_where_that_fits_more_tokens(tmp_path, compile_s, chosen):
    """Twice the throughput compiled: worth it at a minute's compilation per model, not at almost seven."""
    from types import SimpleNamespace

    eager = {"streaming": 150_000, "pruned": 180_000, "dense": 110_000}
    option = {"compile": True}
    main, near = {"flop_ratio": 0.596, "pruned_flop_ratio": 0.604}, {"flop_ratio": 0.81, "pruned_flop_ratio": 0.8}
    sized = {}
    for name, compiled in (("eager", None), ("both", {"option": option, "models": {
            k: {"tokens_per_s": 2 * v, "compile_s": compile_s} for k, v in eager.items()}})):
        stage = Stage("quality", tmp_path / name, tmp_path / name / "work", dry=False, budget_s=60)
        throughput = {"models": {k: {"tokens_per_s": v} for k, v in eager.items()}, **({"compiled": compiled} if compiled else {})}
        write_json(tmp_path / name / "work" / "setup.json", {"result": {"throughput": throughput}})
        sized[name] = quality_stage.size(stage, SimpleNamespace(total_minutes=14, tokens=None), 16_384, main, near)
        stage.finish({})
    steps, seconds, _, used = sized["both"]
    assert sized["eager"][3]["option"] is None and (used["option"] == option) is chosen and seconds[0] <= 14 * 60
    assert {m["ran"] for m in used["models"].values()} == {"compiled" if chosen else "eager"}
    assert (steps > 1.3 * sized["eager"][0]) is chosen  # 705 s left: 525 s at twice the speed


def lease_b_throughput() -> dict:
    """`setup`'s throughput on the H200, 2026-11-27b: eager streaming 80,478, pruned 121,608, dense 70,991 tokens/s;
    compiled streaming only, 174,533 (compiled in 38 s); compiled dense and pruned skipped."""
    data = json.loads((ROOT / "benchmarks/gpu_results/nvidia-h200/lease-2026-11-27b/call2/setup.json").read_text())
    return data["result"]["throughput"]


@pytest.mark.parametrize("minutes,mode", [(4.5, "eager"), (30, "compiled")])
def test_quality_trains_all_three_compiled_when_setup_found_compiled_faster_and_it_fits_more(minutes, mode):
    """From the H200 lease's setup: compiled streaming 2.17x eager. Every model would train compiled alike, sized by
    its compiled throughput where setup measured one (streaming) and by its eager one where not (pruned, dense:
    conservative), each paying a compilation (38 s, the one measured). In the 4.5 minutes that lease gave quality
    the three compilations cost more tokens than the faster streaming steps gain: eager; in 30 minutes, compiled."""
    available = minutes * 60 - 3 * quality_stage.OVERHEAD_S - quality_stage.PLAN_S
    training = quality_stage.choose_training(lease_b_throughput(), available, quality_stage.AIM_TOKENS)
    assert training["mode"] == mode and {m["ran"] for m in training["models"].values()} == {mode}
    assert (training["option"] == {"compile": "on"}) is (mode == "compiled")
    fit = training["tokens_fit"]
    assert (fit["compiled"] > fit["eager"]) is (mode == "compiled") and "streaming" in training["why"]
    if mode == "compiled":
        models = training["models"]
        assert models["streaming"]["tokens_per_s"] == pytest.approx(174_533, abs=1)
        assert models["streaming"]["sized_by"] == "its compiled rate" and "eager only" in models["dense"]["sized_by"]
        assert models["pruned"]["tokens_per_s"] == pytest.approx(121_608, abs=1)  # its eager rate, not a guess
        assert [round(m["compile_s"]) for m in models.values()] == [38, 38, 38]


@pytest.mark.parametrize("change,why", [
    ("slower", "not faster than eager"), ("failed", "failed in `setup` (dense compiled)"), ("none", "no compiled")])
def test_quality_keeps_eager_without_a_faster_compiled_row(change, why):
    """Compiled only where setup measured it faster: a compiled row slower than eager, a failed compiled row, or no
    compiled row at all keep the three models eager, however many minutes (negative control: the same minutes
    with the lease's faster row train compiled, the test above)."""
    measured = lease_b_throughput()
    if change == "slower":
        measured["compiled"]["models"]["streaming"]["tokens_per_s"] = 70_000.0
    elif change == "failed":
        measured["failed"] = {"dense compiled": "RuntimeError: CUDAGraphs"}
    else:
        del measured["compiled"]
    training = quality_stage.choose_training(measured, 30 * 60, quality_stage.AIM_TOKENS)
    assert training["mode"] == "eager" and training["option"] is None and why in training["why"]
    assert training["models"]["streaming"]["tokens_per_s"] == pytest.approx(80_478, abs=1)


def with_kernel_rows(measured: dict, streaming: float, dense: float, compile_s: float = 50.0) -> dict:
    """``measured`` with `setup`'s compiled pair measured both ways: the matmuls at 300k / 200k tokens/s (compiled in
    40 s), the adapters' Triton kernels at ``streaming`` / ``dense`` tokens/s."""
    from benchmarks.gpu_kit.setup_stage import ADAPTER_KERNEL

    compiled = measured["compiled"]
    compiled["models"] = {"streaming": {"tokens_per_s": 300_000.0, "compile_s": 40.0},
                          "dense": {"tokens_per_s": 200_000.0, "compile_s": 40.0}}
    compiled["lora_kernel"] = {"option": {"lora_kernel": ADAPTER_KERNEL}, "models": {
        "streaming": {"tokens_per_s": streaming, "compile_s": compile_s},
        "dense": {"tokens_per_s": dense, "compile_s": compile_s}}}
    return measured


@pytest.mark.parametrize("streaming,dense,failed,kernel", [
    (360_000.0, 230_000.0, None, "triton"), (360_000.0, 190_000.0, None, "matmuls"),
    (360_000.0, 230_000.0, "dense compiled triton", "matmuls")])
def test_quality_trains_with_the_adapters_triton_kernels_where_setup_measured_them_faster(streaming, dense, failed,
                                                                                         kernel):
    """Compiled, the three models train with ``--lora-kernel triton`` where `setup`'s compiled pair with the kernels
    beat the pair with the matmuls, model for model, each sized by its rate with them (pruned, measured with the
    matmuls only, by its eager rate); a pair where one model is slower with them (negative control), or a failed row
    with them, trains with the matmuls, sized by the matmuls' rates. A failed kernel row does not stop compiled
    training."""
    measured = with_kernel_rows(lease_b_throughput(), streaming, dense)
    if failed:
        measured["failed"] = {failed: "RuntimeError: a Triton kernel"}
    training = quality_stage.choose_training(measured, 30 * 60, quality_stage.AIM_TOKENS)
    assert training["mode"] == "compiled" and training["lora_kernel"] == kernel
    models = training["models"]
    if kernel == "triton":
        assert training["option"] == {"compile": "on", "lora.kernel": "triton"}
        assert models["streaming"]["tokens_per_s"] == streaming and models["dense"]["tokens_per_s"] == dense
        assert "Triton kernels" in models["dense"]["sized_by"] and models["streaming"]["compile_s"] == 50.0
        assert "were faster than the matmuls in `setup` (dense 1.15x, streaming 1.20x)" in training["why"]
    else:
        assert training["option"] == {"compile": "on"} and models["dense"]["tokens_per_s"] == 200_000.0
        assert ("failed" if failed else "not faster") in training["why"]
    assert models["pruned"]["tokens_per_s"] == pytest.approx(121_608, abs=1)  # (its eager rate)
    from benchmarks.gpu_kit.report_stage import training_lines
    assert ("`--lora-kernel triton`" in training_lines(training)[0]) is (kernel == "triton")


def test_quality_passes_the_adapters_kernel_to_every_run(tmp_path):
    """The plan's option reaches ``concept frontier`` as ``--train-set lora.kernel=triton`` (the frontier applies
    its ``--train-set`` items to every run's training config: streaming, pruned and dense), and that item sets
    ``TrainConfig.lora.kernel``."""
    from benchmarks.gpu_kit import recipe

    stage = Stage("quality", tmp_path, tmp_path / "work", dry=True, budget_s=600)
    plan = {"steps": 2, "seq_len": recipe.seq_len(True), "batch": 2, "warmup": 1, "device": "cuda",
            "data": "unused", "compile": {"compile": "model", "lora.kernel": "triton"}}
    args = quality_stage.frontier_args(stage, plan, recipe.DRY_SPLIT, "0.25", "pruned,dense")
    assert args[-4:] == ["--train-set", "compile=model", "--train-set", "lora.kernel=triton"]
    from concept.recipes.frontier.scheduling import train_overrides
    from concept.train_config import TrainConfig
    assert train_overrides(TrainConfig(), ["lora.kernel=triton"]).lora.kernel == "triton"
    stage.finish({})


@pytest.mark.parametrize("choice,mode", [("auto", "eager"), ("on", "compiled"), ("off", "eager")])
def test_quality_compile_choice_forces_or_forbids_compiled(choice, mode):
    """``--compile on`` trains compiled wherever setup measured it faster, even where eager fits more tokens (the
    lease's 4.5 minutes: auto stays eager); ``off`` never compiles, even in 30 minutes where auto would."""
    minutes = 30 if choice == "off" else 4.5
    available = minutes * 60 - 3 * quality_stage.OVERHEAD_S - quality_stage.PLAN_S
    training = quality_stage.choose_training(lease_b_throughput(), available, quality_stage.AIM_TOKENS, choice)
    assert training["mode"] == mode and training["choice"] == choice
    if choice == "off":
        assert "compiled" not in training["tokens_fit"] and training["why"] == "--compile off"


@pytest.mark.slow  # three tiny trainings, the streaming one compiled on a CPU: about a minute
def test_quality_compiled_trains_all_three_models_compiled_through_the_frontier(tmp_path):
    """The command quality runs when it trains compiled (``frontier_args`` with the plan's compile option): the
    streaming model with its static concept budget, the pruned and dense baselines, each with ``compile: on``."""
    from benchmarks.gpu_kit import recipe
    from benchmarks.gpu_kit.common import kit_env

    stage = Stage("quality", tmp_path, tmp_path / "work", dry=True, budget_s=600)
    plan = {"steps": 2, "seq_len": recipe.seq_len(True), "batch": 2, "warmup": 1, "device": "cpu",
            "data": str(ROOT / "concept" / "recipes"), "compile": {"compile": "on"}}
    args = quality_stage.frontier_args(stage, plan, recipe.DRY_SPLIT, "0.25", "pruned,dense")
    assert args[-2:] == ["--train-set", "compile=on"] and "max_ratio=auto" in args
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=kit_env(stage.work, True), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = tmp_path / "work" / "quality" / "runs"
    trained = {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/train.json")}
    assert len(trained) == 3 and all(json.dumps(t).count('"compile": "on"') == 1 for t in trained.values())
    stage.finish({})


def test_the_15_minute_lease_leaves_quality_minutes_after_the_worst_case():
    """Every earlier stage at its whole budget, the machine's start and a margin: quality still gets a minute (since
    `setup` took 5.5 minutes for the training target's compiled rows; about 3 in the expected case, where `exact`
    and `setup` end before their budgets)."""
    assert kit.quality_minutes(15) >= 1.0
    assert kit.CALL1_SETUP_MIN + kit.BUDGET_MIN["exact"] <= 10 - 0.5  # each call within the device's 10 minutes
    assert kit.BUDGET_MIN["setup"] + kit.BUDGET_MIN["speed"] <= 10 - 0.5


# -- the quality stage's corpus ---------------------------------------------------------------------
def tree(root: Path, files: int) -> Path:
    for i in range(files):
        path = root / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f{i}():\n    return {i}\n" * (20 + i))
    for skipped in ("pkg0/tests/test_x.py", "pkg1/__pycache__/m.py", ".hidden/h.py", "pkg2/data.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("x = 1\n")
    return root


def test_the_corpus_leaves_out_files_a_training_run_could_not_read(tmp_path):
    from benchmarks.gpu_kit import corpus

    root = tree(tmp_path / "site-packages", 6)
    (root / "pkg0" / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    (root / "pkg1" / "nul.py").write_bytes(b"x = 1\0\n")
    files = corpus.python_files(root)
    assert {"pkg0/latin1.py", "pkg1/nul.py"} <= set(files)
    chosen = corpus.select(files, 1e9, lambda n: corpus.utf8_text(root / n))
    assert len(chosen) == 6 and "pkg0/latin1.py" not in chosen and "pkg1/nul.py" not in chosen


def test_the_corpus_is_a_prefix_of_a_fixed_order_linked_under_the_same_names(tmp_path):
    from benchmarks.gpu_kit import corpus
    from concept import data

    root = tree(tmp_path / "site-packages", 40)
    files = corpus.python_files(root)
    assert len(files) == 40 and not any("tests/" in n or "__pycache__" in n or n.startswith(".") for n in files)
    order = corpus.order(files)
    assert order == corpus.order(reversed(list(files))) != sorted(files)  # fixed, whatever the listing order
    stage = Stage("quality", tmp_path / "out", tmp_path / "work", dry=False, budget_s=60)
    folder = tmp_path / "work" / "corpus"
    small = corpus.prepare(stage, folder, 300, root=root)
    chosen = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.py"))
    assert chosen == sorted(order[:small["files"]]) and 0 < small["files"] < 40
    assert all((folder / n).resolve() == (root / n).resolve() for n in chosen)
    assert small["bytes"] >= 300 / 0.95 * corpus.CHARS_PER_TOKEN and small["bytes"] - files[order[small["files"] - 1]] < \
        300 / 0.95 * corpus.CHARS_PER_TOKEN * corpus.MARGIN  # the shortest prefix that covers it
    assert corpus.prepare(stage, folder, 200, root=root) == small  # kept: it covers fewer tokens too
    whole = corpus.prepare(stage, folder, 1e9, root=root)
    assert whole["whole"] and whole["files"] == 40 and not (folder / "corpus.json").exists()
    # the held-out rule of `concept train` on the folder is the rule on the same names in site-packages
    held = {d.name for d in data.read_documents(str(folder), "heldout", heldout_fraction=0.3)}
    assert held and held == {n for n in files if data._is_heldout(n, 0.3)}
    stage.finish({})


def test_the_corpus_caps_the_plan_at_one_epoch(tmp_path, monkeypatch):
    """Never a training token twice: more steps than the corpus's training rows hold are cut, with a warning."""
    from types import SimpleNamespace

    from benchmarks.gpu_kit import corpus

    root = tree(tmp_path / "site-packages", 12)
    monkeypatch.setattr(corpus, "source_root", lambda dry: root)
    monkeypatch.setattr(quality_stage.recipe, "build_config", lambda dry: None)
    model = SimpleNamespace(tokenizer=None, backbone=SimpleNamespace(config=SimpleNamespace(vocab_size=256)))
    monkeypatch.setattr("concept.build", lambda config: model)
    stage = Stage("quality", tmp_path / "out", tmp_path / "work", dry=False, budget_s=60)
    plan = {"tokens_per_step": 64, "batch": 2, "seq_len": 32}
    epoch = quality_stage.prepare_corpus(stage, plan, 10)
    assert epoch >= 10 and not stage.warnings and plan["data"].endswith("corpus")
    rows = plan["corpus"]["train"]["rows"]
    assert epoch == rows // 2 and plan["corpus"]["train"]["tokens"] >= rows * 32
    few = quality_stage.prepare_corpus(stage, plan, 10_000)  # more than the whole corpus holds
    assert few < 10_000 and "no training token twice" in stage.warnings[0]
    stage.finish({})


# -- exact's shards, running together ---------------------------------------------------------------
def test_exact_deals_the_collected_tests_with_the_resume_first():
    from benchmarks.gpu_kit.exact_stage import FIRST, SHARDS
    from benchmarks.gpu_kit.pytest_run import collected_ids, deal

    out = ("tests/test_cuda.py::test_backend[auto-fp32]\ntests/test_cuda.py::test_backend[flex-fp32]\n"
           "tests/test_cuda.py::test_decoding[flex]\ntests/test_cuda.py::test_bf16_training_resumes_exactly_on_cuda[chunked]\n"
           "tests/test_cuda.py::test_bf16_training_resumes_exactly_on_cuda[auto]\n\n5 tests collected in 2.1s\n")
    ids = collected_ids(out)
    assert len(ids) == 5
    shards = deal(ids, SHARDS, FIRST)
    assert len(shards) == 3 and sorted(sum(shards, [])) == sorted(ids)
    assert [s[0].split("[")[-1] for s in shards[:2]] == ["chunked]", "auto]"]  # each of them first in a shard
    compiled = ["tests/test_cuda.py::test_compiled_training_steps_equal_eager_on_cuda[model]",
                "tests/test_cuda.py::test_compiled_training_steps_equal_eager_on_cuda[model-accumulated]"]
    shards = deal([*ids, *compiled], SHARDS, FIRST)  # then the compiled training steps (CUDA graphs), ahead of the rest
    assert [s[1] for s in shards[:2]] == [compiled[1], ids[0]] and shards[2][0] == compiled[0]
    assert deal(ids[:1], 3) == [ids[:1]] and deal([], 3) == [[]]


def test_commands_run_together_and_each_stops_at_the_deadline(tmp_path):
    import time

    from benchmarks.gpu_kit.common import run_logged_together

    stage = Stage("exact", tmp_path, tmp_path / "work", dry=True, budget_s=60)
    quick = [sys.executable, "-c", "print('quick done')"]
    slow = [sys.executable, "-c", "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('stopped')"]
    start = time.monotonic()
    runs = run_logged_together(stage, [quick, slow, quick], deadline=time.monotonic() + 3)
    assert time.monotonic() - start < 30
    assert [r["interrupted"] for r in runs] == [False, True, False] and runs[0]["returncode"] == 0
    log = stage.log_path.read_text()
    assert "[1] quick done" in log and "[2] stopped" in log and "[3] quick done" in log
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
