"""An adapted projection in three Triton kernels (``concept.lora_triton``, ``--lora-kernel triton``) against the
matmuls it replaces (``concept.lora.LoraMatmuls``).

On CPU, in Triton's interpreter (a subprocess, ``tests/lora_triton_cases.py``: the interpreter must be chosen
before Triton is first imported): in fp32 the output and the gradients of x, A and B equal the matmuls' to the
order of fp32 sums, for shapes that fill no tile evenly, ranks 4-32, a base of zeros, a scale that is not a power
of two and strided inputs; in bf16 each is at least as close to fp64 as the matmuls' (the kernels round once where
the matmuls round twice); a tiny streaming model's loss and 84 adapter gradients with the kernels equal the
matmuls' in fp32 and are as close to fp32 under bf16 autocast. Negative controls: an adapter scaled 1 % wrong and
ranks past the kernels' rank tile dropped are caught. In this process (Triton compiled, no GPU): the traced
forward and backward of a projection are 3 kernels where the matmuls' are 8 (the control), with no zero-filled
gradient, and ``torch.compile(fullgraph=True)`` traces the kernels with no graph break. A training
run asking for the kernels where they cannot run is refused before anything is written
(``tests/test_training.py``). Marked ``cuda`` (the GPU kit's ``exact`` stage runs them): the same checks with
the compiled kernels, and a compiled training step of an adapted model against its eager matmuls.
"""
from __future__ import annotations

import math

import pytest
import torch

from concept import lora_triton
from tests.conftest import WRAP_TRITON_REFUSES, interpreter_report

pytestmark = pytest.mark.skipif(not lora_triton.AVAILABLE, reason="triton is not installed")
FP32 = 1e-5  # relative L2 error: the same products summed in another order


@pytest.fixture(scope="module")
def interpreted():
    """The report of ``tests/lora_triton_cases.py`` run in Triton's interpreter on CPU tensors."""
    return interpreter_report("tests.lora_triton_cases", skip_on=WRAP_TRITON_REFUSES)


def check_compare(report: dict) -> None:
    from tests.lora_triton_cases import NAMES, SHAPES
    assert len(report) == len(SHAPES) * 2 * 2
    for case, got in report.items():
        assert max(got["fp32"].values()) < FP32, (case, got["fp32"])
        for name in NAMES:  # as close to fp64 as the matmuls, or closer (a little slack: s h rounded twice for s=0.3)
            assert got["bf16"][name] <= 1.1 * got["bf16_matmuls"][name] + 1e-4, (case, name, got)
        assert got["dtypes"] == ["torch.bfloat16"], case


def check_negative(report: dict) -> None:
    for fault, errors in report.items():  # each fault seen by the fp32 comparison (NaN counts as seen)
        assert all(not (error < FP32) for error in errors.values()), (fault, errors)
    assert math.isclose(report["scale 1 % off"]["y"], 0.01, rel_tol=1e-3)


def check_model(report: dict) -> None:
    assert report["layers"] == 42 and report["fp32"]["gradients"] == 84 and report["auto is the kernels"]
    assert report["fp32"]["loss"] < FP32 and report["fp32"]["worst adapter gradient"] < 1e-4, report
    bf16 = report["bf16 autocast, against fp32"]
    assert bf16["kernels"]["loss"] <= 1.5 * bf16["matmuls"]["loss"] + 1e-4, bf16
    assert bf16["kernels"]["worst adapter gradient"] <= 1.5 * bf16["matmuls"]["worst adapter gradient"], bf16


def test_the_kernels_equal_the_matmuls(interpreted):
    check_compare(interpreted["compare"])


def test_negative_controls_a_wrong_scale_and_dropped_ranks_are_caught(interpreted):
    check_negative(interpreted["negative"])


def test_a_streaming_model_trains_the_same_through_the_kernels(interpreted):
    check_model(interpreted["model"])


def test_an_input_with_no_rows_launches_nothing_and_gives_zero_gradients(interpreted):
    assert interpreted["no_rows"] == {"shapes": [[0, 48], [0, 64], [8, 64], [48, 8]], "equal": True}


def joint_census(products) -> dict:
    """The ops of one projection's forward and backward, traced on fake tensors: the custom kernels' ops,
    matmuls and zero fills."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def joint(x, w, a, b, g):
        y = products(x, w, a, b)
        return (y, *torch.autograd.grad(y, (x, a, b), g))

    args = [torch.randn(200, 96, requires_grad=True), torch.randn(80, 96), torch.randn(8, 96, requires_grad=True),
            torch.randn(80, 8, requires_grad=True), torch.randn(200, 80)]
    targets = [str(n.target) for n in make_fx(joint, tracing_mode="fake")(*args).graph.nodes if n.op == "call_function"]
    return {"kernels": sum(t.startswith("concept.lora_") for t in targets),
            "matmuls": sum(t.startswith("aten.mm") for t in targets),
            "zeros": sum(t.startswith(("aten.zeros", "aten.zero", "aten.fill")) for t in targets)}


def launches(op, *args) -> int:
    """The kernel launches of an op's body (what ``torch.compile`` traces and CUDA runs), traced on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(op._abstract_fn, tracing_mode="fake")(*args).graph
    return sum("triton_kernel_wrapper" in str(n.target) for n in graph.nodes if n.op == "call_function")


def test_a_projection_is_three_kernels_where_the_matmuls_are_eight():
    """Forward and backward of one projection, traced: the two ops (no matmul, no zero fill), whose bodies launch 1
    and 2 kernels; the control, the matmuls: 8 matmuls (10 kernels on cuBLAS, with its split-K reductions)."""
    from concept import lora_triton_kernels as kernels
    from concept.lora import lora_matmuls
    ours = joint_census(lambda x, w, a, b: lora_triton.lora_linear(x, w, a, b, 2.0))
    assert ours == {"kernels": 2, "matmuls": 0, "zeros": 0}
    x, w, a, b, g = torch.randn(200, 96), torch.randn(80, 96), torch.randn(8, 96), torch.randn(80, 8), torch.randn(200, 80)
    assert launches(kernels.lora_forward, x, w, a, b, 2.0) == 1
    assert launches(kernels.lora_backward, g, x, w, a, b, torch.randn(200, 8), 2.0) == 2
    theirs = joint_census(lambda x, w, a, b: lora_matmuls(x, w, a, b, 2.0, x.dtype))  # the control
    assert theirs == {"kernels": 0, "matmuls": 8, "zeros": 0}


def test_compiled_fullgraph_the_kernels_are_traced_with_no_graph_break():
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, _inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    with FakeTensorMode() as mode:  # (traced and run on fake tensors: no kernel launches on this CPU)
        x, w, a, b = (mode.from_tensor(t) for t in (torch.randn(64, 32), torch.randn(48, 32), torch.randn(8, 32),
                                                    torch.randn(48, 8)))
        y = torch.compile(lambda x, w, a, b: lora_triton.lora_linear(x, w, a, b, 2.0), backend=backend,
                          fullgraph=True)(x, w, a, b)
    torch._dynamo.reset()
    assert y.shape == (64, 48) and not counters["graph_break"]
    assert len(graphs) == 1 and sum("lora_forward" in t for t in graphs[0]) == 1, graphs


def test_inside_nested_compile_regions_the_kernels_are_traced_with_no_graph_break():
    """``--compile model`` compiles each decoder layer as a nested compile region: two such layers through the
    kernels, forward and backward, traced by dynamo and AOT autograd (on fake tensors), each pass's graph calling the
    regions, no graph break."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    @torch.compiler.nested_compile_region
    def layer(x, w, a, b):
        return torch.nn.functional.silu(lora_triton.lora_linear(x, w, a, b, 2.0))

    graphs = {}

    def keep(kind):
        def compiler(gm, _inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    counters.clear()
    with FakeTensorMode() as mode:
        x, w, a, b = (mode.from_tensor(t) for t in (torch.randn(64, 32, requires_grad=True), torch.randn(32, 32),
                                                    torch.randn(8, 32, requires_grad=True),
                                                    torch.randn(32, 8, requires_grad=True)))
        step = torch.compile(lambda x, w, a, b: layer(layer(x, w, a, b), w, a, b).sum(), fullgraph=True,
                             backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
        step(x, w, a, b).backward()
    torch._dynamo.reset()
    assert not counters["graph_break"]
    assert graphs["forward"].count("invoke_subgraph") == 2 and graphs["backward"].count("invoke_subgraph") == 2


def test_where_the_kernels_run():
    assert lora_triton.runs_on("cuda")
    assert not lora_triton.runs_on("cpu")  # (this process: no interpreter)
    assert "runs on CUDA devices" in lora_triton.why_not("cpu") and lora_triton.why_not("cuda") is None
    # --lora-kernel: triton and auto run the kernels where they run, the matmuls elsewhere; matmuls never the kernels
    assert [lora_triton.chosen(k, "cuda") for k in ("triton", "auto", "matmuls")] == [True, True, False]
    assert [lora_triton.chosen(k, "cpu") for k in ("triton", "auto", "matmuls")] == [False, False, False]


def test_auto_computes_with_the_matmuls_where_the_kernels_do_not_run():
    """``--lora-kernel auto`` on this CPU (no interpreter): an adapted layer's forward and backward are the
    matmuls', op for op (traced: 6 mm, the input needing no gradient; no kernel op) and bit for bit. The control:
    with the kernels said to run here, ``auto`` traces their two ops (on fake tensors: nothing launched)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from concept.lora import LoraSettings, add_lora, fused_lora_class

    class Up(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(96, 80, bias=False)

        def forward(self, x):
            return self.up_proj(x)

    torch.manual_seed(0)
    model = add_lora(Up(), LoraSettings(targets="up_proj", kernel="auto"))
    layer = next(m for m in model.modules() if type(m) is fused_lora_class())
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    x, g = torch.randn(2, 100, 96), torch.randn(2, 100, 80)

    def step(kernel: str, x, g):
        layer.adapter_kernel = kernel
        y = model(x)
        return [y, *torch.autograd.grad(y, adapters, g)]

    def census(kernel: str) -> dict:
        targets = [str(n.target) for n in make_fx(lambda x, g: step(kernel, x, g), tracing_mode="fake",
                                         _allow_non_fake_inputs=True)(x, g).graph.nodes
                   if n.op == "call_function"]
        return {"kernels": sum(t.startswith("concept.lora_") for t in targets),
                "matmuls": sum(t.startswith("aten.mm") for t in targets)}

    assert all(torch.equal(a, m) for a, m in zip(step("auto", x, g), step("matmuls", x, g)))
    assert census("auto") == census("matmuls") == {"kernels": 0, "matmuls": 6}
    saved = lora_triton.runs_on
    lora_triton.runs_on = lambda device: True  # the control: where the kernels run, auto traces them
    try:
        assert census("auto") == {"kernels": 2, "matmuls": 0}
    finally:
        lora_triton.runs_on = saved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_kernels_equal_the_matmuls_on_cuda():
    from tests import lora_triton_cases as cases
    check_compare(cases.compare("cuda"))
    check_negative(cases.negative_controls("cuda"))
    check_model(cases.model_step("cuda"))
    assert cases.no_rows("cuda")["equal"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compiled_adapted_step_through_the_kernels_equals_eager_matmuls_on_cuda():
    """An adapted model's bf16 training step under ``torch.compile(fullgraph=True)`` (inductor: the kernels as
    user Triton kernels in its graph) against the same step eager through the matmuls."""
    from tests.lora_triton_cases import compiled_step
    report = compiled_step("cuda")
    assert report["graph_breaks"] == 0, report
    assert report["loss"] < 1e-2 and report["worst adapter gradient"] < 5e-2, report


def recorded_launches(dtype: torch.dtype, arch: int = 90) -> list:
    """The three kernels' launches at the demo recipe's full-width rows (16,384 x 576, rank 8), recorded instead of
    run: (kernel, arguments, constants)."""
    from concept import lora_triton_kernels as kernels
    launches = []

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((self.kernel, args, constants))

    saved, kernels.wrap_triton = kernels.wrap_triton, Launch
    capability, kernels.capability = kernels.capability, lambda device: divmod(arch, 10)  # (the tiles it picks)
    try:
        x, w = torch.randn(16384, 576, dtype=dtype), torch.randn(576, 576, dtype=dtype)
        a, b = torch.randn(8, 576, dtype=dtype), torch.randn(576, 8, dtype=dtype)
        kernels.lora_forward(x, w, a, b, 2.0)
        kernels.lora_backward(torch.randn(16384, 576, dtype=dtype), x, w, a, b, torch.randn(16384, 8, dtype=dtype), 2.0)
    finally:
        kernels.wrap_triton, kernels.capability = saved, capability
    return launches


@pytest.mark.skipif(lora_triton.interpreted(), reason="TRITON_INTERPRET=1: nothing compiles")
@pytest.mark.parametrize("arch,tensor_core", [(90, "HGMMA"), pytest.param(80, "HMMA", marks=pytest.mark.slow)])
def test_the_kernels_compile_for_the_gpu_on_its_tensor_cores(arch, tensor_core):
    """Each bf16 kernel compiles for the H100 / H200 (sm_90: warpgroup MMAs) and the A100 (sm_80) with Triton's
    bundled ``ptxas``, with no spill and within the SM's shared memory. The control: the fp32 kernels (exact
    products) use no tensor-core instruction, so the check can fail."""
    import triton
    try:
        triton.knobs.nvidia.ptxas.path, triton.knobs.nvidia.cuobjdump.path
    except RuntimeError as exc:
        pytest.skip(f"Triton's bundled ptxas / cuobjdump are not found ({exc})")
    from tests import scan_kernel_builds as builds

    def census(dtype):
        found = {}
        for kernel, args, constants in recorded_launches(dtype, arch):
            compiled = builds.build(kernel, args, constants, arch=arch)
            instructions = [line.split()[1] for line in builds.sass(compiled)]
            found[kernel.__name__] = {**builds.resources(compiled), "shared": compiled.metadata.shared,
                                      "tensor_core": sum(i.startswith(tensor_core) for i in instructions)}
        return found

    bf16 = census(torch.bfloat16)
    assert set(bf16) == {"_forward_kernel", "_backward_kernel", "_sum_kernel"}
    for name, usage in bf16.items():  # (the final sum of the adapters' gradients is a plain loop of adds)
        assert (usage["tensor_core"] > 0) is (name != "_sum_kernel") and usage["local_bytes"] == 0, (name, usage)
        assert usage["shared"] <= 227 * 1024 and usage["registers"] <= 255, (name, usage)
    assert all(usage["tensor_core"] == 0 for usage in census(torch.float32).values())  # the control
