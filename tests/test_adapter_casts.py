"""The casts of the trainable LoRA weights in a bf16-autocast training step (issue 39): one each way per forward +
backward (``concept.lora.AdapterCasts``), where each adapted layer cast its ``A`` and ``B`` to bf16 at every use
and their gradients back to fp32 (4 casts per layer).

``AdapterCastCounter`` (a ``TorchDispatchMode``) counts a cast as an adapter's when it reads an adapter weight
or a tensor made from them by views, ``cat``s and casts (forward), or when its output is, or is a view of, the
gradient an adapter receives (backward: a hook on each adapter sees it before it is accumulated). The step is
``benchmarks/step_counts.training_step``'s on ``test_step_counts.py``'s model (4 layers, the base stored in
bf16, 2 x 16 tokens; its first step). Negative control: the per-use casts (the path before) are counted, 4 per adapted layer.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.step_counts import CASTS, training_step
from benchmarks.test_step_counts import VOCAB, model_of
from concept.precision import store_frozen_base
from concept.streaming.emission import ConceptEmission

MOVES = {"cat", "clone", "contiguous", "split", "split_with_sizes", "unbind", "_unsafe_view"}


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AdapterCastCounter(TorchDispatchMode):
    def __init__(self, adapters):
        super().__init__()
        self.made_from = {_ptr(p) for p in adapters}  # storages holding adapter values (kept alive: no reuse)
        self.kept: list = []
        self.forward = 0
        self.cast_by_output: dict[int, int] = {}  # a cast's output storage -> the cast's number
        self.backward: set[int] = set()
        self.count = 0
        self.hooks = [p.register_hook(self._gradient) for p in adapters]

    def _gradient(self, grad):
        cast = self.cast_by_output.get(_ptr(grad))
        if cast is not None:
            self.backward.add(cast)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        reads_adapters = any(_ptr(t) in self.made_from for t in inputs)
        if name in CASTS:
            self.count += 1
            source = args[1] if name == "copy_" else args[0]
            if _ptr(source) in self.made_from:
                self.forward += 1
            for t in outputs:
                self.cast_by_output[_ptr(t)] = self.count
                self.kept.append(t)
        if reads_adapters and (func.is_view or name in MOVES or name in CASTS):
            for t in outputs:
                self.made_from.add(_ptr(t))
                self.kept.append(t)
        return out

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)


@pytest.fixture(scope="module")
def step():
    """``test_step_counts.py``'s streaming model (4 layers, the base in bf16) and a function that runs one
    training step under the counter, the adapters cast together or (``per_use``) each at its use."""
    model = model_of("streaming", split=(1, 2, 1))
    store_frozen_base(model, torch.bfloat16)
    fused = [m for m in model.modules() if hasattr(m, "adapter_casts")]
    adapters = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def counted(per_use: bool) -> tuple[AdapterCastCounter, int]:
        fused[0].adapter_casts.disabled = per_use
        try:
            with AdapterCastCounter(adapters) as counter:
                training_step(model, batch, "new", optimizer)
        finally:
            fused[0].adapter_casts.disabled = False
        return counter, len(fused)

    return counted


def test_a_bf16_training_step_casts_the_adapters_once_each_way(step):
    counter, layers = step(per_use=False)
    assert layers == 4 * 7
    assert (counter.forward, len(counter.backward)) == (1, 1)


def test_negative_control_the_per_use_casts_are_counted(step):
    counter, layers = step(per_use=True)
    assert (counter.forward, len(counter.backward)) == (2 * layers, 2 * layers)  # A and B, each way, each layer



STEP_CASTS = 90  # every cast of the step: 123 before the concept inputs joined the stream in its dtype (issue 39)


def test_a_bf16_streaming_step_casts_at_most_its_bar(step, monkeypatch):
    """All the step's casts (not only the adapters'): the middle and deep stacks run a bf16 stream, so their
    projections' inputs, RoPE's and SDPA's q and k and the residual adds' gradients are not cast (11 per layer
    in this step). The bar only goes down. Negative control: the fp32 join (the concept inputs left in their
    modules' dtype, as before) is over it."""
    counter, _ = step(per_use=False)
    joined = ConceptEmission.concept_inputs
    monkeypatch.setattr(ConceptEmission, "concept_inputs", lambda self, *a, **kw: joined(self, *a, **kw).float())
    fp32_join, _ = step(per_use=False)
    assert counter.count <= STEP_CASTS < fp32_join.count


def test_a_model_made_under_inference_mode_runs_under_autocast():
    """A model made (or loaded) under ``torch.inference_mode`` holds inference tensors, which keep no version counter:
    the caches keyed on a tensor's version (the adapters' eager cast, the deferred logits' watched head, the policy's
    target ratio) read ``concept.lazy.tensor_version`` (-1 there), so its bf16 forward runs and equals the same model's
    made outside it. (Before, ``RuntimeError: Inference tensors do not track version counter``.)"""
    from concept.lazy import tensor_version

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        made_inside = model_of("streaming", split=(1, 2, 1)).eval()
        assert all(p.is_inference() for p in made_inside.parameters())
        assert tensor_version(next(made_inside.parameters())) == -1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = made_inside(ids).logits
    made_outside = model_of("streaming", split=(1, 2, 1)).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outside = made_outside(ids).logits
    torch.testing.assert_close(inside, outside)
