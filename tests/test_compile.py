"""``--compile`` (``concept.compiled``): the stacks compile with ``fullgraph=True`` (a graph break would be an
error) and static shapes, and so does the training loss's per-chunk arithmetic (``concept.losses.chunk_terms``,
two graphs: a full chunk and the last, partial one); 20 training steps whose decisions and document packing
vary run on the graphs of the first (dynamo's recompile guard is armed after it: a recompile raises), with the
eager run's losses and decisions. The default suite captures with the ``aot-eager`` choice (dynamo + AOT autograd: the graphs
inductor would receive; inductor's C++ compilation of them takes minutes on a CPU); the inductor run is the
slow test. Negative control: a layout whose shapes follow the decisions recompiles, and the guard says so."""
import collections
import json
import pathlib
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import concept
import concept.losses as losses
from concept import BuildConfig, ComponentRef
from concept.contracts import Family
from concept.errors import ConceptError
from concept.training import TrainConfig, Trainer
from tests.conftest import mixed_model

STDLIB = pathlib.Path(warnings.__file__).parent
STEPS = 20
LOSS_ROWS = 16  # the loss's chunks in the training tests: 62 rows (2 x 31 next-token pairs) are 3 x 16 + 14
# the loss's graphs: a full chunk and the last one, for training (with gradients) and for the ratio controller's
# calibration forward (without)
LOSS_GRAPHS = {"chunk_terms_train": 2, "chunk_terms_eval": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compile")
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="1,1,1", vocabulary=ComponentRef("embedding", {"size": 32}),
                      attention=ComponentRef("chunked", {"chunk": 16}))  # the default budget: auto (0.25 here)
    concept.save(concept.build(cfg), folder / "built")
    return folder


def trainer(run, name, compile):
    config = TrainConfig(steps=STEPS, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100,
                         warmup=2, data=str(run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         compile=compile)
    return Trainer.start(run / "built", run / name, config)


def chunk_the_loss(monkeypatch, model) -> None:
    """The training CE in chunks of :data:`LOSS_ROWS` rows (a last partial chunk: both of the loss's shapes)."""
    monkeypatch.setattr(losses, "CHUNK_LOGITS", LOSS_ROWS * model.backbone.config.vocab_size)


def test_compiled_training_has_no_graph_break_no_recompile_and_equals_eager(run, fresh_dynamo, one_thread,
                                                                            monkeypatch):
    by_function = graphs_by_function(monkeypatch)
    eager = trainer(run, "eager", "off")
    compiled = trainer(run, "compiled", "aot-eager")
    chunk_the_loss(monkeypatch, compiled.model)
    rows = [(eager.train_step(), compiled.train_step())]
    graphs = counters["stats"]["unique_graphs"]
    # one graph per stack (shallow, middle, deep) for the training forward, and one for the ratio controller's
    # calibration forward of the first step (without gradients); the loss's four
    assert graphs == 10 and not counters["graph_break"]
    assert by_function == {**{f"run_layers_{s}": 2 for s in ("shallow", "middle", "deep")}, **LOSS_GRAPHS}
    torch._dynamo.config.error_on_recompile = True  # from now on a recompile raises
    rows += [(eager.train_step(), compiled.train_step()) for _ in range(STEPS - 1)]
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    equal_rows_then_the_dynamic_layout_recompiles(rows, compiled)


def equal_rows_then_the_dynamic_layout_recompiles(rows, compiled, match="[Rr]ecompil") -> None:
    """(eager row, compiled row) pairs of varied decisions equal; then the negative control: the same compiled
    trainer's model with the dynamic layout (its widths follow the decisions) recompiles, which ``match``es."""
    assert len({a["ratio"] for a, _ in rows}) > 3  # the decisions varied (and every batch packs other documents)
    for a, b in rows:
        assert a["ratio"] == b["ratio"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    compiled.model.max_ratio = 0.0
    with pytest.raises(Exception, match=match):
        for _ in range(3):
            compiled.train_step()


def test_compile_needs_a_static_budget():
    model = mixed_model("null")
    with pytest.raises(ConceptError, match="--max-ratio"):
        concept.compiled.compile_model(model, "on")
    assert model.compiled_stacks is None


class Fake(Family):
    """A third-party family: ``compile_refusal`` left to the base (a refusal naming it) or given."""

    name = "fake"

    def __init__(self, refusal=Family.compile_refusal):
        self.compile_refusal = refusal.__get__(self)


class FakeModel(torch.nn.Module):
    family = "fake"
    compiled_stacks = None


@pytest.mark.parametrize("refusal,error", [(Family.compile_refusal, "the fake family does not compile"),
                                           (lambda self, model: "fake needs X: do Y", "fake needs X: do Y"),
                                           (lambda self, model: None, None)],
                         ids=["not-implemented", "refused", "compiles"])
def test_a_family_says_whether_its_model_compiles(monkeypatch, refusal, error):
    """The core names no family: it asks the model's family (``Family.compile_refusal``)."""
    monkeypatch.setitem(concept.families._INSTANCES, "fake", Fake(refusal))
    model = FakeModel()
    if error is None:
        assert concept.compiled.compile_model(model, "layers").compiled_stacks.choice == "layers"
        return
    with pytest.raises(ConceptError, match=f"^--compile: {error}"):
        concept.compiled.compile_model(model, "on")
    assert model.compiled_stacks is None
    # a family that implements nothing is refused by name (the default) whatever its model has
    assert "fake" in Family.compile_refusal(Fake(), model)


@pytest.fixture(scope="module")
def layered(run):
    """The compile test's model with two layers per stack: each stack's layer graph serves both."""
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 6, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="2,2,2", vocabulary=ComponentRef("embedding", {"size": 32}),
                      attention=ComponentRef("chunked", {"chunk": 16}))
    concept.save(concept.build(cfg), run / "layered")
    return run


def captured(monkeypatch):
    """``torch.compile`` as ``concept.compiled`` calls it, but captured by ``aot-eager`` (its mode dropped):
    inductor's C++ compilation of the layers' graphs takes minutes on this CPU (the slow test runs it)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, fullgraph, dynamic, mode=None, backend=None: real(
        fn, fullgraph=fullgraph, dynamic=dynamic, backend="aot_eager"))


def test_layers_training_shares_one_graph_per_stack_without_break_or_recompile(layered, fresh_dynamo, one_thread,
                                                                             monkeypatch):
    """``--compile layers``: one graph per stack (for its two layers); 20 varied steps equal eager with no
    recompile. Negative control: the dynamic layout recompiles."""
    by_function = graphs_by_function(monkeypatch)  # (first: ``captured`` then wraps its counting)
    captured(monkeypatch)
    layered_trainer = lambda name, choice: Trainer.start(layered / "layered", layered / name, TrainConfig(  # noqa: E731
        steps=STEPS, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100, warmup=2,
        data=str(layered / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2), compile=choice))
    eager, compiled = layered_trainer("l-eager", "off"), layered_trainer("l-compiled", "layers")
    chunk_the_loss(monkeypatch, compiled.model)
    rows = [(eager.train_step(), compiled.train_step())]
    # one graph per stack for the ratio controller's no-grad calibration forward and one per stack for the training
    # forward, each shared by the stack's two layers (a graph per layer: 12), but for the shallow stack's first layer
    # in training: its input (the frozen embeddings) needs no gradient, the second layer's does (a guard of dynamo's);
    # and the loss's four
    assert counters["stats"]["unique_graphs"] == 11 and not counters["graph_break"]
    assert by_function == {"run_layer_rope_shallow": 3, "run_layer_rope_middle": 2, "run_layer_rope_deep": 2, **LOSS_GRAPHS}
    assert {key[2] for key in compiled.model.compiled_stacks.compiled} == {True}  # (regional: per layer)
    torch._dynamo.config.error_on_recompile = True
    rows += [(eager.train_step(), compiled.train_step()) for _ in range(STEPS - 1)]
    assert counters["stats"]["unique_graphs"] == 11 and not counters["graph_break"]
    equal_rows_then_the_dynamic_layout_recompiles(rows, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["default", "layers", "model"], ids=["stacks", "layers", "model"])
def test_inductor_forward_equals_eager(fresh_dynamo, choice):
    """torch's default mode (inductor's generated C++ on a CPU): minutes of compilation for a tiny model."""
    import copy

    model = copy.deepcopy(mixed_model("null"))
    model.max_ratio = 0.25
    compiled = concept.compiled.compile_model(copy.deepcopy(model), choice)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 97, (2, 16), generator=g)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


def graphs_by_function(monkeypatch) -> collections.Counter:
    """The graphs dynamo compiles, counted by the compiled function's name (``run_layers_shallow``...,
    ``step_eager``): ``torch.compile``'s backend wrapped in one that counts, its choice (``aot_eager``) kept;
    one wrapper per name and backend (dynamo recompiles a function for a backend it did not compile it with)."""
    real, seen, backends = torch.compile, collections.Counter(), {}

    def counting_backend(name, backend):
        inner = torch._dynamo.lookup_backend(backend)

        def count(gm, example_inputs):
            seen[name] += 1
            return inner(gm, example_inputs)
        return count

    def counting(fn, backend="inductor", **options):
        key = (fn.__name__, backend)
        backends.setdefault(key, counting_backend(*key))
        return real(fn, backend=backends[key], **options)
    monkeypatch.setattr(torch, "compile", counting)
    return seen


def generates_as_eager_on_four_graphs(model, compiled, graphs, cases) -> None:
    """Each ``(prompts, new_tokens)`` of ``cases`` (the same prompt and cache buckets) generated by ``compiled`` as
    by ``model`` (tokens, decisions, logits) on four graphs (``graphs``: :func:`graphs_by_function`'s), with no
    graph break; from the second case on, a recompile raises."""
    for prompts, new_tokens in cases:
        eager, fast = (m.generate(prompts, max_new_tokens=new_tokens, output_logits=True) for m in (model, compiled))
        assert fast.tokens == eager.tokens and fast.keep == eager.keep
        torch.testing.assert_close(fast.logits, eager.logits, atol=1e-5, rtol=1e-5)
        # 4 graphs: one per stack for the prefill (a cache recording compiles the stack whole) and the decoding
        # step's, compiled whole over static KV caches since 4d44d93 (2026-11-26 23:14, "Compiled decoding over
        # static KV caches"; the prefill test, from f639a40 at 18:19, counted 3 when the steps still ran eagerly)
        assert graphs == {"run_layers_shallow": 1, "run_layers_middle": 1, "run_layers_deep": 1, "step_eager": 1}
        assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"]
        torch._dynamo.config.error_on_recompile = True  # the next generation: a recompile raises


@pytest.mark.slow
def test_compiled_prefill_generates_what_eager_does(fresh_dynamo, monkeypatch):
    """The decoder's prefill runs the compiled stacks (its cache recording), prompts left-padded to a bucket;
    its steps run the compiled static step (``concept.static_decoding``). Other prompt widths and token budgets
    in the same buckets reuse the graphs. Negative control: without the bucket, another width recompiles."""
    import copy

    model = copy.deepcopy(mixed_model("null"))
    model.max_ratio = 0.25
    graphs = graphs_by_function(monkeypatch)
    compiled = concept.compiled.compile_model(copy.deepcopy(model), "aot-eager")
    generates_as_eager_on_four_graphs(model, compiled, graphs, (([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]], 6),
                                                                ([[5, 4, 3, 2, 1], list(range(9, 21))], 9)))

    # negative control: prompts not padded to the bucket, another width (3, not 64) recompiles the stacks
    monkeypatch.setattr("concept.streaming.decoding.PREFILL_BUCKET", 1)
    with pytest.raises(Exception, match="Recompiling function run_layers_shallow"):
        compiled.generate([[1, 2, 3], [4, 5]], max_new_tokens=6)
