"""`report` merges each stage's runs part by part: the GPU lease of 2026-11-27 ran `setup` three times (call 1
complete for the machine, call 2 failed at once, call 3 measured SmolLM2 and the throughput but crashed), and
taking only the latest run replaced call 1's machine table with dashes. Fixtures: small pieces of that lease's
JSON (benchmarks/gpu_results/nvidia-h100-80gb-hbm3/lease-2026-11-27/), in the current kit's shapes."""
from __future__ import annotations

import pytest

from benchmarks.gpu_kit import report_stage
from benchmarks.gpu_kit.common import write_json

MACHINE = {"host_python": "3.12.3", "cpus": 16, "torch": "2.11.0+cu130", "transformers": "5.17.0", "cuda": "13.0",
           "cuda_available": True, "gpu": "NVIDIA H100 80GB HBM3"}
ENVIRONMENT = {"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_available": True,
               "nvidia_smi": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB", "transformers": "5.17.0", "peft": "0.21.0",
               "gguf": None, "triton": "3.6.0", "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0",
               "gpu_memory_gib": 79.2, "flex": {"available": True, "compiled": True, "forward_backward_s": 23.8,
                                                "relative_error_vs_sdpa": 0.0019993367604911327},
               "xformers": {"installed": False, "reason": "not installed"}, "dependencies": {}}
CRASH = ("RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
         "Stack trace: File \"/work/main/concept/backbone.py\", line 103, in run_layers_shallow")
THROUGHPUT = {"recipe": {"seq_len": 128, "batch": 128, "tokens_per_step": 16384, "precision": "bf16"},
              "device": "cuda", "steps": {"warm-up": 3, "timed": 20},
              "models": {"streaming": {"tokens_per_s": 60197.0, "step_s": 0.272, "warmup_s": 6.4},
                         "pruned": {"tokens_per_s": 102687.0, "step_s": 0.160, "warmup_s": 0.5},
                         "dense": {"tokens_per_s": 60135.0, "step_s": 0.272, "warmup_s": 1.0}},
              "compiled": {"option": {"compile": "on"}, "max_ratio": 0.3, "models": {}},
              "failed": {"streaming compiled": CRASH}}
ROW = {"case": "forward default T=8192 r=0.125 flex", "dense_s": 0.0255, "concept_s": 0.0320, "speedup": 0.798,
       "ideal_speedup": 2.603, "fraction_of_ideal": 0.306, "T": 8192, "suite": "forward"}


def envelope(stage: str, status: str, started_at: str, command: str, result: dict, problems=(), skipped=()) -> dict:
    return {"stage": stage, "kit_version": 1, "status": status, "dry": False, "started_at": started_at,
            "seconds": 25.3, "budget_s": 210.0, "command": command, "machine": MACHINE, "skipped": list(skipped),
            "problems": list(problems), "warnings": [], "result": result}


@pytest.fixture
def results(tmp_path):
    """.gpukit/results/ after the lease's calls 1-5 (setup x3, speed x2)."""
    calls = {
        "call1/setup.json": envelope("setup", "partial", "2026-11-27T02:04:13Z", "python -m benchmarks.gpu_kit setup exact",
                                     {"pack": {"pack_id": "a925f056b27e1daa"}, "smollm2": {"state": "waiting"},
                                      "environment": ENVIRONMENT},
                                     skipped=[{"what": "throughput", "reason": "SmolLM2 is not complete on this machine yet"}]),
        "call2/setup.json": envelope("setup", "failed", "2026-11-27T02:08:02Z", "python -m benchmarks.gpu_kit setup speed",
                                     {}, problems=["BackboneError: converting the default backbone needs the gguf package"]),
        "call3/setup.json": envelope("setup", "failed", "2026-11-27T02:08:27Z", "python -m benchmarks.gpu_kit setup speed",
                                     {"pack": {"pack_id": "a925f056b27e1daa"}, "smollm2": {"state": "ready"},
                                      "throughput": THROUGHPUT},
                                     problems=[f"throughput of streaming compiled failed: {CRASH}"]),
        "call4/speed.json": envelope("speed", "failed", "2026-11-27T02:11:15Z", "python -m benchmarks.gpu_kit speed", {},
                                     problems=["SmolLM2 is not set up on this machine"]),
        "call5/speed.json": envelope("speed", "partial", "2026-11-27T02:12:02Z", "python -m benchmarks.gpu_kit speed",
                                     {"rows": [ROW], "command": "python -m pytest benchmarks/test_forward.py"}),
    }
    for name, data in calls.items():
        write_json(tmp_path / name, data)
    return tmp_path


def test_each_part_comes_from_the_latest_run_that_has_it(results):
    found = report_stage.load([results])
    setup = found["setup"]
    assert {p: s["call"] for p, s in setup["parts_from"].items()} == {
        "environment": "call1", "pack": "call3", "smollm2": "call3", "throughput": "call3"}
    text = report_stage.render_setup(setup)
    assert text.startswith("Measured 2026-11-27") and "status **failed**" in text  # the latest run's envelope
    assert "NVIDIA H100 80GB HBM3, capability 9.0, 79.2 GiB" in text  # call 1's machine table, kept
    assert "compiled, forward and backward in 24 s" in text
    assert "| streaming | 60,197 |" in text and "streaming compiled: RuntimeError: Error: accessing tensor" in text
    assert "`environment` from call1 (2026-11-27 02:04, partial)" in text
    assert "`pack`, `smollm2`, `throughput` from call3 (2026-11-27 02:08, failed)" in text
    assert "- problem: call2, 2026-11-27 02:08: BackboneError: converting" in text  # every run's problems, by call
    assert "- skipped: throughput: SmolLM2 is not complete on this machine yet (call1)" in text
    speed = report_stage.render_speed(found["speed"])  # the failed call 4 before it: call 5's rows
    assert "| forward default T=8192 r=0.125 flex | 25.50 | 32.00 | 0.80x |" in speed and "status **partial**" in speed


def test_negative_control_the_latest_run_alone_loses_the_machine_table(results, monkeypatch):
    merge = report_stage.merge
    monkeypatch.setattr(report_stage, "merge", lambda runs: merge(runs[-1:]))  # the report before 2026-11-27
    text = report_stage.render_setup(report_stage.load([results])["setup"])
    assert "capability 9.0" not in text and "| GPU | –, capability –" in text


def test_a_run_cut_off_counts_with_what_it_wrote_and_a_copy_counts_once(results):
    cut = envelope("setup", "running", "2026-11-27T02:20:00Z", "python -m benchmarks.gpu_kit setup speed",
                   {"smollm2": {"state": "ready"}, "environment": {**ENVIRONMENT, "gpu": "NVIDIA H200"}})
    write_json(results / "call7" / "setup.json", cut)
    write_json(results / "call7" / "work" / "setup.json", cut)  # the same run, twice
    setup = report_stage.load([results])["setup"]
    assert len(setup["runs"]) == 4 and setup["parts_from"]["environment"]["call"] == "call7"
    assert setup["parts_from"]["throughput"]["call"] == "call3"
    assert "NVIDIA H200" in report_stage.render_setup(setup)


def test_failed_runs_alone_render_their_heading_and_problems(results):
    speed = report_stage.load([results / "call4"])["speed"]
    text = report_stage.render_speed(speed)
    assert text.startswith("Measured 2026-11-27") and "- problem: SmolLM2 is not set up" in text


LEASE_B = "benchmarks/gpu_results/nvidia-h200/lease-2026-11-27b"  # the H200 lease's raw files (call 2: setup, speed)


def lease_b(stage: str) -> dict:
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / LEASE_B / "call2" / f"{stage}.json").read_text())
    return {**data, "runs": [], "parts_from": {}}


def test_the_training_target_reads_the_best_rows_and_the_same_settings_ratios():
    """The H200 lease: streaming at its best is the compiled row (174,533), dense's best its eager row; under the
    same settings only eager against eager was measured (compiled dense was skipped)."""
    text = report_stage.render_setup(lease_b("setup"))
    line = next(x for x in text.splitlines() if x.startswith("Training target"))
    assert "streaming 174,533 tokens/s at its best" in line and "2.46x the dense model's best" in line
    assert "under the same settings: 1.13x eager (dense compiled not measured)." in line
    both = {"streaming": {"tokens_per_s": 200.0}, "dense": {"tokens_per_s": 100.0}}
    line = report_stage.training_target({"streaming": {"tokens_per_s": 90.0}, "dense": {"tokens_per_s": 100.0}}, both)
    assert "2.00x the dense model's best" in line and "0.90x eager, 2.00x compiled." in line
    kernels = {"streaming": {"tokens_per_s": 300.0}, "dense": {"tokens_per_s": 120.0}}  # (--lora-kernel triton)
    line = report_stage.training_target({"streaming": {"tokens_per_s": 90.0}, "dense": {"tokens_per_s": 100.0}}, both,
                                        kernels)
    assert "streaming 300 tokens/s at its best" in line and "2.50x the dense model's best" in line
    assert "0.90x eager, 2.00x compiled, 2.50x compiled, --lora-kernel triton." in line
    data = lease_b("setup")
    tp = data["result"]["throughput"]
    tp["compiled"]["lora_kernel"] = {"option": {"lora_kernel": "triton"},
                                     "models": {"streaming": {**tp["compiled"]["models"]["streaming"],
                                                              "tokens_per_s": 209_440.0}}}
    text = report_stage.render_setup(data)
    assert "| streaming | 209,440 | 1.20x | " in text and "`--lora-kernel triton`" in text
    assert "| streaming compiled triton |" in text  # (its profiled step)


def test_the_forward_target_states_the_ratio_to_the_best_dense():
    """Dense compiled (reduce-overhead) took 29.0 ms, HF eager 23.1 ms: the best dense is HF eager, so the
    streaming model's 31.2 ms is 0.74x the best dense (0.93x against the compiled dense alone: the mutation the
    line must not make)."""
    text = report_stage.render_speed(lease_b("speed"))
    line = next(x for x in text.splitlines() if x.startswith("- forward default T=8192 compiled"))
    assert "0.93x dense compiled, 0.74x dense HF eager, **0.74x the best dense** (HF eager, 23.05 ms" in line
    assert "CUDA graphs" not in line  # (the lease recorded none: its no-grad forwards ran in default mode)


def test_the_forward_target_says_whether_the_forwards_ran_as_cuda_graphs():
    row = {"case": "forward default T=8192 compiled decided", "speedup": 2.1, "speedup_vs_dense_eager": 3.0,
           "concept_s": 0.006, "dense_s": 0.0126, "dense_eager_s": 0.018, "concept_cuda_graphs": True,
           "dense_cuda_graphs": True, "cudagraph_skips": 0, "cudagraph_rerecorded": 0}
    line = report_stage.forward_target_lines([row])[-1]
    assert line.endswith("; CUDA graphs: streaming yes, dense yes, 0 skipped, 0 recorded again"), line
    line = report_stage.forward_target_lines([{**row, "dense_cuda_graphs": False, "cudagraph_rerecorded": 40}])[-1]
    assert line.endswith("; CUDA graphs: streaming yes, dense no, 0 skipped, 40 recorded again"), line
    line = report_stage.forward_target_lines([{**row, "concept_cuda_graphs": False, "dense_cuda_graphs": False,
                                               "no_grad_graphs_failed": "RuntimeError: capture failed"}])[-1]
    assert line.endswith("streaming no, dense no, 0 skipped, 0 recorded again (they failed the forward, measured again "
                         "without them: RuntimeError: capture failed)"), line


def test_the_forward_rows_top_kernels_are_tabled_per_side():
    top = [{"op": f"triton_per_fused_{i}|x", "device_ms": 8.0 - i, "calls": 30} for i in range(8)]
    row = {**ROW, "concept_device_busy_s": 0.0178, "concept_top_device": top, "dense_top_device": top[:2],
           "dense_device_busy_s": 0.02, "dense_kernel_launches": 795, "dense_host_syncs": 1, "dense_aten_ops": 4127,
           "concept_kernel_launches": 959, "concept_host_syncs": 3, "concept_aten_ops": 4540}
    lines = report_stage.top_device_lines([row, {**ROW, "suite": "train", "concept_top_device": top},
                                           {**ROW, "suite": "forward-compiled-dense", "concept_top_device": top}])
    rows = [x for x in lines if x.startswith("| forward")]
    assert len(rows) == 2 and rows[0].startswith("| forward default T=8192 r=0.125 flex | concept | 17.80 | – |")
    assert rows[0].count("`triton_per_fused_") == 8 and "`triton_per_fused_0\\|x` 8.00 (30)" in rows[0]
    assert rows[1].split(" | ")[1] == "dense" and rows[1].count("`triton") == 2
    assert report_stage.top_device_lines([ROW]) == []  # rows of kits before it: no table
    short = {"calls": 120, "device_ms": 0.4, "of_device": 0.02, "split_k_reduce_calls": 0}
    rows = [x for x in report_stage.top_device_lines([{**row, "concept_short_kernels": short}]) if x.startswith("| f")]
    assert " | concept | 17.80 | 120 calls, 0.4 ms (2 % of the device time; 0 split-K reductions) | `" in rows[0]


def test_the_quality_block_says_which_way_each_model_trained_and_why():
    training = {"mode": "compiled", "choice": "on", "why": "compiled was faster in `setup` (streaming)",
                "models": {"streaming": {"ran": "compiled", "tokens_per_s": 174533.1, "sized_by": "its compiled rate",
                                         "compile_s": 38.0},
                           "pruned": {"ran": "compiled", "tokens_per_s": 121608.3, "compile_s": 38.0,
                                      "sized_by": "its eager rate: setup measured it eager only"}}}
    line, = report_stage.training_lines(training)
    assert line.startswith("- training: streaming compiled (sized by 174,533 tokens/s, its compiled rate; "
                           "compilation 38 s); pruned compiled (sized by 121,608 tokens/s, its eager rate")
    assert line.endswith("Why: compiled was faster in `setup` (streaming).")
    assert report_stage.training_lines(None) == []  # plans before 2026-11-27b


def test_quality_reports_what_the_budget_dropped_over_training():
    """The quality stage's runs say how often the static budget bound as training went on (``capped``, the policy's
    boundaries dropped per token): mean, most, the last tenth's mean; a run that logs none (a baseline) has none."""
    from benchmarks.gpu_kit import quality_stage

    rows = [{"step": i + 1, "loss": 5.0, "capped": c} for i, c in enumerate([0.0] * 18 + [0.002, 0.004])]
    summary = quality_stage.capped_summary(rows)
    assert summary == pytest.approx({"capped_mean": 0.0003, "capped_max": 0.004, "capped_last_tenth": 0.003})
    assert quality_stage.capped_summary([{"step": 1, "loss": 5.0}]) == {}  # negative control: a baseline's log
    plan = {"steps": 20, "tokens_per_step": 100}
    runs = quality_stage.progress({"streaming": rows, "dense": [{"step": 20, "loss": 3.0}]}, plan)
    assert runs[0]["capped_max"] == 0.004 and "capped_max" not in runs[1]
    assert [report_stage.capped_cell(r) for r in runs] == ["0.0003 / 0.004 / 0.003", "–"]


def test_the_compiled_rows_say_their_budget():
    """`setup` records the compiled build's budget as it resolved it (the default `auto`); `report` states it beside
    the compiled rows; a lease's JSON from before it records none, and the text then says nothing of it."""
    compiled = {"option": {"compile": "model"}, "max_ratio": "auto",
                "budget": {"max_ratio": 0.15625, "slack": 6, "concept_slots": 26, "seq_len": 128}}
    assert report_stage.budget_text(compiled) == ("; the streaming model's budget `auto`: 0.15625 + 6 slack, 26 concept "
                                                  "slots a row of 128")
    assert report_stage.budget_text({"option": {"compile": "on"}, "max_ratio": 0.3}) == ""


def test_the_compiled_rows_say_whether_training_ran_as_cuda_graphs():
    """Each compiled row says whether its training forward and backward ran as CUDA graphs and how many graphs inductor
    skipped; a row CUDA graphs failed is named with its error (measured again without them); a lease's JSON from
    before records none of it, and its cells say '–'."""
    assert report_stage.graphs_cell({"cuda_graphs": True, "cudagraph_skips": 0}) == "yes, 0 skipped"
    assert report_stage.graphs_cell({"cuda_graphs": True, "cudagraph_skips": 0, "cudagraph_rerecorded": 40}) == \
        "yes, 0 skipped, 40 recorded again"
    assert report_stage.graphs_cell({"cuda_graphs": False, "cudagraph_skips": 0}) == "no"
    assert report_stage.graphs_cell({}) == "–"
    throughput = {**THROUGHPUT, "failed": {}, "compiled": {
        "option": {"compile": "model"}, "training_cuda_graphs": False, "cuda_graphs_failed": {"streaming compiled": CRASH},
        "models": {"streaming": {"tokens_per_s": 250000.0, "step_s": 0.066, "vs_eager": 3.1, "cudagraph_skips": 0,
                                 "cuda_graphs": False},
                   "dense": {"tokens_per_s": 150000.0, "step_s": 0.109, "vs_eager": 2.5}}}}
    text = report_stage.render_setup(envelope("setup", "ok", "2026-11-29T02:04:13Z", "setup speed",
                                              {"environment": ENVIRONMENT, "throughput": throughput}))
    assert "| model | tokens/s | vs eager | s / step | compile s | first step s | peak MiB | CUDA graphs |" in text
    assert "| streaming | 250,000 | 3.10x | 0.066 | – | – | – | no |" in text
    assert "| dense | 150,000 | 2.50x | 0.109 | – | – | – | – |" in text
    assert "CUDA graphs failed these rows, measured again without them" in text and "streaming compiled: Runtime" in text


def test_the_profiled_steps_say_how_many_of_their_kernels_are_short():
    """Each profiled step's row gives its kernels under 5 us a call (``concept.profiling.short_kernels``): calls, device
    time, share, split-K reductions; a lease's JSON from before has none and its cell says '–'."""
    short = {"under_us": 5.0, "calls": 1418, "device_ms": 6.1, "of_calls": 0.58, "of_device": 0.32,
             "split_k_reduce_calls": 444}
    assert report_stage.short_kernels_cell(short) == ("1,418 calls, 6.1 ms (32 % of the device time; 444 split-K "
                                                      "reductions)")
    assert report_stage.short_kernels_cell(None) == "–"
    profile = {"wall_s": 0.066, "device_s": 0.019, "kernel_launches": 12, "host_syncs": 0, "ops": 290,
               "top_device": [{"op": "nvjet_sm90_gemm", "calls": 100, "device_ms": 2.1}], "short_kernels": short}
    throughput = {**THROUGHPUT, "failed": {}, "compiled": {
        "option": {"compile": "model"}, "models": {"streaming": {"tokens_per_s": 250000.0, "step_s": 0.066,
                                                                 "profile": profile}}}}
    text = report_stage.render_setup(envelope("setup", "ok", "2026-11-29T02:04:13Z", "setup speed",
                                              {"environment": ENVIRONMENT, "throughput": throughput}))
    assert "| short kernels | most device time |" in text and "short kernels: those under 5 us a call" in text
    profile["short_kernels"] = {**short, "under_us": 3.0}  # (the bound the rows were counted under, not a constant)
    text = report_stage.render_setup(envelope("setup", "ok", "2026-11-29T02:04:13Z", "setup speed",
                                              {"environment": ENVIRONMENT, "throughput": throughput}))
    assert "short kernels: those under 3 us a call" in text
    assert report_stage.short_under([None, {"under_us": 5.0}]) == "under 5 us" and report_stage.short_under([]) == \
        "under 5 us"
    assert report_stage.short_under({"old": {"wall_s": 1.0}, "none": {"short_kernels": None}}) == "under 5 us"
    assert "| streaming compiled | 0.066 | 0.019 | 12 | 0 | 290 | 1,418 calls, 6.1 ms (32 % of the device time; " \
           "444 split-K reductions) | `nvjet_sm90_gemm` 2.1 ms (100x) |" in text


def test_the_adapters_cost_is_tabled_per_projection():
    """``benchmarks/test_adapters.py``'s rows: per projection, the base alone against base and adapter, device time
    and kernels a projection (the call's figures over its repeats); a CPU's rows (no device time) give no table."""
    row = {"case": "adapter cost middle q/o (3328 x 576 -> 576)", "suite": "adapter-cost", "rows": 3328,
           "dense_s": 0.0005, "concept_s": 0.0012, "speedup": 0.42, "ideal_speedup": None,
           "dense_device_busy_s_per_projection": 9.5e-6, "concept_device_busy_s_per_projection": 41.0e-6,
           "dense_kernel_launches_per_projection": 2.0, "concept_kernel_launches_per_projection": 12.0,
           "concept_short_kernels": {"calls": 90, "device_ms": 0.3, "of_device": 0.7, "split_k_reduce_calls": 20}}
    lines = report_stage.adapter_cost_lines([row, {**ROW}])
    assert lines[-1] == ("| middle q/o (3328 x 576 -> 576) | 3,328 | 9.5 | 41.0 | 31.5 | 2/12 | 90 calls, 0.3 ms "
                         "(70 % of the device time; 20 split-K reductions) |")
    assert len([x for x in lines if x.startswith("| middle")]) == 1
    cpu = {k: v for k, v in row.items() if "per_projection" not in k}
    assert report_stage.adapter_cost_lines([cpu]) == []
    # with `--lora-kernel triton`'s side (a CUDA run with Triton): its time, the adapter's share, its kernels
    fused = {**row, "kernels_device_busy_s_per_projection": 14.0e-6, "kernels_kernel_launches_per_projection": 6.0}
    lines = report_stage.adapter_cost_lines([fused])
    assert "`triton`" in lines[1] and "kernels (base / adapted / `triton`)" in lines[3]
    assert lines[-1] == ("| middle q/o (3328 x 576 -> 576) | 3,328 | 9.5 | 41.0 | 31.5 | 14.0 | 4.5 | 2/12/6 | 90 calls, "
                         "0.3 ms (70 % of the device time; 20 split-K reductions) |")
    assert lines[4].count("|") == lines[-1].count("|") == lines[3].count("|")


# -- what the lease says of the defaults (benchmarks/gpu_kit/defaults_verdict.py) ---------------------------------
def supporting_lease() -> dict:
    """A lease whose results support both changes: every compiled and Triton CUDA test passed; compiled training
    faster than eager and the Triton kernels faster than the matmuls for both models; the compiled 8k forward faster
    than the eager one; every adapter-cost row faster with the kernels; the diagnosis's ranked variants."""
    from benchmarks.gpu_kit import flex_diagnosis

    tests = [{"id": f"tests/{name}", "outcome": "passed", "seconds": 1.0, "message": ""} for name in (
        "test_cuda.py::test_compiled_training_steps_equal_eager_on_cuda[model]",
        "test_lora_triton.py::test_the_compiled_kernels_equal_the_matmuls_on_cuda", "test_cuda.py::test_decoding")]
    rate = lambda s, d: {"streaming": {"tokens_per_s": s}, "dense": {"tokens_per_s": d}}  # noqa: E731
    throughput = {"models": rate(80e3, 70e3), "compiled": {"option": {"compile": "model"}, "models": rate(300e3, 210e3),
                                                          "lora_kernel": {"models": rate(360e3, 240e3)}}}
    adapter = lambda case, matmuls, kernels: {"case": case, "suite": "adapter-cost",  # noqa: E731
                                              "concept_device_busy_s_per_projection": matmuls,
                                              "kernels_device_busy_s_per_projection": kernels}
    rows = [{"case": "forward default T=8192 decided flex", "suite": "forward-decided", "concept_s": 0.040},
            {"case": "forward default T=8192 compiled decided", "suite": "forward-compiled", "concept_s": 0.009},
            adapter("adapter cost q 16384", 30e-6, 20e-6), adapter("adapter cost q 3328", 25e-6, 9e-6)]
    variants = [{"variant": "sdpa-causal", "ms": 0.26, "graph_ms": 0.25, "exact": None},
                {"variant": "ranges-static", "ms": 0.37, "graph_ms": 0.12, "exact": True, "speedup_vs_dense": 2.08}]
    diagnosis = {"variants": variants, **flex_diagnosis.conclude({"variants": variants})}
    return {"setup": {"result": {"throughput": throughput}}, "exact": {"result": {"tests": tests}},
            "speed": {"result": {"rows": rows, "flex_diagnosis": diagnosis}}}


def test_a_lease_that_shows_both_exact_and_faster_supports_both_defaults():
    from benchmarks.gpu_kit import defaults_verdict as verdicts

    lease = supporting_lease()
    args = (lease["setup"], lease["exact"], lease["speed"])
    compiled, kernels = verdicts.compile_verdict(*args), verdicts.lora_kernel_verdict(*args)
    assert compiled["supported"] and kernels["supported"] and not compiled["against"] + kernels["against"]
    assert "streaming 3.75x, dense 3.00x" in compiled["evidence"][1] and "4.44x the eager one" in compiled["evidence"][2]
    assert "streaming 1.20x, dense 1.14x" in kernels["evidence"][1] and "all 2 adapter-cost rows" in kernels["evidence"][2]
    text = verdicts.render(lease)
    assert text.count("**supported**") == 2 and "`ranges-static` (0.120 ms in a CUDA graph, 2.08x" in text
    assert "the change: `DEFAULT_COMPILE` in `concept/config.py`" in text and "`LoraSettings.kernel`'s default" in text


@pytest.mark.parametrize("fault,option,why", [
    ("a compiled test failed", "compile", "1 CUDA test(s) of a compiled path failed"),
    ("a Triton test failed", "lora", "1 CUDA test(s) of the adapters' Triton kernels failed"),
    ("dense slower compiled", "compile", "not faster for every model in `setup` (streaming 3.75x, dense 0.90x)"),
    ("the kernels slower in the middle stack", "lora", "no less device time than the matmuls in adapter cost q 3328"),
    ("no compiled forward", "compile", "no compiled and eager 8k forward rows"),
    ("no kernel rows in setup", "lora", "did not measure streaming and dense both ways")])
def test_each_missing_or_contrary_piece_of_evidence_keeps_its_default(fault, option, why):
    """Negative controls: one piece of evidence against (or missing) and that default is not supported, saying
    why; the other default keeps its verdict."""
    from benchmarks.gpu_kit import defaults_verdict as verdicts

    lease = supporting_lease()
    tests, rows = lease["exact"]["result"]["tests"], lease["speed"]["result"]["rows"]
    throughput = lease["setup"]["result"]["throughput"]
    if fault == "a compiled test failed":
        tests[0]["outcome"] = "failed"
    elif fault == "a Triton test failed":
        tests[1]["outcome"] = "error"
    elif fault == "dense slower compiled":
        throughput["compiled"]["models"]["dense"]["tokens_per_s"] = 63e3
    elif fault == "the kernels slower in the middle stack":
        rows[3]["kernels_device_busy_s_per_projection"] = 26e-6
    elif fault == "no compiled forward":
        del rows[1]
    else:
        del throughput["compiled"]["lora_kernel"]
    args = (lease["setup"], lease["exact"], lease["speed"])
    failing, other = ((verdicts.compile_verdict, verdicts.lora_kernel_verdict) if option == "compile"
                      else (verdicts.lora_kernel_verdict, verdicts.compile_verdict))
    verdict = failing(*args)
    assert not verdict["supported"] and any(why in a for a in verdict["against"]), verdict
    # (the Triton test that failed compiles the kernels: a compiled path's test too, against both defaults)
    assert other(*args)["supported"] is (fault != "a Triton test failed")


def test_the_fourth_leases_results_support_neither_default_yet():
    """The H200 lease of 2026-11-27b: three compiled CUDA tests failed (fixed since), compiled dense was not measured,
    the Triton kernels did not exist yet; the diagnosis's fastest exact variant `ranges-static`, ranked by events
    (that kit had no CUDA-graph times). The block in docs/benchmarks.md is this rendering."""
    from pathlib import Path

    from benchmarks.gpu_kit import defaults_verdict as verdicts

    root = Path(__file__).resolve().parents[1]
    found = report_stage.load([root / "benchmarks/gpu_results/nvidia-h200/lease-2026-11-27b"])
    text = verdicts.render(found)
    assert "**supported**" not in text and "3 CUDA test(s) of a compiled path failed" in text
    assert "did not measure dense both ways (training, compiled against eager)" in text
    assert "no CUDA test of the adapters' Triton kernels ran" in text
    assert "`ranges-static` (0.367 ms by CUDA events, 0.72x dense causal SDPA)" in text
    doc = (root / "docs/benchmarks.md").read_text()
    begin, end = report_stage.markers("defaults")
    assert doc.split(begin)[1].split(end)[0].strip() == text.strip()


def test_a_row_of_two_other_sides_names_them_in_both_tables():
    """``benchmarks/test_merged.py``'s rows hold the adapters in the dense columns and the merged model in the concept
    columns (``sides``): the report names them there; a row without ``sides`` keeps dense and concept."""
    data = lease_b("speed")
    profiled = next(r for r in data["result"]["rows"] if "concept_device_busy_s" in r)
    merged = {**profiled, "case": "merged default T=8192 forward", "sides": ["adapters", "merged"], "suite": "merged"}
    text = report_stage.render_speed({**data, "result": {**data["result"], "rows": [profiled, merged]}})
    assert "| merged default T=8192 forward (adapters / merged) |" in text
    assert "| merged default T=8192 forward | adapters |" in text and "| merged default T=8192 forward | merged |" in text
    assert f"| {profiled['case']} | dense |" in text and f"| {profiled['case']} (" not in text
