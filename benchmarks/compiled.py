"""The compiled side of the benchmarks: the dense family's model compiled as the concept model is, and the concept
model through its own ``compile`` option (``concept.compiled``).

The honest baseline is the best dense model a user can run, so a compiled concept model is measured against
the dense family's model over the same backbone compiled the same way, by the library's own ``compile``
(:func:`dense_model`), and, next to it, against HF eager. On a CPU the dense side is traced by dynamo only
(``backend="eager"``): the plumbing, in seconds, never a speed claim.

A streaming model compiles only with a static concept budget (``BuildConfig.max_ratio``): the compiled
builds get :data:`BUDGET`, the default build's ``auto``, unless they set one (:func:`budgeted`).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from concept.streaming.operating_point import MAX_RATIO_AUTO, has_budget

BUDGET = MAX_RATIO_AUTO  # the compiled streaming builds' max_ratio: the default build's (concept.streaming.budget)


def kit_choice() -> str:
    """What the GPU kit compiles with (``setup``'s compiled training rows, ``speed``'s compiled cases, ``quality``'s
    compiled runs): ``--compile auto``'s choice on a CUDA device with Triton (``concept.compiled.gpu_choice``), the
    whole forward one graph (``model``; the fourth lease measured ``on``: one CUDA graph per layer and eager glue
    between) where this torch compiles ``model``'s layers as nested regions (torch 2.11 on, the GPU image's
    included), else ``on``. Without regions ``model`` traces all 30 layers inline: under torch 2.11 on this CPU,
    cold, a SmolLM2-shaped streaming model's first compiled training step took 107 s that way, 68 s with the
    regions, 25 s with ``on`` (``docs/benchmarks.md``, "The regions on the GPU image's torch"); ``setup``'s 5.5
    minutes hold the regions' compilations of both models of the training target."""
    import concept.compiled

    return concept.compiled.gpu_choice()


def suite_choice(option: str, device_type: str) -> str:
    """What the benchmark suites compile with for ``concept bench --compile OPTION`` on ``device_type``: the option,
    ``auto`` as it decides there (``concept.compiled.device_choice``: ``off`` on a CPU, so the compiled cases skip
    there, as without ``--compile``)."""
    from concept.compiled import device_choice
    from concept.config import AUTO_CHOICE

    return device_choice(device_type) if option == AUTO_CHOICE else option


def dense_model(backbone, device, choice: str | None = None):
    """The dense side of a compiled comparison: the dense family's model over ``backbone`` (its layers as ``concept``
    runs them: plain causal attention through SDPA's flash kernel, the fused norms; its logits deferred, as the
    concept model's), compiled with the concept model's own ``choice`` (None: :func:`kit_choice`) by the library:
    "dense compiled the same way". Not ``torch.compile`` of transformers' forward: traced, transformers builds the
    full causal mask (before torch 2.14 it cannot skip the mask without reading the padding back:
    ``transformers.masking_utils._ignore_causal_mask_sdpa``), so its SDPA runs without the flash kernel (the H200,
    2026-11-27b: 29.0 ms at 8k, against HF eager's 23.1). On a CPU traced by dynamo only (``backend="eager"``): the
    plumbing, in seconds, never a speed claim."""
    from concept.compiled import compile_model
    from concept.dense import DenseModel

    backend = None if torch.device(device).type == "cuda" else "eager"
    return compile_model(DenseModel(backbone).eval(), library_choice(choice or kit_choice()), backend=backend)


def budgeted(config):
    """``config`` (a ``BuildConfig``) with a static concept budget: its own ``max_ratio`` (the default ``auto``
    included), else :data:`BUDGET`."""
    return dataclasses.replace(config, max_ratio=config.max_ratio if has_budget(config.max_ratio) else BUDGET)


def build_option(choice: str | None = None) -> dict:
    """``concept.build`` keywords for a compiled model (its config :func:`budgeted`; None: :func:`kit_choice`)."""
    return {"compile": choice or kit_choice()}


FLAT_MODEL = "model-flat"  # a benchmark's choice: ``model`` with every decoder layer traced inline (no regions)


def library_choice(choice: str) -> str:
    """The library's compile choice for a benchmark's ``choice`` (:data:`FLAT_MODEL` is ``model`` with
    ``concept.compiled.LAYER_REGIONS`` off; any other choice sets the regions as the library's default does: on from
    ``concept.compiled.REGIONS_FROM``), set for the graphs traced next."""
    import concept.compiled

    concept.compiled.LAYER_REGIONS = choice != FLAT_MODEL and concept.compiled.default_layer_regions()
    return "model" if choice == FLAT_MODEL else choice


def layer_regions() -> bool:
    """Whether ``model`` compiles each decoder layer as a nested compile region (``concept.compiled.regions``:
    ``CONCEPT_LAYER_REGIONS``, on by default from ``concept.compiled.REGIONS_FROM``, where this torch has regions)."""
    import concept.compiled

    return concept.compiled.regions()


def region_options() -> dict | None:
    """Inductor's options for a whole forward of regions (``concept.compiled.REGION_OPTIONS``: no buffer reuse, a
    torch 2.13 fault); None for a build without them."""
    import concept.compiled

    return getattr(concept.compiled, "REGION_OPTIONS", None)


def training_graphs(device_type: str) -> bool:
    """Whether ``model``'s training forward and backward run as CUDA graphs on a device type
    (``concept.compiled.training_cuda_graphs``: on CUDA unless ``CONCEPT_MODEL_CUDA_GRAPHS=0``)."""
    import concept.compiled

    return concept.compiled.training_cuda_graphs(device_type)


def cudagraph_skips() -> int:
    """Inductor's count of graphs it compiled for CUDA graphs but ran without them (each skip's reason is in its
    log: ``skipping cudagraphs due to ...``)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def cudagraph_recordings() -> int:
    """How many CUDA graphs torch's cudagraph trees recorded in this process (counted from the first call of
    :func:`count_cudagraph_recordings`). A steady training step records none: a recording after the warm-up means
    the trees record again, e.g. where a static input (a weight, a module's tensor) came at a new address, which
    they do without a warning or a skip."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_recordings"])


def count_cudagraph_recordings() -> None:
    """Count each recording of torch's cudagraph trees (``CUDAGraphTreeManager.record_function``) in dynamo's
    counters (:func:`cudagraph_recordings`); idempotent."""
    import torch._dynamo.utils
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.CUDAGraphTreeManager
    real = manager.record_function
    if getattr(real, "counted", False):
        return

    def record_function(self, new_inputs, function_id):
        torch._dynamo.utils.counters["inductor"]["cudagraph_recordings"] += 1
        return real(self, new_inputs, function_id)

    record_function.counted = True
    manager.record_function = record_function


class ForwardGraphs:
    """What a compiled forward row's CUDA graphs did (:func:`forward_graphs`)."""

    def __init__(self, graphs: dict):
        self.graphs = graphs  # model name -> whether its no-grad forward runs as CUDA graphs
        self.skips, self.recordings = cudagraph_skips(), cudagraph_recordings()

    def done(self) -> dict:
        """``NAME_cuda_graphs`` per model (whether its no-grad forward ran as CUDA graphs), and over the timed calls
        since: ``cudagraph_skips`` (graphs inductor ran without them) and ``cudagraph_rerecorded`` (graphs recorded
        again: 0 when every call replays)."""
        return {**{f"{name}_cuda_graphs": graphs for name, graphs in self.graphs.items()},
                "cudagraph_skips": cudagraph_skips() - self.skips,
                "cudagraph_rerecorded": cudagraph_recordings() - self.recordings}


def forward_graphs(models: dict, fns: dict, device, warmup: int = 2) -> ForwardGraphs:
    """Before a compiled forward row is timed (no gradients): each of ``fns`` called ``warmup`` more times after its
    first call (cudagraph trees warm a graph up at its first call and record it at the second), then the count of
    graphs skipped and recorded so far, with whether each of ``models`` (name -> model) runs its no-grad forward as
    CUDA graphs (``concept.compiled.WholeForward.kind``; False: not a whole forward, or inductor's default mode)."""
    count_cudagraph_recordings()
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    whole = {name: m.__dict__.get("forward") for name, m in models.items()}
    return ForwardGraphs({name: hasattr(w, "kind") and w.kind(device.type) != "plain" for name, w in whole.items()})


def without_failed_graphs(measure, device):
    """``(measure(), None)``; where it fails with ``model``'s no-grad forwards as CUDA graphs on ``device``
    (``concept.compiled.NO_GRAD_CUDA_GRAPHS``), measured again with them off for the rest of this process (compiled
    anew: dynamo's caches and torch's cudagraph trees reset), as ``(measure(), the first failure's error)``: a lease
    whose torch fails the graphs in the forward still reads the forward target (``setup``'s compiled training rows
    fall back the same way: ``setup_stage.graphs_failed``). ``measure`` builds its compiled models itself."""
    import concept.compiled

    try:
        return measure(), None
    except Exception as error:  # noqa: BLE001 (any failure of the graphs: the row is measured again without them)
        if not (concept.compiled.NO_GRAD_CUDA_GRAPHS and concept.compiled.training_cuda_graphs(torch.device(device).type)):
            raise
        failed = f"{type(error).__name__}: {error}"[:2000]
    concept.compiled.NO_GRAD_CUDA_GRAPHS = False
    torch._dynamo.reset()
    from torch._inductor import cudagraph_trees

    cudagraph_trees.reset_cudagraph_trees()
    return measure(), failed


def train_option(choice: str | None = None) -> dict:
    """``TrainConfig`` fields for compiled training (the source build :func:`budgeted`; None: :func:`kit_choice`)."""
    return {"compile": choice or kit_choice()}


def first_calls(fns: dict, device) -> dict:
    """Each of ``fns`` (name -> call) once, timed to the device's end: ``NAME_first_s``, the first call's seconds,
    compilation included (the compiled rows report it next to their steady times)."""
    out = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        out[f"{name}_first_s"] = time.perf_counter() - start
    return out
