"""``--compile model`` (``concept.compiled.WholeForward``): the whole forward (the length policy's decisions, the
packing, the attention plans, the three stacks, the loss) is one graph with ``fullgraph=True``: no eager op is
left between the stacks. Captured by ``aot_eager`` in the default suite (inductor's C++ compilation of a whole
model takes minutes on a CPU).

Checked: a forward is one graph with no break, for each length policy that scans (its host rule inside the graph
as the opaque op ``concept::host_scan``) and equal to eager; 20 training steps whose decisions and packing vary
run on the first step's graphs (a recompile raises) with eager's losses, ratios and gradient norms; a compiled
forward dispatches no aten op outside its graph (``benchmarks/glue_ops.py``); a call the graph cannot take (a
perturbation function) runs eagerly; ``off`` undoes it. Negative controls: the dynamic layout recompiles; an
op that syncs the host (an ``.item()``) breaks the graph and ``fullgraph`` says so."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import concept
import concept.compiled
from concept import BuildConfig, ComponentRef
from concept.compiled import WholeForward, compile_model, torch_release
from concept.training import TrainConfig, Trainer
from tests.conftest import mixed_model
from tests.test_compile import (STEPS, chunk_the_loss, equal_rows_then_the_dynamic_layout_recompiles,  # noqa: F401
                                graphs_by_function, run, trainer)  # (``run``: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def captured_model(policy: str, **extra):
    """A tiny mixed model with a static budget, compiled whole and captured by ``aot_eager``, and its eager twin."""
    import copy

    model = copy.deepcopy(mixed_model(policy, **extra))
    model.max_ratio = 0.25
    return model, compile_model(copy.deepcopy(model), "model", backend="aot_eager")


@pytest.mark.parametrize("policy,attention", [("null", "sdpa"), ("threshold", "sdpa"), ("mtp", "sdpa"),
                                              ("fixed", "sdpa"), ("null", "flex")])
def test_a_forward_is_one_graph_equal_to_eager(fresh_dynamo, monkeypatch, policy, attention):
    """(``flex``: its BlockMask built and its kernel called inside the graph, not by their own compiled calls.)"""
    graphs = graphs_by_function(monkeypatch)
    model, compiled = captured_model(policy, attention=attention)
    assert isinstance(compiled.forward, WholeForward)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(3):
            ids = torch.randint(0, 97, (2, 24), generator=g)
            mask = torch.ones_like(ids)
            mask[1, :5] = 0  # (left padding in one row)
            fast, slow = compiled(ids, attention_mask=mask, labels=ids), model(ids, attention_mask=mask, labels=ids)
            assert torch.equal(fast.keep, slow.keep) and torch.equal(fast.concept_ids, slow.concept_ids)
            torch.testing.assert_close(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fast.loss, slow.loss, atol=1e-6, rtol=1e-6)
            if i == 0:
                torch._dynamo.config.error_on_recompile = True  # the next batches: the same graph
    ours = {name: n for name, n in graphs.items() if not name.startswith("_flex_attention")}  # (eager flex's own)
    assert ours == {"forward_whole": 1} and not counters["graph_break"]


def test_the_host_scan_in_a_graph_decides_as_the_host_scan(fresh_dynamo):
    """The opaque ``concept::host_scan`` (a rule sent as its device form) against the eager scan, with document
    starts resetting the rule; and it is called by the graph (not folded away: its decisions vary with the input)."""
    from plugins.length_policies.null import tracker_rule  # noqa: F401  (registers the rule)
    from concept.streaming.scan import DeviceRule, scan_rule
    from tests.device_scan_cases import intervals

    device, dtypes = DeviceRule("null_tracker_scan", (3,)), (torch.long, torch.long)
    run = lambda bound, valid, reset: scan_rule(device, [bound], valid, reset, dtypes)  # noqa: E731
    graph = torch.compile(run, fullgraph=True, dynamic=False, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(4):
        bound = intervals((3, 30), 30, g)
        valid, reset = torch.rand(3, 30, generator=g) > 0.1, torch.rand(3, 30, generator=g) > 0.8
        (keep, states), (want, want_states) = graph(bound, valid, reset), run(bound, valid, reset)
        assert torch.equal(keep, want) and all(torch.equal(a, b) and a.dtype == b.dtype
                                               for a, b in zip(states, want_states))
        seen.add(tuple(keep.flatten().tolist()))
    assert len(seen) == 4 and not counters["graph_break"]


def test_a_sync_in_the_forward_breaks_the_graph_and_fullgraph_refuses_it(fresh_dynamo, monkeypatch):
    """Negative control: a hidden ``.item()`` between the stacks is a graph break, an error under fullgraph."""
    from concept.streaming.stacks import StackRuns

    _, compiled = captured_model("null")
    middle = StackRuns.run_middle

    def syncing(self, c, *args, **kwargs):
        out, updates = middle(self, c, *args, **kwargs)
        return out * (1.0 if out.sum().item() == out.sum().item() else 0.0), updates

    monkeypatch.setattr(StackRuns, "run_middle", syncing)
    with torch.no_grad(), pytest.raises(Exception, match="item|graph break|Unsupported|Data-dependent"):
        compiled(torch.randint(0, 97, (2, 24)))


def test_a_call_the_graph_cannot_take_runs_eagerly_and_off_undoes_it(fresh_dynamo, monkeypatch):
    graphs = graphs_by_function(monkeypatch)
    model, compiled = captured_model("null")
    ids = torch.randint(0, 97, (2, 24))
    perturb = lambda c, valid: c * 0.5  # noqa: E731  (the diagnostics' controls pass functions)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, perturb=perturb).logits, model(ids, perturb=perturb).logits,
                                   atol=1e-5, rtol=1e-5)
    assert "forward_whole" not in graphs  # (its stacks compiled whole instead)
    with torch.no_grad(), compiled.budget_off(), model.budget_off():  # the keep-all control: no budget (the dynamic
        every = torch.ones_like(ids, dtype=torch.bool)  # layout), eagerly
        torch.testing.assert_close(compiled(ids, keep=every).logits, model(ids, keep=every).logits, atol=1e-5,
                                   rtol=1e-5)
    assert "forward_whole" not in graphs
    compile_model(compiled, "off")
    assert "forward" not in compiled.__dict__ and compiled.compiled_stacks is None


def test_a_compiled_forward_dispatches_nothing_outside_its_graph(tmp_path, fresh_dynamo):
    """``benchmarks/glue_ops.py`` with ``model``: 0 aten ops outside the graph in a forward (312 with ``layers``,
    ``tests/test_glue_ops.py``), what is left of a training step is its backward's gradient accumulation, the
    optimizer and the ratio controller (719 with ``layers``)."""
    from benchmarks.glue_ops import measure

    result = measure(seq_len=256, compile="model", folder=tmp_path)
    assert result["forward"].total == 0 and result["plain"].total == 0
    assert result["profiled"]["forward"] == 0 and result["profiled"]["plain"] == 0
    pin = STEP_GLUE.get(torch_release(), max(STEP_GLUE.values()))  # (a torch not pinned: the highest pin, a ceiling)
    assert result["step"].total <= pin, result["step"].by_line.most_common(10)
    if torch_release() in STEP_GLUE:
        assert result["step"].total == pin, f"glue ops went down to {result['step'].total}: lower STEP_GLUE"
    assert not any(line.startswith(("concept/packing", "concept/attention", "concept/streaming/model",
                                    "concept/losses")) for line in result["step"].by_line)
    assert not counters["graph_break"]


# glue ops of a training step under ``model`` (719 under ``layers``), by torch release: the optimizer, accumulation,
# the ratio controller's statistics, the backward's AccumulateGrad, the temperature schedule's fill (2.11, the GPU
# image's, with its layers as regions: ``make image-check``; 286 with them inline)
STEP_GLUE = {(2, 13): 285, (2, 11): 285}


def test_training_runs_twenty_varied_steps_on_the_first_steps_graphs(run, fresh_dynamo, monkeypatch):
    """The training forward (with its loss) and the ratio controller's no-grad calibration forward: two graphs;
    19 more steps with other decisions and documents on them, equal to eager. Negative control: the dynamic
    layout recompiles."""
    graphs = graphs_by_function(monkeypatch)
    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", "aot_eager")
    eager, compiled = trainer(run, "m-eager", "off"), trainer(run, "m-compiled", "model")  # (test_compile's recipe)
    chunk_the_loss(monkeypatch, compiled.model)
    rows = [(eager.train_step(), compiled.train_step())]
    assert dict(graphs) == {"forward_whole": 2} and not counters["graph_break"]
    torch._dynamo.config.error_on_recompile = True
    rows += [(eager.train_step(), compiled.train_step()) for _ in range(STEPS - 1)]
    assert dict(graphs) == {"forward_whole": 2} and not counters["graph_break"]
    equal_rows_then_the_dynamic_layout_recompiles(rows, compiled, match="[Rr]ecompil|graph break|Unsupported|Data-dependent")


@pytest.mark.parametrize("baseline", ["dense", "pruned"])
def test_the_baselines_train_compiled_whole_as_eager(run, fresh_dynamo, monkeypatch, baseline):
    """The dense and pruned baselines under ``model`` (their forward one graph, no family code in the core):
    three training steps equal eager's, on one graph."""
    graphs = graphs_by_function(monkeypatch)
    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", "aot_eager")
    trainer = lambda name, choice: Trainer.start(run / "built", run / name, TrainConfig(  # noqa: E731
        steps=3, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=1, warmup=1,
        data=str(run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2), compile=choice, baseline=baseline))
    eager, compiled = trainer(f"{baseline}-eager", "off"), trainer(f"{baseline}-model", "model")
    for _ in range(3):
        a, b = eager.train_step(), compiled.train_step()
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert dict(graphs) == {"forward_whole": 1} and not counters["graph_break"]


def test_a_backbone_that_ran_an_hf_forward_still_compiles(fresh_dynamo, monkeypatch):
    """transformers installs output-capturing hooks at a backbone's first HF forward (here one asking for hidden
    states); they read a ``ContextVar`` dynamo cannot trace (``concept.compiled.traceable_output_capturing``). The
    compiled forward runs; HF's own hidden states are still collected after it. Negative control: the collector's
    plain read fails the trace."""
    from transformers.utils import output_capturing

    model, compiled = captured_model("null")
    ids = torch.randint(0, 97, (2, 24))
    layers = model.backbone.config.num_hidden_layers
    with torch.no_grad():
        assert len(compiled.backbone(ids, output_hidden_states=True).hidden_states) == layers + 1  # (hooks in)
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        assert len(compiled.backbone(ids, output_hidden_states=True).hidden_states) == layers + 1
        collector = output_capturing._active_collector
        monkeypatch.setattr(collector, "get", collector.context_var.get)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="ContextVar"):
            compiled(ids)


def test_the_host_time_benchmark_measures_each_choice(tmp_path, fresh_dynamo, monkeypatch):
    """``benchmarks/host_time.py``'s rows (its table in docs/benchmarks.md), eager and ``model`` (captured here)."""
    from benchmarks import host_time
    from benchmarks.op_counts import built_folder

    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", "aot_eager")
    folder = built_folder(folder=tmp_path)
    rows = [host_time.measure("streaming", choice, folder, seq_len=64, reps=2) for choice in ("off", "model")]
    assert [r["compile"] for r in rows] == ["off", "model"]
    assert all(r["step_ms"] > 0 and r["forward_ms"] > 0 and r["first_step_s"] > 0 for r in rows)
    assert "| streaming | `model` |" in host_time.table(rows) and not counters["graph_break"]


def test_generation_under_model_decodes_as_eager(fresh_dynamo, monkeypatch):
    """A prefill passes a KV cache (not a graph input): it runs eagerly with its stacks compiled whole, then the
    compiled static step decodes, as under the other choices; the tokens and decisions are eager's."""
    from tests.test_compile import captured

    captured(monkeypatch)  # (every compile captured by aot_eager: the static step's too)
    model, compiled = captured_model("null")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    eager, fast = (m.generate(prompts, max_new_tokens=5, output_logits=True) for m in (model, compiled))
    assert fast.tokens == eager.tokens and fast.keep == eager.keep
    torch.testing.assert_close(fast.logits, eager.logits, atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.parametrize("scaling", [2.0, 3.0, 1.0])
def test_the_fused_adapters_compile_to_their_eager_values(fresh_dynamo, scaling):
    """``concept.lora.LoraMatmuls`` under inductor (C++ on this CPU) equals its eager values: traced, a power-of-two
    scaling multiplies ``t`` before the add, since inductor on a CPU (torch 2.13) computes ``torch.add(x W^T, t,
    alpha=2)``, and an add with an alpha next to any matmul, as if alpha were 1: the default LoRA scaling is 2, so
    every compiled forward (``on`` and ``model``) ran its adapters at half their weight, a trained tiny model's
    logits 0.02 off and its concept head's 0.2 (found by ``concept eval --compile`` against ``concept eval``).
    Negative control: that add, compiled, is not ``x W^T + 2 t`` (when it is, torch has fixed it)."""
    from concept.lora import LoraMatmuls

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 16, generator=g), torch.randn(16, 16, generator=g) * 0.1
    a, b = torch.randn(4, 16, generator=g) * 0.1, torch.randn(16, 4, generator=g) * 0.1
    eager = LoraMatmuls.apply(x, w, a, b, scaling, torch.float32)
    compiled = torch.compile(lambda x: LoraMatmuls.apply(x, w, a, b, scaling, torch.float32), fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(eager, x @ w.t() + scaling * ((x @ a.t()) @ b.t()), atol=1e-6, rtol=1e-6)
    if scaling == 2.0:
        add = torch.compile(lambda x: torch.add(x @ w.t(), (x @ a.t()) @ b.t(), alpha=2.0), fullgraph=True)(x)
        assert not torch.allclose(add, eager, atol=1e-3), "inductor adds two matmuls with their alpha now: the " \
            "workaround in LoraMatmuls.forward can go"


# -- CUDA graphs for the training forward ----------------------------------------------------------------------
def test_training_and_no_grad_forwards_run_as_cuda_graphs_and_only_on_cuda(monkeypatch):
    """``WholeForward.cuda_graphs`` / ``kind``: a training forward (training mode, gradients on) and a no-grad forward
    (``no_grad``, ``inference_mode``; training mode or not) on CUDA, inductor's (never a test backend's), unless
    ``CONCEPT_MODEL_CUDA_GRAPHS=0``; an evaluation-mode call with gradients (a user's forward outside
    ``torch.no_grad``, whose outputs the next call would overwrite) and a CPU's never. Negative controls: the switch
    off, and ``NO_GRAD_CUDA_GRAPHS`` off."""
    assert concept.compiled.training_cuda_graphs("cuda", {}) is True
    assert concept.compiled.training_cuda_graphs("cuda", {"CONCEPT_MODEL_CUDA_GRAPHS": "0"}) is False
    assert concept.compiled.training_cuda_graphs("cpu", {}) is False
    model = copy.deepcopy(mixed_model("null")).train()  # (a copy: the cached model is shared by other tests)
    whole = WholeForward(model)  # inductor (no backend)
    assert whole.kind("cuda") == "train graphs" and whole.kind("cpu") == "plain"
    for mode in (torch.no_grad, torch.inference_mode):
        for training in (True, False):
            model.train(training)
            with mode():
                assert whole.kind("cuda") == "no-grad graphs" and whole.kind("cpu") == "plain"
                monkeypatch.setattr(concept.compiled, "NO_GRAD_CUDA_GRAPHS", False)
                assert whole.kind("cuda") == "plain"
                monkeypatch.setattr(concept.compiled, "NO_GRAD_CUDA_GRAPHS", True)
    model.eval()
    assert whole.kind("cuda") == "plain"
    model.train()
    assert not WholeForward(model, backend="aot_eager").cuda_graphs("cuda")
    monkeypatch.setenv("CONCEPT_MODEL_CUDA_GRAPHS", "0")
    assert whole.kind("cuda") == "plain"
    with torch.no_grad():
        assert whole.kind("cuda") == "plain"


def test_the_kinds_compile_apart(monkeypatch):
    """Training graphs, no-grad graphs, plain: a compiled forward each, each its own code object (its graphs and
    recompile count); inductor's options differ only by ``triton.cudagraphs``."""
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.setdefault(fn.__func__.__code__.co_name, kwargs))
    whole = WholeForward(copy.deepcopy(mixed_model("null")))
    for kind in ("train graphs", "no-grad graphs", "plain"):
        whole.compile(kind)
    assert set(seen) == {"forward_whole", "forward_whole_graphs", "forward_whole_no_grad_graphs"}
    plain = seen.pop("forward_whole")["options"]
    assert plain["fallback_random"] is True and "triton.cudagraphs" not in plain
    for graphs in (o["options"] for o in seen.values()):
        assert graphs.pop("triton.cudagraphs") is True and graphs == plain


@pytest.mark.parametrize("choice,device,expected", [("model", "cuda", True), ("on", "cuda", True),
                                                    ("reduce-overhead", "cuda", True), ("default", "cuda", False),
                                                    ("model", "cpu", False), ("on", "cpu", False)])
def test_where_gradients_arrive_in_graph_memory(choice, device, expected):
    """``gradients_in_graph_memory``: the choices whose graphs are CUDA graphs on the device (the trainer then keeps
    ``.grad`` buffers of its own under gradient accumulation: ``tests/test_graph_memory.py``); a test backend's never."""
    model = copy.deepcopy(mixed_model("null"))  # (a copy: the cached model is shared by other tests)
    model.max_ratio = 0.25  # (a static budget: the streaming family compiles only with one)
    assert concept.compiled.gradients_in_graph_memory(compile_model(model, choice), device) is expected
    assert not concept.compiled.gradients_in_graph_memory(compile_model(model, choice, backend="aot_eager"), device)
    assert not concept.compiled.gradients_in_graph_memory(compile_model(model, "off"), device)
