"""The benchmarks' helpers (``benchmarks/compiled.py``, ``benchmarks/conftest.py``): compiled builds carry a static
concept budget, the dense side is the dense family compiled the same way, and the timing tables keep each side's numbers apart."""
from __future__ import annotations

import pytest
import torch

from benchmarks import compiled
from benchmarks.conftest import cpu_side_by_side, renamed_sides


def test_compiled_builds_get_a_static_budget_unless_they_set_one():
    from concept.config import BuildConfig

    assert compiled.budgeted(BuildConfig()).max_ratio == "auto"  # the default: a budget already
    assert compiled.budgeted(BuildConfig(max_ratio=0.0)).max_ratio == compiled.BUDGET
    assert compiled.budgeted(BuildConfig(max_ratio="none")).max_ratio == compiled.BUDGET
    assert compiled.budgeted(BuildConfig(max_ratio=0.5)).max_ratio == 0.5
    assert compiled.build_option("reduce-overhead") == {"compile": "reduce-overhead"}
    assert compiled.train_option("model") == {"compile": "model"} == compiled.build_option("model")


def test_the_kit_compiles_whole_where_torch_has_layer_regions_and_regionally_elsewhere(monkeypatch):
    """``model`` (whole forward) with the regions; ``on`` without them (torch 2.11: ``model`` would trace 30 layers
    inline, 4x ``on``'s compilation)."""
    import concept.compiled

    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", True)
    assert compiled.kit_choice() == "model" and compiled.train_option() == {"compile": "model"}
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", False)
    assert compiled.kit_choice() == "on" and compiled.train_option() == {"compile": "on"}
    assert compiled.build_option() == {"compile": "on"}


@pytest.mark.parametrize("choice", ["model", "on"])
def test_dense_is_the_dense_family_compiled_by_the_library_as_the_concept_model(choice):
    """The dense side of a compiled comparison: the dense family's model over the same backbone (flash causal
    attention: no mask for a batch without one), under the concept model's compile choice, inductor on CUDA and
    dynamo only on a CPU; its logits are the backbone's. Not transformers' forward under ``torch.compile``, whose
    traced mask keeps SDPA from its flash kernel."""
    import concept.compiled
    from concept.dense import DenseModel
    from tests.test_graph_memory import streaming_model

    backbone = streaming_model().backbone
    for device, backend in (("cuda", None), ("cpu", "eager")):
        dense = compiled.dense_model(backbone, device, choice)
        assert isinstance(dense, DenseModel) and dense.backbone is backbone and not dense.training
        assert dense.compiled_stacks.choice == choice and dense.compiled_stacks.backend == backend
        assert isinstance(dense.__dict__.get("forward"), concept.compiled.WholeForward) is (choice == "model")
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, backbone(ids).logits, atol=1e-5, rtol=1e-5)


def test_sides_are_timed_in_turn_and_renamed_without_mixing():
    calls = []
    timing = cpu_side_by_side({"dense_eager": lambda: calls.append("e"), "dense": lambda: calls.append("d"),
                               "concept": lambda: calls.append("c")}, rounds=2)
    assert calls == ["e", "d", "c"] * 3  # one warm-up round, then alternating
    assert set(timing) == {"dense_eager_s", "dense_s", "concept_s", "speedup"}
    row = renamed_sides({**timing, "reps": 2, "dense_eager_wall_s": 1.0, "dense_wall_s": 2.0, "concept_wall_s": 3.0},
                        {"dense_eager": "dense", "dense": "concept"})
    assert row == {"dense_s": timing["dense_eager_s"], "concept_s": timing["dense_s"], "speedup": timing["speedup"],
                   "reps": 2, "dense_wall_s": 1.0, "concept_wall_s": 2.0}


def test_bench_renders_the_op_counts_apart_from_the_speed_rows(capsys):
    from concept_cli import bench_cmd

    bench_cmd.render([{"suite": "ops", "backbone": "tiny-llama", "what": "forward", "model": "streaming", "tokens": 512,
                       "aten_ops": 1606, "host_syncs": 6, "syncs_outside_optimizer": 6},
                      {"case": "forward x", "dense_s": 0.2, "concept_s": 0.1, "speedup": 2.0, "ideal_speedup": 2.5,
                       "fraction_of_ideal": 0.8, "ratio": 0.25}])
    out = capsys.readouterr().out
    assert "aten ops and host syncs" in out and "1,606" in out and "concept vs dense" in out and "2.00x" in out


def test_the_forward_benchmarks_time_the_default_static_budget():
    """The forward / training-step rows time the model a user builds: its default static budget (``auto``), not
    the layout sized from the decisions (budget 0), which reads two sizes back per forward (the fourth lease's
    eager rows had those 2 ``.item()``). Negative control: a budget of 0 syncs (twice for the layout, more in `chunked`)."""
    from benchmarks.test_forward import _model
    from concept.flops import evenly_spaced_keep
    from concept.syncs import HostSyncs

    def syncs(model):
        ids, keep = torch.randint(0, 256, (1, 256)), evenly_spaced_keep(256, 0.125)[None]
        with torch.no_grad():
            model(ids, keep=keep)  # (the first call reads the policy's target ratio once, and caches it)
            with HostSyncs() as seen:
                model(ids, keep=keep)
        return seen.hidden

    assert _model("tiny-llama", "chunked").max_ratio > 0
    assert syncs(_model("tiny-llama", "chunked").eval()) == 0
    assert syncs(_model("tiny-llama", "chunked", max_ratio=0.0).eval()) >= 2  # (the layout's 2, and chunked's own)


def test_a_rows_top_kernels_are_the_profiles_largest_eight_and_follow_their_side_when_renamed():
    """``NAME_top_device``: the profiled call's kernels with the most device time (``profile_call``'s
    ``top_device``, largest first), the first 8, each name cut at 160 characters; renaming the sides (the compiled
    forward's dense-vs-HF-eager row) carries each side's list with it."""
    from benchmarks.conftest import TOP_DEVICE, top_device

    prof = {"top_device": [{"op": f"void at::native::elementwise_kernel<{i}, " + "x" * 300, "calls": 3,
                            "device_ms": 12.0 - i, "cpu_ms": 0.0} for i in range(12)]}
    top = top_device(prof)
    assert TOP_DEVICE == 8 and len(top) == 8 and [t["device_ms"] for t in top] == [12.0 - i for i in range(8)]
    assert all(len(t["op"]) == 160 and set(t) == {"op", "device_ms", "calls"} for t in top)
    timing = {"dense_eager_s": 0.023, "dense_eager_top_device": top[:1], "dense_s": 0.029, "dense_top_device": top[1:2],
              "concept_s": 0.031, "concept_top_device": top[2:3]}
    renamed = renamed_sides(timing, {"dense_eager": "dense", "dense": "concept"})
    assert renamed["dense_top_device"] == top[:1] and renamed["concept_top_device"] == top[1:2]


def test_cudagraph_recordings_are_counted_once_each(monkeypatch):
    """``count_cudagraph_recordings`` wraps cudagraph trees' ``record_function`` once (a second call adds no second
    count) and counts each call; what the function returns is passed on."""
    from torch._inductor import cudagraph_trees

    from benchmarks.compiled import count_cudagraph_recordings, cudagraph_recordings

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function",
                        lambda self, new_inputs, function_id: ("recorded", function_id))
    count_cudagraph_recordings()
    count_cudagraph_recordings()
    before = cudagraph_recordings()
    assert cudagraph_trees.CUDAGraphTreeManager.record_function(None, [], 7) == ("recorded", 7)
    assert cudagraph_recordings() == before + 1


def test_a_forward_row_failed_by_its_no_grad_graphs_is_measured_again_without_them(monkeypatch):
    """``without_failed_graphs``: a compiled forward row that fails with ``model``'s no-grad forwards as CUDA graphs is
    measured again with them off (for the rest of the process), the first error kept; a row that fails without them
    (or where there are none: a CPU) fails. Negative control: the graphs off from the start, the error propagates."""
    import concept.compiled

    monkeypatch.setattr(concept.compiled, "training_cuda_graphs", lambda device_type, environ=None: True)
    monkeypatch.setattr(concept.compiled, "NO_GRAD_CUDA_GRAPHS", True)
    calls = []

    def measure():
        calls.append(concept.compiled.NO_GRAD_CUDA_GRAPHS)
        if concept.compiled.NO_GRAD_CUDA_GRAPHS:
            raise RuntimeError("CUDAGraph capture failed")
        return "row"

    assert compiled.without_failed_graphs(measure, "cuda") == ("row", "RuntimeError: CUDAGraph capture failed")
    assert calls == [True, False] and concept.compiled.NO_GRAD_CUDA_GRAPHS is False
    assert compiled.without_failed_graphs(lambda: "row", "cuda") == ("row", None)
    calls.clear()
    with pytest.raises(RuntimeError, match="capture failed"):  # (the graphs already off: nothing to fall back to)
        compiled.without_failed_graphs(lambda: calls.append(1) or measure_error(), "cuda")
    assert calls == [1]


def measure_error():
    raise RuntimeError("capture failed")


def test_a_forward_row_says_which_sides_ran_as_cuda_graphs(monkeypatch):
    """``forward_graphs``: each side called twice more, then per model whether its no-grad forward runs as CUDA graphs
    (a ``WholeForward`` of inductor's on CUDA: yes; the same on a CPU, a backend's, or no whole forward: no), and the
    skips and recordings counted from there."""
    import concept.compiled
    from tests.test_graph_memory import streaming_model

    calls = []
    fns = {"concept": lambda: calls.append("concept"), "dense": lambda: calls.append("dense")}
    inductor = compiled.dense_model(streaming_model().backbone, "cuda", "model")  # (inductor's: no backend)
    aot = compiled.dense_model(streaming_model().backbone, "cpu", "model")  # (dynamo only here: a backend)
    monkeypatch.setattr(concept.compiled, "training_cuda_graphs", lambda device_type, environ=None: device_type == "cuda")
    with torch.no_grad():
        found = compiled.forward_graphs({"concept": inductor, "dense": aot}, fns, "cuda")
        assert calls == ["concept", "concept", "dense", "dense"]
        assert found.done() == {"concept_cuda_graphs": True, "dense_cuda_graphs": False, "cudagraph_skips": 0,
                                "cudagraph_rerecorded": 0}
        assert compiled.forward_graphs({"concept": inductor}, {}, "cpu").done()["concept_cuda_graphs"] is False
        counts = torch._dynamo.utils.counters["inductor"]
        monkeypatch.setitem(counts, "cudagraph_recordings", counts["cudagraph_recordings"] + 3)  # (three since)
        assert found.done()["cudagraph_rerecorded"] == 3
    assert compiled.forward_graphs({"concept": streaming_model()}, {}, "cuda").done()["concept_cuda_graphs"] is False


def test_bench_compile_auto_is_what_auto_decides_on_the_suites_device(monkeypatch):
    """``concept bench --compile auto``: eager on a CPU (the compiled cases skip), the GPU's choice on CUDA with
    Triton; any other option as given."""
    import concept.compiled

    monkeypatch.setattr(concept.compiled, "TRITON_INSTALLED", True)
    assert compiled.suite_choice("auto", "cpu") == "off"
    assert compiled.suite_choice("auto", "cuda") == concept.compiled.gpu_choice() != "off"
    assert compiled.suite_choice("on", "cpu") == "on" and compiled.suite_choice("off", "cuda") == "off"
