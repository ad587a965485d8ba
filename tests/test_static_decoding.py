"""Compiled decoding over static KV caches (``concept.static_decoding``, docs/decoding.md "Compiled decoding").

The static step (every cache preallocated, every change in place at tensor indices) gives the eager decoder's
tokens, decisions and logits and the teacher-forced forward's logits, in float64 at 1e-10 (negative control: a
cache write one slot off). Compiled with ``fullgraph=True`` (``aot-eager`` here: the graph inductor would get)
it is one graph for 20 steps whose decisions vary and whose rows stop at different steps, with no graph break,
no recompile (dynamo's guard armed after the first step) and no host sync, and equals the eager step exactly;
the dense baseline's static decoder likewise, against transformers' DynamicCache."""
import copy
import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import concept
import concept.generation
from concept import BuildConfig, ComponentRef
from concept.dense import DenseModel
from concept.generation import left_pad
from concept.static_decoding import StaticDenseDecoder, StaticSlotCache
from concept.streaming.static_decoding import StaticConceptDecoder
from concept.syncs import HostSyncs
from concept.streaming import gap
from tests.conftest import POLICIES, assert_decoding_matches_teacher_forcing, mix_decisions, randomize_new_modules

PROMPTS = [[5, 17, 3, 44, 8, 21, 9, 60], [9, 10, 11], [70]]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add contention


@functools.lru_cache(maxsize=None)
def three_layers(policy="null", max_ratio=0.5):
    """A tiny streaming model (three layers, split 1,1,1) with a static budget, about 30% of tokens emitting
    (``null-auto``: the `null` policy with its default ``max_run``, derived from the target ratio)."""
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64, "vocab": 97}),
                      split="1,1,1", vocabulary=ComponentRef("embedding", {"size": 32}),
                      length_policy=ComponentRef(*POLICIES.get(policy, ("null", {}))), max_ratio=max_ratio)
    return mix_decisions(randomize_new_modules(concept.build(cfg))).eval()


@pytest.fixture
def static_decoding(monkeypatch):
    """``generate`` decodes with the static step run eagerly (the compiled one is the same Python, traced)."""
    def use(model):
        def pick(model_, s, budget):
            if isinstance(model_, DenseModel):
                return StaticDenseDecoder(model_, budget, None)
            return StaticConceptDecoder(model_, budget, None)
        monkeypatch.setattr(concept.generation, "_decoder", pick)
    return use


@pytest.mark.parametrize("policy,max_ratio", [("null", 0.5), ("null", "auto"),
                                              pytest.param("fixed-emit2", 0.5, marks=pytest.mark.slow)])
def test_static_step_equals_eager_decoding_and_teacher_forcing_in_fp64(policy, max_ratio, static_decoding, monkeypatch):
    """(two concept slots per boundary, ``fixed-emit2``: the deep stack's earlier slot runs every step too;
    ``auto``: the default budget, whose slack lets a row's first tokens emit beyond ``ceil(max_ratio * n)``)"""
    model = copy.deepcopy(three_layers(policy, max_ratio)).double().eval()
    if max_ratio == "auto":  # a low target: the budget (0.1 per token plus the slack of 4) binds in these rows
        gap.set_target(model.length_policy, 0.05)
        assert model.budget_slack > 0
    eager = model.generate(PROMPTS, max_new_tokens=12, output_logits=True)
    static_decoding(model)
    gen = assert_decoding_matches_teacher_forcing(model, PROMPTS, 12, atol=1e-10)
    assert gen.tokens == eager.tokens and gen.keep == eager.keep and gen.steps == eager.steps
    assert torch.equal(gen.sequences, eager.sequences)
    torch.testing.assert_close(gen.logits, eager.logits, atol=1e-10, rtol=1e-10)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "allocated_bytes"} for r in rows]  # noqa: E731
    assert drop(gen.kv) == drop(eager.kv)
    decisions = [k for row in gen.keep for k in row]
    assert 0 < sum(decisions) < len(decisions)

    # negative control: each new entry written one slot past the row's free slot
    update = StaticSlotCache.update

    def one_off(self, key, value, layer_idx, *args, **kwargs):
        self.slot.add_(1)
        try:
            return update(self, key, value, layer_idx)
        finally:
            self.slot.sub_(1)
    monkeypatch.setattr(StaticSlotCache, "update", one_off)
    with pytest.raises(AssertionError):
        assert_decoding_matches_teacher_forcing(model, PROMPTS, 12, atol=1e-10)


def test_device_loop_stops_rows_as_the_eager_loop_does(static_decoding):
    """The compiled path's host loop (tokens read back every 16 steps, EOS on the device; every step with stop
    strings or a streamer): EOS mid-block, a stop string, a streamer, sampling; the eager loop's outputs."""
    class Letters:  # id -> one letter
        eos_token_id = pad_token_id = None

        def decode(self, ids, **_):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    class Collect(list):
        def put(self, ids):
            self.append(ids.tolist())

        def end(self):
            pass

    model = three_layers()
    free = model.generate(PROMPTS, max_new_tokens=24)
    eos = free.tokens[1][5]
    text = Letters().decode(free.tokens[0])
    runs = [dict(eos_token_id=eos), dict(stop_strings=[text[6:8]], tokenizer=Letters()),
            dict(do_sample=True, seed=3, top_k=5, eos_token_id=eos, streamer=Collect())]
    eager = [model.generate(PROMPTS, max_new_tokens=24, output_logits=True, **kw) for kw in runs]
    streamed = runs[2]["streamer"][:]
    runs[2]["streamer"].clear()
    static_decoding(model)
    for kw, want in zip(runs, eager):
        got = model.generate(PROMPTS, max_new_tokens=24, output_logits=True, **kw)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons and got.texts == want.texts
        assert torch.equal(got.sequences, want.sequences) and got.keep == want.keep
        for b, row in enumerate(want.tokens):  # (a finished row's later logits are not the row's: not compared)
            torch.testing.assert_close(got.logits[b, :len(row)], want.logits[b, :len(row)], atol=1e-5, rtol=1e-5)
    assert runs[2]["streamer"] == streamed
    assert "eos" in eager[0].finish_reasons and len({len(t) for t in eager[0].tokens}) > 1  # rows stop apart
    assert eager[1].finish_reasons[0] == "stop"


@pytest.mark.parametrize("removed", [None, (1, 2)], ids=["dense", "pruned"])
def test_static_dense_decoder_equals_transformers_dynamic_cache(static_decoding, removed):
    """The dense baseline, and the pruned one (its static decoder runs inside ``DenseModel.generate``'s
    ``pruned_backbone``, where ``layers`` must not skip the block a second time: it ran one layer of three)."""
    dense = copy.deepcopy(DenseModel(three_layers().backbone, removed=removed)).double().eval()
    eager = dense.generate(PROMPTS, max_new_tokens=12, output_logits=True)
    static_decoding(dense)
    gen = dense.generate(PROMPTS, max_new_tokens=12, output_logits=True)
    assert gen.tokens == eager.tokens
    torch.testing.assert_close(gen.logits, eager.logits, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["streaming", pytest.param("dense", marks=pytest.mark.slow)])
def test_compiled_step_is_one_graph_without_break_recompile_or_host_sync(family, fresh_dynamo):
    model = three_layers("null-auto")
    ids, valid = left_pad(PROMPTS, 0)
    if family == "streaming":
        eager, compiled = (StaticConceptDecoder(model, 20, c) for c in (None, "aot-eager"))
    else:
        dense = DenseModel(model.backbone).eval()
        eager, compiled = (StaticDenseDecoder(dense, 20, c) for c in (None, "aot-eager"))
    with torch.no_grad():
        logits, _ = eager.prefill(ids, valid), compiled.prefill(ids, valid)
        for i in range(20):
            token = logits.argmax(-1)
            active = torch.tensor([True, i < 12, i < 6])  # rows stop at different steps
            with HostSyncs() as seen:
                logits = eager.step(token, active)
            assert seen.hidden == 0 and seen.ops > 100
            assert torch.equal(compiled.step(token, active), logits)
            if i == 0:  # one graph; from now on a recompile raises
                assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
                torch._dynamo.config.error_on_recompile = True
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert compiled.kv_stats() == eager.kv_stats() and compiled.keep == eager.keep
    if family == "streaming":  # the concept decisions of the 20 steps varied
        steps = [k for row, p in zip(eager.keep, PROMPTS) for k in row[len(p):]]
        assert len(steps) == 20 + 12 + 6 and 0 < sum(steps) < len(steps)


@pytest.mark.slow
def test_generate_compile_decodes_what_eager_does(fresh_dynamo, monkeypatch):
    """``generate`` on a model loaded with ``compile=``: compiled prefill and step, the eager model's tokens, in
    four graphs (the prefill's, one per stack, and the step's) without a graph break; a second generation of
    other prompt lengths and budgets in the same buckets compiles nothing (dynamo's recompile guard armed).
    Negative control: caches sized to the exact length (no capacity bucket) recompile the step for another
    budget, and the guard says so."""
    from tests.test_compile import generates_as_eager_on_four_graphs, graphs_by_function

    model = three_layers()
    graphs = graphs_by_function(monkeypatch)
    compiled = concept.compiled.compile_model(copy.deepcopy(model), "aot-eager")
    generates_as_eager_on_four_graphs(model, compiled, graphs, (
        (PROMPTS, 40), ([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [4, 6]], 30)))

    # negative control: a cache of exactly the slots asked for (another budget: other shapes) recompiles the step
    monkeypatch.setattr("concept.streaming.static_decoding.capacity", lambda entries: entries + 1)
    with pytest.raises(Exception, match="Recompiling function step_eager"):
        compiled.generate(PROMPTS, max_new_tokens=20)


@pytest.mark.slow
def test_cli_generate_compile_gives_the_eager_text(tmp_path, fresh_dynamo):
    """``concept generate --compile aot-eager`` on a static build: the eager command's tokens and text."""
    import json

    from tests.test_cli_train import TINY, run

    assert run("build", *TINY, "--max-ratio", "0.5", "-o", tmp_path / "m").exit_code == 0
    rows = []
    for extra in ([], ["--compile", "aot-eager"]):
        r = run("generate", tmp_path / "m", "--prompt", "def f(x):", "--prompt", "import os", "--max-new-tokens", 20,
                "--json", *extra)
        assert r.exit_code == 0, r.output
        rows.append([{k: row[k] for k in ("tokens", "text", "concept_positions", "finish_reason")}
                     for row in map(json.loads, r.stdout.splitlines())])
    assert rows[0] == rows[1] and not counters["graph_break"]
