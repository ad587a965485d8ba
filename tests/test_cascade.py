"""`cascade` (plugins/attention/cascade.py): three dense parts, the tail's two merged by log-sum-exp.

- its tiles, with either kernel (torch's CPU flash kernel, the plain-torch reference) and through the CUDA
  kernel's wrapper (its operators stood in for on the CPU), equal the dense-mask reference, outputs and
  gradients in fp64, for padding, packed documents, several concept slots per boundary, rows without
  concepts or without tails;
- in a whole model: its logits and gradients equal sdpa's in fp64 for every position scheme on a padded batch
  (sdpa's equal the naive loop's: tests/test_equivalence.py), and the naive loop's directly (padding, logits and
  gradients); packed documents equal separate rows; decoding equals teacher forcing;
- memory per layer call is O(T + rT): the largest tensor a call (forward and backward) allocates grows
  linearly with T, where the dense mask's grows as T^2.
Negative controls: parts merged without their log-sum-exps, and a backward with each part's own log-sum-exp
instead of the merged one, are caught."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import concept.packing as packing
import concept_plugins.attention.cascade as cascade
from concept.flops import evenly_spaced_keep
from concept.packing import pack
from concept_plugins.attention.cascade import CascadeConfig, CascadePattern, CPUFlashKernel
from concept_plugins.attention.sdpa import DenseMaskPattern
from tests.conftest import PACKED_DOC, assert_decoding_matches_teacher_forcing, mixed_model
from tests.cuda_kernel_standin import standin_cuda_kernel
from tests.test_equivalence import (assert_gradients_match_naive, assert_packed_documents_equal_separate_rows,
                                    assert_padded_batch_matches_naive, inputs)

LAYOUTS = {  # (B, T, concepts per token, documents, padding, emit)
    "one-row": (1, 40, 0.2, False, False, 1),
    "padded-documents": (3, 90, 0.15, True, True, 1),
    "emit-2": (2, 48, 0.25, True, False, 2),
    "no-concepts": (2, 30, 0.0, False, True, 1),
    "no-tails": (2, 30, 1.0, False, True, 1),
}


def layout_and_inputs(name, seed=0, dtype=torch.float64):
    B, T, rate, docs, pad, emit = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, T, generator=g) < rate
    valid = torch.ones(B, T, dtype=torch.bool)
    if pad:
        valid[0, T // 2:] = False
        valid[-1, :3] = False
    doc = (torch.arange(T) * 3 // T).expand(B, T) if docs else None
    layout = pack(keep, valid, doc, emit=emit)
    H, Hkv, hd, L = 4, 2, 8, layout.length
    q = torch.randn(B, H, L, hd, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(B, Hkv, L, hd, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    return layout, q, k, v


def errors(plan, layout, q, k, v):
    """Largest |difference| from the dense-mask reference: outputs at real slots, then q, k, v gradients."""
    ref = DenseMaskPattern(layout)(q, k, v, 0.3)
    out = plan(q, k, v, 0.3)
    real = layout.meta.valid
    d_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype) * real[..., None, None]
    grads = [torch.autograd.grad(o, (q, k, v), d_out) for o in (ref, out)]
    return float((out - ref).detach()[real].abs().max()), max(float((a - b).abs().max()) for a, b in zip(*grads))


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiles_equal_the_dense_mask_outputs_and_gradients(name, kernel):
    layout, q, k, v = layout_and_inputs(name)
    out_err, grad_err = errors(CascadePattern(layout, CascadeConfig(kernel=kernel, prefix_blocks=3, granule=8)),
                               layout, q, k, v)
    assert out_err < 1e-12 and grad_err < 1e-12, (out_err, grad_err)


def test_negative_controls_a_merge_without_weights_and_a_backward_without_the_merged_lse(monkeypatch):
    layout, q, k, v = layout_and_inputs("padded-documents")
    plan = CascadePattern(layout, CascadeConfig())
    assert max(errors(plan, layout, q, k, v)) < 1e-12
    # the tail's parts averaged instead of weighted by their log-sum-exps: outputs off
    real_merge = cascade.merge_parts
    monkeypatch.setattr(cascade, "merge_parts", lambda out_a, lse_a, out_b, lse_b: (
        torch.where(torch.isfinite(lse_b)[..., None], (out_a + out_b) / 2, out_a), torch.logaddexp(lse_a, lse_b)))
    assert errors(plan, layout, q, k, v)[0] > 1e-3
    monkeypatch.setattr(cascade, "merge_parts", real_merge)

    # each part's backward told its own log-sum-exp (a part's softmax alone): outputs right, gradients off
    class OwnLSE(CPUFlashKernel):
        def forward(self, q, k, v, bias, scale):
            out, lse, _ = super().forward(q, k, v, bias, scale)
            return out, lse, (out, lse)

        def backward(self, d_out, q, k, v, out, lse, bias, scale, state=None):
            return super().backward(d_out, q, k, v, state[0], state[1], bias, scale)

    monkeypatch.setattr(cascade, "device_kernel", lambda device: OwnLSE())
    out_err, grad_err = errors(plan, layout, q, k, v)
    assert out_err < 1e-12 and grad_err > 1e-3


def test_the_cuda_kernel_wrapper_with_its_operators_stood_in_for(monkeypatch):
    kernel = standin_cuda_kernel()  # the operators' contract: tests/cuda_kernel_standin.py
    monkeypatch.setattr(cascade, "device_kernel", lambda device: kernel)
    layout, q, k, v = layout_and_inputs("padded-documents")
    assert max(errors(CascadePattern(layout, CascadeConfig()), layout, q, k, v)) < 1e-12


PACKED_KEEP = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)


# -- in a whole model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp64(tiny_models):
    return lambda **kw: copy.deepcopy(tiny_models(**kw)).double().eval()


@pytest.mark.parametrize("positions", ["time", "per-type", "compact"])
def test_model_outputs_and_gradients_equal_sdpa_in_fp64_for_every_scheme(fp64, positions):
    """On the padded batch (right and left padding, every kind of row): logits and every new module's gradient
    equal sdpa's, whose equal the naive loop's (tests/test_equivalence.py)."""
    from tests.test_equivalence import _new_module_grads, padded_batch

    ids, mask, keep = padded_batch()
    runs = []
    for backend in ("cascade", "sdpa"):
        model = fp64(attention=backend, positions=positions)
        logits = model(ids, attention_mask=mask, keep=keep).logits
        runs.append((logits[mask.bool()], _new_module_grads(model, logits, ids, mask.bool())))
    (out, grads), (ref, ref_grads) = runs
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert set(grads) == set(ref_grads) and any(n.startswith("vocabulary.head") for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-12, rtol=1e-9, msg=name)


def test_model_equals_the_naive_loop_forward_and_backward(fp64):
    """Directly against the naive per-step reference: the padded batch's logits and gradients (fp64), packed
    documents against separate rows, and decoding against teacher forcing."""
    model = fp64(attention="cascade", positions="time")
    assert_padded_batch_matches_naive(model, atol=1e-10)
    assert_gradients_match_naive(model, atol=5e-9, rtol=1e-6)
    assert_packed_documents_equal_separate_rows(model, inputs(B=1, T=16, seed=7), PACKED_KEEP, atol=1e-10)
    model = mixed_model("null", "cascade", "per-type")
    assert_decoding_matches_teacher_forcing(model, [inputs(1, 9, seed=2)[0].tolist(), inputs(1, 4, seed=3)[0].tolist()],
                                            12)


def test_negative_control_the_model_check_sees_a_lost_segment_rule(fp64, monkeypatch):
    model = fp64(attention="cascade", positions="time")
    with torch.no_grad():
        ids, keep = inputs(), torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1]], dtype=torch.bool)
        before = model(ids, keep=keep).logits
        real_pack = packing.pack

        def one_segment(*args, **kwargs):
            layout = real_pack(*args, **kwargs)
            m = layout.meta
            layout.meta = packing.SlotMeta(m.time, m.keep, torch.where(m.valid, 0, m.seg), m.valid, m.doc, m.sub)
            return layout

        monkeypatch.setattr(packing, "pack", one_segment)
        assert float((model(ids, keep=keep).logits - before).abs().max()) > 1e-4


# -- memory ------------------------------------------------------------------------------------------------
class LargestAllocation(TorchDispatchMode):
    """The largest storage any operator's output holds (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def largest_per_layer(backend: str, T: int) -> float:
    """The largest tensor one deep layer's attention call allocates, forward and backward (r = 1/8, grouped
    heads, the plan built beforehand), in units of the layer's query tensor."""
    from concept.registry import registry

    keep = evenly_spaced_keep(T, 0.125)[None]
    layout = pack(keep, torch.ones_like(keep))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, T, 16, generator=g).requires_grad_() for _ in range(2))
    plan = registry("attention").get(backend)().plan(layout)
    plan(q, k, v, 0.25).sum().backward()  # once: what the plan builds for every layer (its masks as biases)
    with LargestAllocation() as seen:
        plan(q, k, v, 0.25).sum().backward()
    return seen.largest / (q.numel() * q.element_size())


def test_memory_per_layer_is_linear_in_the_length():
    short, long = largest_per_layer("cascade", 1024), largest_per_layer("cascade", 4096)
    assert long <= 4.0 and long <= 1.25 * short, (short, long)
    # negative control: the dense mask's attention allocates T x T
    assert largest_per_layer("sdpa", 1024) * 1.5 < largest_per_layer("sdpa", 2048)


def test_config_is_checked():
    assert CascadeConfig().validate() == []
    problems = CascadeConfig(kernel="fast", prefix_blocks=0, granule=12).validate()
    assert len(problems) == 3 and "kernel: one of auto, reference" in problems[0]
