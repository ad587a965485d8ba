"""``--compile``: the layer stacks of a model run as graphs compiled by ``torch.compile(fullgraph=True)``.

What is compiled is ``concept.backbone.run_layers`` (a stack's decoder layers with their RoPE table and
attention plan): the streaming model's shallow, middle and deep stacks, and the dense / pruned baselines'
layers, in training and in full forwards, and the streaming decoder's prefill (its prompts left-padded to
a multiple of ``PREFILL_BUCKET`` tokens, so a few graphs serve every prompt length). The length policy's
decisions, the packing and the attention plans are computed between the stacks, eagerly. A decoding step
is compiled whole, over static KV caches (``concept.static_decoding``: one graph per (batch, cache capacity)).
The training loss's per-chunk arithmetic (``concept.losses.chunk_terms``) is compiled with them
(:meth:`CompiledStacks.loss_terms`; the models pass their ``compiled_stacks`` to ``head_next_token_loss``): two
graphs, a full chunk and a batch's last one, in torch's default mode even where the stacks run CUDA graphs (the
loss's gradients are kept past the next compiled call: graphs' memory would be overwritten), so on CUDA
inductor fuses the dozen full passes over a chunk's [rows, V] fp32 logits into a couple of kernels.

``fullgraph=True`` makes any graph break an error, so a compiled stack has no host sync in it (a ``.item()``,
a data-dependent ``if`` or a ``nonzero`` would break the graph). Shapes must not depend on the decisions or
the graph would be recompiled at every step: a streaming model compiles only with a static concept budget
(``BuildConfig.max_ratio``, ``docs/architecture.md``, "Static shapes, host syncs and compilation"), and
then one graph per stack serves every step of a (batch, length).

Modes (``compile``): ``off`` (the default until a GPU measurement says otherwise, then ``auto``); ``auto``, compiled
where inductor runs (:func:`auto_choice`: ``model`` on a CUDA device with Triton, eager elsewhere); ``layers``,
and ``on`` (the same), compile one decoder layer with its RoPE table (``concept.backbone.run_layer_rope``) per stack, its graph
serving each layer of the stack (regional compilation: a SmolLM2 forward traces 3 graphs, not 30 layers;
``docs/architecture.md`` says why ``on`` is this on CUDA), in the device's mode when a stack first runs
(``reduce-overhead``, CUDA graphs, on CUDA; torch's default elsewhere); one of torch's modes by name
compiles each stack whole; ``model`` traces the whole forward as one graph (:class:`WholeForward`: the decisions,
the packing, the attention plans, every stack and the loss, each decoder layer a nested compile region traced once per
stack, :func:`_layer_region`; on CUDA a training forward and its backward run as CUDA graphs, and so does a no-grad
forward, its outputs copied out of the graphs' memory; an evaluation-mode call with gradients in inductor's default
mode; its stacks compiled whole where a call runs them on their own, a prefill); ``aot-eager``: whole stacks captured (dynamo, AOT autograd) but run by torch's
eager kernels, no code generated (debugging, and the default test suite, where inductor's C++
compilation of a tiny model's stacks takes minutes on a CPU). Whether a model compiles at all is its
family's answer (``Family.compile_refusal``).

CUDA graphs (``reduce-overhead`` and ``max-autotune`` on CUDA) return their outputs in a memory pool that a
later compiled call reuses: torch's cudagraph trees start a new *generation* at every call of a compiled
function unless a backward is pending, so under ``torch.no_grad()`` (eval, calibration, benchmarks, prefill)
the shallow stack's output would be overwritten by the middle stack's run while the model still needs it
(the deep stack's tail reads it), and any output kept past the next call (a logged state, ``out.shallow``,
``out.hidden``) would be too. So a compiled stack's output is copied out of that memory as it returns, and
so are the keys / values a prefill's cache recorded in it (:func:`copy_recorded`): one copy per stack
output (the hidden state, and at a prefill each layer's keys and values), nothing in training's backward;
one graph per layer: also each layer's output where no backward is pending (:func:`_copied_out`).
On a CPU, and with ``aot-eager``, no copy is made.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import os
import types

import torch

from .backbone import run_layer, run_layer_rope, run_layers
from .config import AUTO_CHOICE, COMPILE_CHOICES, REGIONAL_CHOICES, WHOLE_CHOICE, device_mode, uses_cuda_graphs
from .errors import ConceptError
from .families import family_of
from .lazy import Deferred
from .lora import clear_outside
from .losses import chunk_terms



# torch.compile's backend for ``model`` where ``compile_model`` is given none: None, inductor (the default test
# suite sets ``aot_eager``: captured, run by eager kernels; inductor's C++ compilation of a whole model takes minutes)
WHOLE_BACKEND: str | None = None
# The oldest torch the regions are on by default in: the oldest they were tested in (2.11, the GPU image's, and
# 2.13). On 2.11 a training step of regions failed until the adapted layers traced plain ops instead of their
# ``autograd.Function`` (``concept.lora.lora_matmuls``): comparing a layer's second trace with its first, dynamo 2.11
# read ``example_value`` of the placeholders it made for the unused gradient inputs of the Function's backward,
# which have none (``KeyError: example_value``; ``docs/architecture.md``, "torch versions").
REGIONS_FROM = (2, 11)


def torch_release() -> tuple[int, int]:
    """This torch's (major, minor)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def default_layer_regions(environ=os.environ) -> bool:
    """``CONCEPT_LAYER_REGIONS``: ``1`` on, ``0`` off (e.g. for a GPU kit call where a torch cannot compile the
    regions); unset: on from :data:`REGIONS_FROM`."""
    setting = environ.get("CONCEPT_LAYER_REGIONS", "")
    return setting != "0" if setting else torch_release() >= REGIONS_FROM


# ``model``: each decoder layer a nested compile region in the whole forward's graph (:func:`_layer_region`); False
# traces every layer inline (the same graph, flat: tests' negative control, ``benchmarks/compile_time.py``'s rows,
# a torch before :data:`REGIONS_FROM`)
LAYER_REGIONS = default_layer_regions()
PREFILL_BUCKET = 64  # a compiled prefill's prompts are left-padded to a multiple of this many tokens


def _own_copy(fn, name: str):
    """``fn`` with a code object of its own: dynamo keeps its compiled graphs (and counts recompiles, against
    its limit) per code object, so each stack gets its own cache instead of sharing ``run_layers``'."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{name}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledStacks:
    """``run_layers`` compiled with ``fullgraph=True`` and static shapes, once per stack (its ``name``) and
    device type (the mode may differ): call it as ``run_layers``, with the stack's name first (a KV cache
    only while it records a prefill: a decoding step's cache grows). Where the graphs are CUDA graphs, what
    a call returns (and records in the cache) is a copy of their output (the module's docstring says why).

    ``layers`` (regional compilation, :data:`concept.config.REGIONAL_CHOICES`): one decoder layer
    (``run_layer_rope``: with its RoPE table) is compiled per stack instead of the stack's whole loop, and its
    graph serves each layer of the stack (the layers' weights are the graph's inputs: dynamo inlines the
    modules); the stack's loop runs eagerly around it. A prefill (a cache recording) still compiles the stack whole: a
    layer with a cache reads its own ``layer_idx``, so each layer would be a graph of its own."""

    def __init__(self, choice: str, backend: str | None = None):
        self.choice = choice
        self.backend = backend  # torch.compile's backend where not inductor (tests: ``aot_eager``); None: the choice's
        self.compiled: dict[tuple[str, str, bool], tuple[object, bool]] = {}
        self.losses: dict[str, object] = {}  # device type -> the loss's compiled chunk arithmetic (loss_terms)

    def compile(self, name: str, device_type: str, regional: bool = False) -> tuple[object, bool]:
        """(``run_layers``, or with ``regional`` ``run_layer_rope``, compiled for the stack ``name`` on a device type,
        whether its outputs live in the memory of CUDA graphs)."""
        fn = _own_copy(run_layer_rope if regional else run_layers, name)
        if self.choice == "aot-eager" or self.backend:
            return torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend or "aot_eager"), False
        mode = device_mode(self.choice, device_type)
        return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode), uses_cuda_graphs(mode, device_type)

    def loss_terms(self, device_type: str):
        """The training CE's per-chunk arithmetic (``concept.losses.chunk_terms``: upcast, logsumexp, the target's
        logit, the masked sum, softmax - one-hot scaled, the cast back) compiled with ``fullgraph=True`` and static
        shapes (a batch's full chunk and its last one: two graphs), one code object per gradient flag (training,
        evaluation), so each keeps its own graphs and recompile count. Never CUDA graphs: torch's default mode
        (``max-autotune`` without CUDA graphs for ``max-autotune``), as :meth:`compile` with ``aot-eager``."""
        if torch.compiler.is_compiling():  # inside a whole forward's graph (``model``): traced with it
            return chunk_terms
        if device_type not in self.losses:
            mode = "max-autotune-no-cudagraphs" if self.choice == "max-autotune" else None
            kwargs = {"backend": self.backend or "aot_eager"} if self.choice == "aot-eager" or self.backend else {
                "mode": mode}
            runs = {grad: torch.compile(_own_copy(chunk_terms, "train" if grad else "eval"), fullgraph=True,
                                        dynamic=False, **kwargs) for grad in (False, True)}
            self.losses[device_type] = lambda logits, target, valid, count, grad: runs[grad](logits, target, valid,
                                                                                             count, grad)
        return self.losses[device_type]

    def __call__(self, name, layers, x, position_ids, attention_plan, rotary_emb, checkpointing=False, cache=None):
        if torch.compiler.is_compiling():  # inside a whole forward's graph (``model``): the stack traced with it,
            plain = regions() and cache is None and not checkpointing  # each layer a nested compile region
            out = run_layers(layers, x, position_ids, attention_plan, rotary_emb, checkpointing, cache,
                             run=_layer_region if plain else None)
            return ContiguousGradient.apply(out) if plain and out.requires_grad else out
        regional = self.choice in REGIONAL_CHOICES and cache is None
        key = (name, x.device.type, regional)
        if key not in self.compiled:
            self.compiled[key] = self.compile(name, x.device.type, regional)
        run, in_graph_memory = self.compiled[key]
        if regional:
            layer_run = _copied_out(run, layers[-1] if len(layers) else None) if in_graph_memory else run
            for layer in layers:  # (each layer's graph builds its RoPE table: run_layer_rope)
                x = layer_run(layer, x, position_ids, attention_plan, rotary_emb, checkpointing)
            return x
        out = run(layers, x, position_ids, attention_plan, rotary_emb, checkpointing, cache)
        if not in_graph_memory:
            return out
        if cache is not None:
            copy_recorded(cache)
        return out.clone()  # (its backward passes the gradient through: nothing is kept for it)


class ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous. A stack's output under regions: the last layer's
    body then receives the contiguous gradient its stack's other layers receive, so one backward body serves them
    all. (The middle stack's output is the first slots of the deep stack's input, a ``cat``: its gradient is a
    strided slice, and torch traced a second backward body for that one layer.) A copy of the stack's output
    gradient in a training backward, where it is strided; nothing otherwise."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


# One decoder layer of a stack inside a whole forward's graph (``model``; called only without checkpointing or a
# cache), as a nested compile region: dynamo traces the stack's first layer and stamps its graph out for the layers
# after it (their weights its inputs; where guards, the plan's pytree or an input's metadata differ, it traces the
# layer anew), and inductor generates one layer's code per stack. The tracing of a SmolLM2 forward falls from 30
# layers to one per stack (``docs/benchmarks.md``, "One layer traced per stack").
REGION_REUSE = 32  # the region's traced graphs kept for reuse (torch 2.13's default is 8), where torch takes a limit


def layer_region(fn):
    """``fn`` as a nested compile region, or None where this torch has none (before 2.8: each layer is then
    traced inline, the same graph). ``max_reuse_entries`` only where this torch takes it: torch 2.11, the GPU
    image's, keeps every traced graph for reuse and takes no limit (with it, ``import concept.compiled`` failed
    there: ``tests/test_torch_versions.py``)."""
    mark = getattr(torch.compiler, "nested_compile_region", None)
    if mark is None:
        return None
    limit = {"max_reuse_entries": REGION_REUSE} if "max_reuse_entries" in inspect.signature(mark).parameters else {}
    return mark(fn, **limit)


_layer_region = layer_region(run_layer)


def regions() -> bool:
    """Whether ``model`` compiles each decoder layer as a region: ``LAYER_REGIONS``, where this torch has them."""
    return LAYER_REGIONS and _layer_region is not None

# Inductor's options for a whole forward whose layers are regions. torch 2.13's inductor takes a region call's
# outputs for new buffers, but a region returns its input itself among the activations its backward keeps (a
# layer's input, for its norm's and its residual's backward): after the call the caller's buffer of that input
# looks dead, and inductor hands its storage to the next kernel's output of the same size, overwriting the kept
# activation. Found as wrong gradients (the loss right) in every layer below a deep stack as wide as the tokens
# (``packing.DeepBlock``): its last layer's input reused for the deep states put back in time order, [B, T, d]
# both. Without buffer reuse a dead buffer is only released (``del``): the region's kept reference holds its
# storage, and the allocator serves the next kernel other memory (``tests/test_compile_regions.py``: gradients
# equal eager's; inductor's default reuse as the negative control).
REGION_OPTIONS = {"allow_buffer_reuse": False}
# ``model``'s kinds of call (:meth:`WholeForward.kind`; all but ``plain`` run as CUDA graphs): each one's code object
KIND_NAMES = {"plain": "whole", "train graphs": "whole_graphs", "no-grad graphs": "whole_no_grad_graphs"}
# ``model``: a no-grad call on CUDA runs as CUDA graphs, its outputs copied out (False, or ``CONCEPT_NO_GRAD_CUDA_GRAPHS=0``:
# inductor's default mode, as before 2026-11-28; the GPU kit's fallback should a torch's graphs fail the no-grad forward)
NO_GRAD_CUDA_GRAPHS = os.environ.get("CONCEPT_NO_GRAD_CUDA_GRAPHS", "1") != "0"
# ``model``: under autocast the LoRA adapters are cast to its dtype before the whole forward's graph, together
# (:meth:`WholeForward.cast_adapters`); False: each adapted layer's graph casts its own (tests' negative control)
CAST_ADAPTERS_OUTSIDE = True


def _copied_out(run, last):
    """A compiled layer under CUDA graphs (``layers``): the stack's output (its ``last`` layer's) is copied out of
    the graphs' memory, as a whole stack's is; a layer's output that the next layer reads is copied only where no
    backward is pending (no gradient: each call then starts a new generation, which reuses that memory)."""
    def layer(module, *args):
        out = run(module, *args)
        return out if out.requires_grad and module is not last else out.clone()

    return layer


def copied_out(value, copies: dict | None = None):
    """``value`` (what a compiled forward returned: a model output) with each tensor in it replaced by a copy, found
    through dataclass fields (transformers' ``ModelOutput`` too), tuples, lists, dicts and a deferred field's inputs
    (``concept.lazy.Deferred``); a tensor reached twice is copied once (``copies``: id -> its copy), so what aliased
    still does. Anything else (a module, a number) is kept as it is. A no-grad forward run as CUDA graphs returns
    this, its outputs out of the graphs' memory (:class:`WholeForward`)."""
    copies = {} if copies is None else copies
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.clone()
        return copies[id(value)]
    again = lambda v: copied_out(v, copies)  # noqa: E731
    if isinstance(value, Deferred):
        return value.copied(again)
    if isinstance(value, dict) and dataclasses.is_dataclass(value):  # (transformers' ModelOutput: its fields are items)
        return type(value)(**{k: again(v) for k, v in value.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        other = copy.copy(value)
        other.__dict__.update({k: again(v) for k, v in vars(value).items()})
        return other
    if isinstance(value, (tuple, list)):
        items = [again(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, again(v)) for k, v in value.items())
    return value


def copy_recorded(cache) -> None:
    """Replace the keys / values a prefill's cache (``concept.kv_cache.SlotCache``, one stack's) recorded by
    copies: a compiled stack's records are its graph's outputs."""
    for store in (cache.k, cache.v):
        for layer, t in store.items():
            store[layer] = t.clone()


def compile_model(model, choice: str = "on", backend: str | None = None, device=None, refused: str | None = None):
    """Run ``model``'s stacks compiled (``choice``: one of ``COMPILE_CHOICES``; ``off`` leaves it eager), with
    ``model`` its whole forward too (:class:`WholeForward`). Its family says whether it can
    (``Family.compile_refusal``: a streaming model needs a static concept budget; the dense and pruned baselines
    compile the layers they run through ``compiled_stacks``). ``backend``: torch.compile's backend instead of
    inductor (``aot_eager`` in the default test suite: captured, run by torch's eager kernels).

    ``auto`` (:func:`auto_choice`) is decided for ``device`` where one is given (training knows its device), else at
    the model's first call, from its inputs' device (:class:`AutoCompile`: ``concept.load`` compiles a model before
    the user moves it to its device); never refused: what cannot compile runs eagerly (``refused``: a reason beside
    the family's, from where the model runs: a training run sharded by FSDP2)."""
    if choice not in COMPILE_CHOICES:
        raise ConceptError(f"compile: one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    model.__dict__.pop("forward", None)  # (a whole forward compiled before, or an undecided ``auto``)
    model.__dict__.pop("compile_reason", None)  # (what an ``auto`` before decided, and why)
    if choice == AUTO_CHOICE:
        if device is None:
            model.compiled_stacks = None
            model.forward = AutoCompile(model, backend)
            return model
        choice, model.compile_reason = auto_choice(model, torch.device(device).type, refused)
    if choice == "off":
        model.compiled_stacks = None
        return model
    why = compile_refusal(model)
    if why:
        raise ConceptError(f"--compile: {why}")
    traceable_output_capturing()
    model.compiled_stacks = CompiledStacks(choice, backend)
    if choice == WHOLE_CHOICE:
        model.forward = WholeForward(model, backend or WHOLE_BACKEND)
    return model


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # (inductor's GPU code is Triton kernels)


def inductor_runs_on(device_type: str) -> bool:
    """Whether ``auto`` compiles for ``device_type``: a CUDA device, with Triton installed."""
    return device_type == "cuda" and TRITON_INSTALLED


def device_choice(device_type: str) -> str:
    """The compiled choice ``auto`` gives a model on ``device_type`` whose family compiles it: ``model`` (the whole
    forward one graph, its decoder layers nested regions, CUDA graphs in training and no-grad calls) where this
    torch compiles layers as regions (:func:`regions`: torch 2.11 on), ``on`` (one CUDA graph per layer) on an older
    one (``model`` would trace all 30 layers of a SmolLM2 inline: minutes of compilation); ``off`` where inductor
    does not run (:func:`inductor_runs_on`): on a CPU a compilation takes minutes (inductor's C++) for a step no GPU
    lease has shown faster there."""
    return gpu_choice() if inductor_runs_on(device_type) else "off"


def gpu_choice() -> str:
    """What compiles a model best on a GPU with this torch: ``model`` where its decoder layers compile as regions
    (:func:`regions`), else ``on`` (``model`` would trace every layer inline: minutes of compilation)."""
    return WHOLE_CHOICE if regions() else "on"


def auto_choice(model, device_type: str, refused: str | None = None) -> tuple[str, str]:
    """What ``--compile auto`` runs ``model`` with on ``device_type`` (:func:`device_choice`, ``off`` where its
    family refuses to compile it now, ``Family.compile_refusal``, or where ``refused`` says why not), and why, in a
    line."""
    choice = device_choice(device_type)
    if choice == "off":
        why = "CUDA without Triton" if device_type == "cuda" else f"a {device_type} device"
        return "off", f"eager: {why} (auto compiles on CUDA with Triton only)"
    refusal = refused or compile_refusal(model)
    if refusal is not None:
        return "off", f"eager: {refusal}"
    return choice, f"{choice} on {device_type}" + ("" if choice == WHOLE_CHOICE else
                                                  " (no layer regions here: `model` would trace every layer inline)")


class AutoCompile:
    """``--compile auto`` before its decision: installed as the model's ``forward`` until its first call, which
    decides from the inputs' device (:func:`auto_choice`), compiles the model that way (``compile_model``, which
    replaces this forward) and runs it. A model moved to another device after that keeps its decision."""

    def __init__(self, model, backend: str | None = None):
        self.eager = type(model).forward.__get__(model)
        self.backend = backend

    @staticmethod
    def installed(model) -> bool:
        """Whether ``model``'s ``--compile auto`` is still undecided (this is its ``forward``)."""
        return isinstance(model.__dict__.get("forward"), AutoCompile)

    def __call__(self, *args, **kwargs):
        values = (*args, *kwargs.values())
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        model = self.eager.__self__
        settle(model, device if device is not None else next(model.parameters()).device)
        return model.forward(*args, **kwargs)


def compiled_choice(model) -> str:
    """The ``compile`` choice ``model`` runs with (``off``: eager; ``auto`` while undecided, :class:`AutoCompile`)."""
    if AutoCompile.installed(model):
        return AUTO_CHOICE
    stacks = getattr(model, "compiled_stacks", None)
    return "off" if stacks is None else stacks.choice


def settle(model, device) -> None:
    """Decide an undecided ``--compile auto`` (:class:`AutoCompile`) for ``device`` now: where a caller reads
    ``model.compiled_stacks`` before calling the model (generation picks its decoder by it). Nothing otherwise."""
    if AutoCompile.installed(model):
        compile_model(model, AUTO_CHOICE, model.forward.backend, device=device)


def traceable_output_capturing() -> None:
    """transformers' output-capturing forward hooks (installed on a backbone's modules by its first HF forward, e.g.
    one asked for hidden states) read a ``ContextVar``, which dynamo cannot trace: a compiled stack of those modules
    would fail on it. While dynamo traces and transformers' own compiled forward has not set a collector, the
    collector's read returns None (no collection is active: concept never asks its layers for HF's captured
    outputs), as transformers' ``CompileableContextVar`` does for a value set outside the graph; eagerly it reads the
    ``ContextVar`` as before. Idempotent; nothing where transformers has no such collector."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return
    collector = getattr(output_capturing, "_active_collector", None)
    if collector is None or getattr(collector, "traceable", False) or not hasattr(collector, "context_var"):
        return
    eager_get = collector.get

    def get():
        if torch.compiler.is_compiling():
            return collector.global_var if collector.compiling else None
        return eager_get()

    collector.get, collector.traceable = get, True


class WholeForward:
    """``--compile model``: the model's forward traced whole, one graph per (shapes, mode, which arguments are
    given): the decisions, the packing, the attention plans, every stack and the loss, with no eager op between
    them (the length policy's host scan is an opaque op in it on a CPU, its Triton kernel on CUDA:
    ``concept.streaming.scan``). Installed as the module's ``forward``, so ``model(...)`` runs it.

    On CUDA it runs as CUDA graphs (:meth:`cuda_graphs`): one replay instead of a forward's hundreds of kernel
    launches (about 3,300 in a SmolLM2 training step, which bound a compiled step by the host: ``docs/benchmarks.md``,
    "What the compiled step asks of the device"; about 550 in an 8k forward).

    - A training forward (the module in training mode, gradients on): one replay for the forward and one for its
      backward. Its outputs and the gradients its backward hands to the weights live in the graphs' memory until the
      next compiled call that starts a new generation of it: read within the step, as a training step reads them;
      with gradient accumulation the trainer keeps the ``.grad`` buffers of its own
      (:func:`gradients_in_graph_memory`).
    - A no-grad forward (evaluation, the ratio controller's calibration, benchmarks, a user's ``torch.no_grad`` or
      ``inference_mode``): its graph's outputs are copied out of the graphs' memory as it returns
      (:func:`copied_out`: every tensor of the output, a deferred field's inputs too), since the next call starts a
      new generation that reuses that memory: what it returns is its own, as an eager forward's is. The copies are a
      few elementwise kernels (at 8k, the states and the head's scores, about a tenth of a millisecond on an H200).

    An evaluation-mode call with gradients on (a user's forward outside ``torch.no_grad``) runs inductor in torch's
    default mode, as every call on a CPU does: its outputs, kept for a backward that may never come, would be
    overwritten by the next call's. A call with an argument that is not a tensor, a number or None (a KV cache
    recording a prefill, the diagnostics' perturbation functions), or that its family would refuse to compile now
    (``compile_refusal``: a streaming model whose budget is switched off for the call, as the keep-all control does),
    runs the forward eagerly, its stacks compiled whole. That check is asked before every graph call, so it is where a
    family reads the host values its graph holds as constants (``Family.compile_refusal``): a changed value
    recompiles, by its guard."""

    def __init__(self, model, backend: str | None = None):
        self.eager = type(model).forward.__get__(model)
        self.backend = backend  # torch.compile's backend where not inductor (tests: ``aot_eager``): never CUDA graphs
        self.graphs: dict[str, object] = {}  # a call's kind (:meth:`kind`) -> its compiled forward (made at its first call)
        self.adapter_casts: list | None = None  # the model's LoRA groups (``concept.lora.AdapterCasts``), at its first call

    def compile(self, kind: str):
        """The whole forward compiled for a call's ``kind`` (:meth:`kind`): inductor drawing random numbers as eager
        does (a sampler's Gumbel noise: the same samples as the eager forward, so compiled training equals eager's;
        one unfused kernel more), with the layers as regions never handing a dead buffer's storage to another
        (``REGION_OPTIONS``), and as CUDA graphs (``reduce-overhead``'s option) where the kind says so; its own code
        object each kind, so that each keeps its graphs and recompile count."""
        options = {"fallback_random": True, **(REGION_OPTIONS if regions() else {}),
                   **({"triton.cudagraphs": True} if kind != "plain" else {})}
        kwargs = {"backend": self.backend} if self.backend else {"options": options}
        forward = _own_copy(type(self.eager.__self__).forward, KIND_NAMES[kind])
        return torch.compile(forward.__get__(self.eager.__self__), fullgraph=True, dynamic=False, **kwargs)

    def cuda_graphs(self, device_type: str) -> bool:
        """Whether a call on ``device_type`` runs as CUDA graphs: on CUDA (unless ``CONCEPT_MODEL_CUDA_GRAPHS=0``,
        :func:`training_cuda_graphs`), inductor's (never a test backend's), a training forward (the module in training
        mode, gradients on) or a no-grad one (:data:`NO_GRAD_CUDA_GRAPHS`). An evaluation-mode call with gradients on
        (a user's forward outside ``torch.no_grad``) does not: its outputs would be overwritten by the next call's."""
        if self.backend is not None or not training_cuda_graphs(device_type):
            return False
        return NO_GRAD_CUDA_GRAPHS if not torch.is_grad_enabled() else self.eager.__self__.training

    def kind(self, device_type: str) -> str:
        """What a call on ``device_type`` is: ``train graphs`` (CUDA graphs, a backward to follow), ``no-grad graphs``
        (CUDA graphs, its outputs copied out) or ``plain`` (inductor's default mode)."""
        if not self.cuda_graphs(device_type):
            return "plain"
        return "train graphs" if torch.is_grad_enabled() else "no-grad graphs"

    def __call__(self, *args, **kwargs):
        values = (*args, *kwargs.values())
        plain = all(v is None or isinstance(v, (torch.Tensor, bool, int, float)) for v in values)
        # (the family's check, asked before every graph call, also brings up to date the host values the graph
        # reads as constants: a streaming model's budget from its policy's target ratio; a change recompiles)
        if not plain or compile_refusal(self.eager.__self__) is not None:  # (e.g. a streaming model's budget
            return self.eager(*args, **kwargs)  # switched off for a call: the keep-all control)
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        kind = self.kind(device.type)
        if kind not in self.graphs:
            self.graphs[kind] = self.compile(kind)
        cast = self.cast_adapters(device)
        try:
            out = self.graphs[kind](*args, **kwargs)
        finally:
            clear_outside(cast)
        return copied_out(out) if kind == "no-grad graphs" else out

    def cast_adapters(self, device: torch.device) -> list:
        """Under autocast, every LoRA adapter of the model cast to its dtype before the graph, eagerly and at once
        (``concept.lora.AdapterCasts.cast_outside``: a multi-tensor copy each way, where the graph would cast each
        weight with a kernel of its own each way, 844 of a SmolLM2 step's ~3,300): the adapted layers given a cast,
        to be cleared after the call. The model's groups of adapters are found at its first call: adapters added
        later are cast in the graph, as before."""
        if not (CAST_ADAPTERS_OUTSIDE and torch.is_autocast_enabled(device.type)):
            return []
        if self.adapter_casts is None:
            found = (getattr(m, "adapter_casts", None) for m in self.eager.__self__.modules())
            self.adapter_casts = list({id(c): c for c in found if c is not None}.values())
        dtype = torch.get_autocast_dtype(device.type)
        return [m for casts in self.adapter_casts for m in casts.cast_outside(dtype, device)]


def training_cuda_graphs(device_type: str, environ=os.environ) -> bool:
    """Whether ``model``'s forwards (training, and no-grad: :meth:`WholeForward.cuda_graphs`) run as CUDA graphs on a
    device type: on CUDA, unless
    ``CONCEPT_MODEL_CUDA_GRAPHS=0`` (e.g. a GPU kit call after ``exact`` found a torch whose CUDA graphs fail the
    whole forward: ``docs/gpu.md``)."""
    return device_type == "cuda" and environ.get("CONCEPT_MODEL_CUDA_GRAPHS", "1") != "0"


def gradients_in_graph_memory(model, device_type: str) -> bool:
    """Whether ``model``'s training backward hands its gradients to the weights in CUDA graphs' memory (``model``,
    :func:`training_cuda_graphs`; the stacks' graphs of ``on``, ``layers`` and ``reduce-overhead`` on CUDA): a
    weight whose ``.grad`` is None takes the backward's output itself, which the next compiled training call
    reuses. So under gradient accumulation the trainer keeps ``.grad`` buffers of its own, zeroed after each
    step, that every backward adds into (torch's advice: ``torch/_inductor/cudagraph_trees.py``)."""
    stacks = getattr(model, "compiled_stacks", None)  # (``model``'s stacks, where a call runs them on their own,
    if stacks is None or stacks.backend or stacks.choice == "aot-eager":  # are CUDA graphs on CUDA too)
        return False
    return uses_cuda_graphs(device_mode(stacks.choice, device_type), device_type)


def compile_refusal(model) -> str | None:
    """Why ``model`` cannot run compiled, or None: its family's answer (``Family.compile_refusal``)."""
    return family_of(model).compile_refusal(model)
