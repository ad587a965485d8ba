"""``--compile`` under the memory rules of CUDA graphs, on a CPU (``concept.compiled``: what is copied and why).

CUDA graphs (``reduce-overhead`` on CUDA) return their outputs in a pool that later compiled calls reuse, and
torch's cudagraph trees start a new *generation* of that memory at every call of a compiled function unless a
backward is pending (``torch/_inductor/cudagraph_trees.py``: ``can_start_new_generation``,
``dealloc_current_path_weakrefs``). CUDA graphs cannot run here, so :class:`GraphMemory` emulates the rule:
each compiled stack (any of them) runs eagerly, and when a call starts a new generation every output of the
earlier calls (the stack's output and the keys / values a prefill's cache recorded) is overwritten with NaN,
as if the next graph had written its own values there; whatever still reads one shows it. The
stacks are the model's own ``CompiledStacks`` with only their ``compile`` replaced, so the copies they make
where the graphs are CUDA graphs are the code under test. With the copies, a no-grad forward, the prefill and
three training steps (the first with the ratio controller's calibration forward, which crashed on the H100 on
2026-11-27) equal eager; without them (today's code: negative controls) they do not.
"""
import copy
import dataclasses
import json
import pathlib
import warnings

import pytest
import torch

import concept
import concept.compiled
from concept import BuildConfig, ComponentRef
from concept.backbone import run_layer_rope, run_layers
from concept.compiled import CompiledStacks, WholeForward, compile_model
from concept.dense import DenseModel
from concept.errors import TrainingError
from concept.losses import chunk_terms
from concept.streaming.decoding import ConceptDecoder
from concept.training import TrainConfig, Trainer

STDLIB = pathlib.Path(warnings.__file__).parent
pytestmark = pytest.mark.usefixtures("one_thread")


OVERWRITTEN = "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"  # (torch's words)
METADATA = {"size", "dim", "stride", "numel", "is_contiguous", "register_hook", "untyped_storage", "data_ptr"}


class GraphOutput(torch.Tensor):
    """An output of a compiled call, in graph memory (an alias of it): reading its values once its memory
    was reused raises, as cudagraph trees make it do (its shape and other metadata stay readable); what an op
    computes from it is a plain tensor."""

    overwritten = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in ("__get__", *METADATA):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, GraphOutput) and t.overwritten:
                    raise RuntimeError(f"Error: {OVERWRITTEN} ({func.__name__}; emulated on a CPU)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class GraphMemory:
    """Compiled calls whose outputs live in graph memory, reused when a call starts a new generation: every
    call does unless an earlier call with gradients still waits for its backward (cudagraph trees' pending
    backward). The reused outputs are then overwritten (NaN, for aliases made before) and reading them raises."""

    def __init__(self):
        self.outputs: list[GraphOutput] = []  # the current generation's
        self.pending_backward = False
        self.overwritten = 0  # outputs overwritten so far

    def install(self, monkeypatch, copies: bool = True) -> None:
        """Every ``CompiledStacks`` runs its stacks here, in graph memory (``copies`` False: as if they were
        not CUDA graphs, so nothing is copied out: the code before the fix)."""
        monkeypatch.setattr(CompiledStacks, "compile", lambda stacks, name, device_type, regional=False: (
            self.run_layer if regional else self.run, copies))
        # the loss's chunk arithmetic is never in graph memory (``loss_terms``: no CUDA graphs): eager here, as the
        # stacks are, not inductor's C++ (tests/test_compiled_loss.py checks it compiled)
        monkeypatch.setattr(CompiledStacks, "loss_terms", lambda stacks, device_type: chunk_terms)

    def run(self, layers, x, position_ids, attention_plan, rotary_emb, checkpointing=False, cache=None):
        return self.call(run_layers, layers, x, position_ids, attention_plan, rotary_emb, checkpointing, cache)

    def run_layer(self, layer, x, position_ids, attention_plan, rotary_emb, checkpointing=False, cache=None):
        """``--compile layers``: one compiled call per layer (its input the previous layer's output; its RoPE
        table built inside it)."""
        return self.call(run_layer_rope, layer, x, position_ids, attention_plan, rotary_emb, checkpointing, cache)

    def new_generation_unless_pending(self) -> None:
        """A call starts a new generation unless a backward is pending: the earlier outputs' memory is reused."""
        if not self.pending_backward:
            for t in self.outputs:
                self.overwrite(t)
            self.overwritten += len(self.outputs)
            self.outputs = []

    @staticmethod
    def overwrite(t: GraphOutput) -> None:
        t.data.fill_(float("nan"))
        t.overwritten = True

    def call(self, fn, layers, x, position_ids, attention_plan, rotary_emb, checkpointing, cache):
        self.new_generation_unless_pending()
        out = fn(layers, x, position_ids, attention_plan, rotary_emb, checkpointing, cache)
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # (its own memory)
        if out.requires_grad:
            self.pending_backward = True
            out.register_hook(self.backward_ran)
        if cache is not None:  # the keys and values a prefill recorded
            for store in (cache.k, cache.v):
                for layer, t in store.items():
                    store[layer] = self.hand_out(t)
        return self.hand_out(out)

    def hand_out(self, t: torch.Tensor) -> GraphOutput:
        alias = t.as_subclass(GraphOutput)
        self.outputs.append(alias)
        return alias

    def backward_ran(self, grad) -> None:
        self.pending_backward = False


def streaming_model(per_stack: int = 1):
    """The default streaming build (its budget ``auto``), on a tiny backbone of ``per_stack`` layers a stack, with ~30%
    of tokens concepts."""
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3 * per_stack, "hidden": 32, "heads": 2,
                                                          "kv_heads": 1, "intermediate": 64, "vocab": 256}),
                      split=",".join([str(per_stack)] * 3), vocabulary=ComponentRef("embedding", {"size": 32}))
    model = concept.build(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.new_state_dict().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batch(seed=0, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (B, T), generator=g)


def compiled_in_graph_memory(model, memory, monkeypatch, copies=True, choice="reduce-overhead"):
    memory.install(monkeypatch, copies)
    return compile_model(copy.deepcopy(model), choice)


def streaming_forward(model, ids):
    out = model(ids, attention_mask=torch.ones_like(ids))
    return out.logits, out.shallow, out.hidden


@pytest.fixture(scope="module")
def streaming():
    return streaming_model()


@pytest.mark.parametrize("choice", ["reduce-overhead", "layers"], ids=["stacks", "layers"])
def test_streaming_no_grad_forward_equals_eager(streaming, monkeypatch, choice):
    """(``layers``: each layer's call a generation of its own, its input the previous layer's copied output.)"""
    memory = GraphMemory()
    ids = batch()
    with torch.no_grad():
        eager = [streaming_forward(streaming, batch(seed)) for seed in (0, 1)]
        assert 0 < int(streaming(ids).keep.sum()) < ids.numel()  # concepts and tail tokens both
        compiled = compiled_in_graph_memory(streaming, memory, monkeypatch, choice=choice)
        fast = [streaming_forward(compiled, batch(seed)) for seed in (0, 1)]  # the first kept past the second
    assert memory.overwritten > 0
    for a, b in zip(eager, fast):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("choice", ["reduce-overhead", "layers"], ids=["stacks", "layers"])
def test_streaming_forward_without_the_copies_reads_overwritten_memory(streaming, monkeypatch, choice):
    """Negative control: the stacks' outputs used as they come (before the fix): the deep stack's tail reads
    the shallow states the middle stack's run overwrote (the error of the H100, 2026-11-27); ``layers``: the
    next layer reads its input overwritten by its own call."""
    compiled = compiled_in_graph_memory(streaming, GraphMemory(), monkeypatch, copies=False, choice=choice)
    with torch.no_grad(), pytest.raises(RuntimeError, match=OVERWRITTEN):
        compiled(batch())


@pytest.mark.parametrize("removed", [None, (1, 2)], ids=["dense", "pruned"])
def test_baseline_outputs_kept_past_the_next_call_equal_eager(streaming, monkeypatch, removed):
    """The dense / pruned baselines run one stack: their output (``hidden``) is what outlives the call."""
    base = DenseModel(streaming.backbone, removed=removed).eval()
    with torch.no_grad():
        eager = [base(batch(seed)) for seed in (0, 1)]
        compiled = compiled_in_graph_memory(base, GraphMemory(), monkeypatch)
        fast = [compiled(batch(seed)) for seed in (0, 1)]
        for a, b in zip(eager, fast):
            torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=1e-5)
        # negative control: without the copy the first output's memory went to the second call
        compiled = compiled_in_graph_memory(base, GraphMemory(), monkeypatch, copies=False)
        first, _ = compiled(batch(0)), compiled(batch(1))
        with pytest.raises(RuntimeError, match=OVERWRITTEN):
            first.hidden + 0


def prefill_then_steps(model, prompts_ids, valid, steps=4):
    """The decoder's prefill (the compiled stacks record the caches when compiled), then eager steps that
    read those caches: the logits of each."""
    decoder = ConceptDecoder(model)
    logits = [decoder.prefill(prompts_ids, valid)]
    for t in range(steps):
        logits.append(decoder.step(batch(10 + t, B=prompts_ids.shape[0], T=1)[:, 0]))
    return torch.stack(logits)


def test_compiled_prefill_equals_eager_and_needs_its_recorded_keys_copied(streaming, monkeypatch):
    ids = batch(2, T=11)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    with torch.no_grad():
        eager = prefill_then_steps(streaming, ids, valid)
        compiled = compiled_in_graph_memory(streaming, GraphMemory(), monkeypatch)
        torch.testing.assert_close(prefill_then_steps(compiled, ids, valid), eager, atol=1e-5, rtol=1e-5)
        # negative control: the stack outputs copied, the recorded keys and values not
        monkeypatch.setattr("concept.compiled.copy_recorded", lambda cache: None)
        compiled = compiled_in_graph_memory(streaming, GraphMemory(), monkeypatch)
        with pytest.raises(RuntimeError, match=OVERWRITTEN):
            prefill_then_steps(compiled, ids, valid)


# -- training ---------------------------------------------------------------------------------------
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graph_memory")
    docs = [c for name in ("textwrap.py", "shlex.py") for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    concept.save(streaming_model(), folder / "built")
    return folder


def trainer(run, name, compile, **extra):
    config = TrainConfig(steps=STEPS, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=1,
                         warmup=1, data=str(run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         compile=compile, **extra)
    return Trainer.start(run / "built", run / name, config)


def rows(trainer) -> list[dict]:
    return [trainer.train_step() for _ in range(STEPS)]


@pytest.mark.parametrize("baseline,choice", [(None, "reduce-overhead"), ("dense", "reduce-overhead"), (None, "layers")],
                         ids=["streaming", "dense", "streaming-layers"])
def test_training_steps_equal_eager(run, monkeypatch, baseline, choice):
    """Three steps (LoRA in every stack: gradients through the copies); the streaming run's first step
    calibrates the NULL bias with a no-grad forward (the crash of 2026-11-27); log_every=1: the step
    diagnostics read the step's output after its backward."""
    name = baseline or "streaming"
    eager = rows(trainer(run, f"{name}-eager-{choice}", "off", baseline=baseline))
    memory = GraphMemory()
    memory.install(monkeypatch)
    fast = rows(trainer(run, f"{name}-graphs-{choice}", choice, baseline=baseline))
    assert memory.overwritten > 0
    for a, b in zip(eager, fast):
        assert a.get("ratio") == b.get("ratio") and a.get("null_bias") == pytest.approx(b.get("null_bias"))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_training_without_the_copies_reads_overwritten_memory(run, monkeypatch):
    """Negative control: the first step's calibration forward (no gradients) reads the shallow states the
    middle stack's run overwrote, as on the H100 (2026-11-27)."""
    GraphMemory().install(monkeypatch, copies=False)
    compiled = trainer(run, "without-copies", "reduce-overhead")
    with pytest.raises(RuntimeError, match=OVERWRITTEN) as caught:
        compiled.train_step()
    assert "before_step" in {entry.name for entry in caught.traceback}  # (the calibration forward)


# -- ``model``: the whole training forward one CUDA graph, its backward another; a no-grad forward one more -------
# A training forward under ``--compile model`` on CUDA runs as CUDA graphs (``WholeForward.cuda_graphs``): its outputs
# live in graph memory until the next compiled call that starts a new generation, and so do the gradients its backward
# hands over: a weight whose ``.grad`` is None takes the backward's output itself (autograd's AccumulateGrad steals
# it). A no-grad forward runs as CUDA graphs too, and its outputs are copied out of graph memory as it returns
# (``concept.compiled.copied_out``): what it returns is its own.


def graph_tensors(obj, seen=None):
    """The tensors a compiled call returned inside ``obj`` (a model output: its fields, a deferred field's closure,
    the layout's): every tensor reachable through attributes, containers and closures, no module's."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, str, bytes, int, float, bool)) or obj is None:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif callable(obj) and getattr(obj, "__closure__", None):
        children = [c.cell_contents for c in obj.__closure__ if c.cell_contents is not None]
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [t for child in children for t in graph_tensors(child, seen)]


class WholeGraphs(GraphMemory):
    """``--compile model``'s training forward in graph memory, on a CPU: the whole forward runs eagerly (its stacks
    too), and a call starts a new generation unless the previous one's backward is pending (:class:`GraphMemory`'s
    rule), overwriting what the previous generation handed out: the forward's outputs (not an input, a weight or a
    buffer it returned as they are) and the gradients its backward handed to weights whose ``.grad`` was None at the
    call."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.hooked: set[int] = set()
        self.stolen: set[int] = set()  # ids of the weights whose .grad was None at the current generation's call

    def install(self, monkeypatch, copy_out: bool = True, own_grads: bool = True) -> None:
        """The whole forward's own choice of which calls run as CUDA graphs (``WholeForward.cuda_graphs`` on CUDA,
        inductor's), those calls in graph memory here. ``copy_out`` False: a no-grad call's outputs not copied out
        (negative control); ``own_grads`` False: the trainer told its gradients are not in graph memory (negative
        control: no ``.grad`` buffers of its own)."""
        monkeypatch.setattr(concept.compiled, "training_cuda_graphs", lambda device_type, environ=None: True)
        monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", None)  # (inductor's choice; compiled here by nothing)
        if not copy_out:
            monkeypatch.setattr(concept.compiled, "copied_out", lambda out: out)
        monkeypatch.setattr(WholeForward, "compile", lambda whole, kind: self.whole(whole.eager)
                            if kind != "plain" else whole.eager)
        monkeypatch.setattr(CompiledStacks, "compile", lambda stacks, name, device_type, regional=False: (
            run_layer_rope if regional else run_layers, False))  # (the whole forward's stacks: eager here)
        monkeypatch.setattr(CompiledStacks, "loss_terms", lambda stacks, device_type: chunk_terms)
        monkeypatch.setattr("concept.train_step.gradients_in_graph_memory", lambda model, device_type: own_grads)

    def whole(self, forward):
        model = forward.__self__

        def call(*args, **kwargs):
            self.new_generation_unless_pending()
            self.calls += 1
            weights = [p for p in model.parameters() if p.requires_grad]
            self.stolen = {id(p) for p in weights if p.grad is None}
            for p in weights:
                if id(p) not in self.hooked:
                    self.hooked.add(id(p))
                    p.register_post_accumulate_grad_hook(self.took_gradient)
            out = forward(*args, **kwargs)
            own = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values(), *model.parameters(),
                                                            *model.buffers()) if isinstance(t, torch.Tensor)}
            self.outputs += [t for t in graph_tensors(out) if t.untyped_storage().data_ptr() not in own]
            if out.loss is not None and out.loss.requires_grad:
                self.pending_backward = True
                out.loss.register_hook(self.backward_ran)
            return out

        return call

    @staticmethod
    def overwrite(t: torch.Tensor) -> None:
        """What the next graph writes into ``t``'s memory, as seen by a reader: NaN, -1 or the flipped mask."""
        with torch.no_grad():
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.fill_(-1)

    def took_gradient(self, p) -> None:
        if id(p) in self.stolen:  # its .grad is the backward's output itself, in graph memory
            self.stolen.discard(id(p))
            self.outputs.append(p.grad)


@pytest.mark.parametrize("baseline,grad_accum", [(None, 1), (None, 2), ("dense", 2)],
                         ids=["streaming", "streaming-accumulated", "dense-accumulated"])
def test_whole_forward_training_in_graph_memory_equals_eager(run, monkeypatch, baseline, grad_accum):
    """Three steps; the streaming run's first step calibrates the NULL bias with a no-grad forward (CUDA graphs too, its
    outputs copied out, then overwritten by the training forward's generation); log_every=1: the diagnostics read the step's output after its backward. Accumulated: the
    second micro-batch's forward reuses the first's memory, gradients included, so the weights keep ``.grad``
    buffers of their own (``StepRunner.own_grads``)."""
    name = f"{baseline or 'streaming'}-{grad_accum}"
    eager = rows(trainer(run, f"{name}-eager-model", "off", baseline=baseline, grad_accum=grad_accum))
    memory = WholeGraphs()
    memory.install(monkeypatch)
    fast = trainer(run, f"{name}-graphs-model", "model", baseline=baseline, grad_accum=grad_accum)
    assert fast.runner.own_grads == (grad_accum > 1)
    fast = rows(fast)
    calibration = 0 if baseline else 1
    assert memory.calls == STEPS * grad_accum + calibration and memory.overwritten > 0
    for a, b in zip(eager, fast):
        assert a.get("ratio") == b.get("ratio") and a.get("null_bias") == pytest.approx(b.get("null_bias"))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_accumulated_gradients_without_buffers_of_their_own_are_overwritten(run, monkeypatch):
    """Negative control: with the weights taking the first micro-batch's gradients from graph memory, the second
    micro-batch's forward overwrites them (on CUDA torch raises "accessing gradient tensor output of CUDAGraphs that
    has been overwritten"; here they read NaN): the step's gradients are not finite, and it is skipped."""
    WholeGraphs().install(monkeypatch, own_grads=False)
    fast = trainer(run, "accumulated-without-buffers", "model", grad_accum=2)
    assert not fast.runner.own_grads
    with pytest.raises(TrainingError, match="the gradients became nan at step 1"):
        fast.train_step()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_forwards_keep_their_outputs(streaming, monkeypatch, mode):
    """No-grad calls (evaluation, calibration, benchmarks, a user's ``inference_mode``) run as CUDA graphs, their
    outputs copied out: two forwards' outputs, the first read after the second, equal eager, deferred fields (the
    logits, the deep input in time order) included, and none of them in the graphs' memory. Negative control: not
    copied out, the first forward's outputs are overwritten by the second's call."""
    with getattr(torch, mode)():
        eager = [streaming_forward(streaming, batch(seed)) for seed in (0, 1)]
        eager_inputs = [streaming(batch(seed)).deep_input for seed in (0, 1)]
        memory = WholeGraphs()
        memory.install(monkeypatch)
        compiled = compile_model(copy.deepcopy(streaming), "model")
        kept = [compiled(batch(seed), attention_mask=torch.ones_like(batch(seed))) for seed in (0, 1)]
        assert memory.calls == 2 and memory.overwritten > 0  # (the first call's graph outputs, copied before)
        for a, deep_input, out in zip(eager, eager_inputs, kept):
            for x, y in zip((*a, deep_input), (out.logits, out.shallow, out.hidden, out.deep_input)):
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
            assert not any(isinstance(t, GraphOutput) for t in graph_tensors(out))
        memory = WholeGraphs()
        memory.install(monkeypatch, copy_out=False)
        compiled = compile_model(copy.deepcopy(streaming), "model")
        first, _ = [compiled(batch(seed), attention_mask=torch.ones_like(batch(seed))) for seed in (0, 1)]
        assert memory.calls == 2 and torch.isnan(first.shallow).all()


def test_copied_out_copies_every_tensor_once():
    """``copied_out``: every tensor of an output (dataclass fields, a layout's metadata, containers, a deferred field's
    inputs) a copy of its own, equal in value; a tensor reached twice copied once (the same tensor object stays one);
    a module and numbers kept. (The mutation "a no-grad graph's outputs returned as they are" is caught here and by
    ``test_no_grad_forwards_keep_their_outputs``.)"""
    from concept.compiled import copied_out
    from concept.lazy import Deferred, LazyField

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor = LazyField()
        hidden: torch.Tensor | None = None
        extra: tuple = ()
        head: torch.nn.Module | None = None
        count: int = 0

    head = torch.nn.Linear(3, 5)
    hidden = torch.randn(2, 3)
    out = Out(Deferred(head, hidden, watch=head), hidden, (hidden[:1], {"k": torch.ones(2)}), head, 7)
    copied = copied_out(out)
    assert copied.head is head and copied.count == 7 and LazyField.computed(copied, "logits") is False
    weights = {p.untyped_storage().data_ptr() for p in head.parameters()}  # (the deferred head's, watched: kept)
    ours = {t.untyped_storage().data_ptr() for t in graph_tensors(copied)} - weights
    theirs = {t.untyped_storage().data_ptr() for t in graph_tensors(out)} - weights
    assert (len(ours), len(theirs)) == (3, 2) and not ours & theirs  # (hidden[:1] a view of hidden; copied alone)
    assert copied.__dict__["_logits_value"].inputs[0] is copied.hidden  # (one copy of the tensor reached twice)
    with torch.no_grad():
        hidden.fill_(float("nan"))  # (the graphs' memory reused)
    torch.testing.assert_close(copied.logits, head(copied.hidden))
    assert torch.isfinite(copied.logits).all() and torch.isfinite(copied.extra[1]["k"]).all()
    from transformers.modeling_outputs import CausalLMOutputWithPast  # (a ModelOutput: its fields are dict items too)
    hf = CausalLMOutputWithPast(logits=torch.ones(2, 3))
    copied = copied_out(hf)
    assert type(copied) is type(hf) and copied.logits.data_ptr() != hf.logits.data_ptr()
    assert copied["logits"] is copied.logits and torch.equal(copied.logits, hf.logits)


def test_an_evaluation_between_a_step_and_its_log_read_keeps_both(run, monkeypatch):
    """The training loop reads a step's log later (``read_log``), and an evaluation may run before that: under ``model``
    its no-grad forwards are CUDA graphs too, each starting a new generation that overwrites the training step's graph
    outputs. The step's log holds none of them (its values summed into tensors of its own) and the evaluation's
    results are copies: the step's row and the evaluation equal eager's, and the next step too."""
    def sequence(trainer):
        trainer.queue_step()
        evaluation = trainer.evaluate()
        first = trainer.read_log()[-1]
        return first, evaluation, trainer.train_step()

    eager = sequence(trainer(run, "eval-between-eager", "off", eval_data=str(run / "code.jsonl")))
    memory = WholeGraphs()
    memory.install(monkeypatch)
    fast = sequence(trainer(run, "eval-between-graphs", "model", eval_data=str(run / "code.jsonl")))
    assert memory.calls > 2 and memory.overwritten > 0  # (the evaluation's calls overwrote the step's outputs)
    for a, b in ((eager[0], fast[0]), (eager[2], fast[2])):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert eager[1] and fast[1].keys() == eager[1].keys()
    for key, value in eager[1].items():
        if isinstance(value, float):
            assert fast[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
