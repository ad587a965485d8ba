"""The training CE without the batch's logits (``concept.losses.head_cross_entropy``): equal to the plain
``F.cross_entropy`` of the materialised logits, loss and gradients, in fp32 (<= 1e-6 relative), alone and
inside every model kind that computes a next-token CE (streaming, dense, pruned, planner-executor);
a training step never builds more than a chunk of logits (a ``TorchDispatchMode`` watches every op's
output), while the logits stay readable on the output (``concept.lazy``). Negative controls: a loss that
counts the ignored rows or drops the last partial chunk is caught by the same comparison, and today's
path (the CE read from ``out.logits``) builds the [B, T, V] logits the step check refuses.
"""
import pytest
import torch
import torch.nn.functional as F

import concept
import concept.losses as losses
from benchmarks.step_counts import StepCounter, training_step
from concept.dense import DenseModel
from concept.lazy import LazyField
from concept.lora import LoraSettings, add_lora
from concept.losses import IGNORE, head_cross_entropy, next_token_loss
from concept.planner.model import text_loss
from concept.precision import store_frozen_base
from tests.conftest import randomize_new_modules, tiny_config
from tests.test_planner_executor import built as planner_built

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-6  # relative, the loss and every gradient (max |diff| / max |reference|)
V = 97  # the tiny backbones' vocabulary


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def case(N=50, d=16, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, requires_grad=True)
    head = torch.nn.Linear(d, vocab)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g))
        head.bias.copy_(torch.randn(vocab, generator=g))
    target = torch.randint(0, vocab, (N,), generator=g)
    target[::7] = IGNORE
    return x, head, target


def loss_and_grads(fn, x, head, scale=2.5):
    x.grad = head.weight.grad = head.bias.grad = None
    loss = fn()
    (scale * loss).backward()
    return [loss.detach(), x.grad, head.weight.grad, head.bias.grad]


def assert_same(got, ref):
    for g, r, what in zip(got, ref, ("loss", "grad x", "grad weight", "grad bias")):
        assert relative(g, r) <= RTOL, (what, relative(g, r))


def test_chunked_linear_ce_equals_the_plain_ce_loss_and_gradients():
    x, head, target = case()
    ref = loss_and_grads(lambda: F.cross_entropy(head(x), target, ignore_index=IGNORE), x, head)
    for rows in (1, 7, 50, 64):  # chunks of one row, a partial last chunk, exactly one, more than all
        assert_same(loss_and_grads(lambda: head_cross_entropy(x, head, target, chunk_logits=rows * 37), x, head), ref)
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        assert relative(head_cross_entropy(x, head, target, chunk_logits=7 * 37), ref[0]) <= RTOL
    head.weight.requires_grad_(False)  # a frozen head (the LM head is): only x's gradient
    x.grad = head.weight.grad = None
    head_cross_entropy(x, head, target, chunk_logits=7 * 37).backward()
    assert head.weight.grad is None and relative(2.5 * x.grad, ref[1]) <= RTOL
    nothing = torch.full_like(target, IGNORE)  # no counted row: NaN, as F.cross_entropy
    assert torch.isnan(head_cross_entropy(x, head, nothing)) and torch.isnan(F.cross_entropy(head(x), nothing))


@pytest.mark.parametrize("broken", ["ignored rows counted", "last chunk dropped"])
def test_negative_control_the_comparison_catches_a_broken_chunked_loss(broken):
    x, head, target = case()
    ref = loss_and_grads(lambda: F.cross_entropy(head(x), target, ignore_index=IGNORE), x, head)
    if broken == "ignored rows counted":
        fn = lambda: head_cross_entropy(x, head, target.clamp(min=0), chunk_logits=7 * 37)  # noqa: E731
    else:
        fn = lambda: head_cross_entropy(x[:49], head, target[:49], chunk_logits=7 * 37) * 43 / 42  # noqa: E731
    with pytest.raises(AssertionError):
        assert_same(loss_and_grads(fn, x, head), ref)


def _lora(model, seed=0):
    add_lora(model.backbone, LoraSettings(rank=2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # LoRA B starts at 0: make the adapters count
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def make(kind):
    torch.manual_seed(0)
    if kind == "planner-executor":
        return planner_built()
    if kind == "streaming":
        return _lora(randomize_new_modules(concept.build(tiny_config())))
    backbone = _lora(concept.build(tiny_config())).backbone
    return DenseModel(backbone, removed=(2, 4) if kind == "pruned" else None)


@pytest.fixture(scope="module")
def models():
    return {kind: make(kind) for kind in ("streaming", "dense", "pruned", "planner-executor")}


def batch(B=3, T=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[2, 10:] = 1  # two documents packed in a row
    return {"input_ids": ids, "attention_mask": mask, "document_ids": doc}


def today(model, b):
    """The CE as before issue 39: read from the whole batch's logits."""
    out = model(b["input_ids"], attention_mask=b["attention_mask"], document_ids=b["document_ids"])
    if hasattr(out, "y"):
        return text_loss(out.logits, out.y, out.y_valid)
    return next_token_loss(out.logits, b["input_ids"], b["attention_mask"].bool(), b["document_ids"])


def grads_of(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def gradient_error(got, ref) -> float:
    """|g - r| / |r| over every trainable parameter's gradient as one vector (fp32 rounding, propagated back
    through the layers, leaves ~1e-6 in the smallest single tensors and ~4e-7 overall)."""
    return float(torch.cat([(g - r).flatten() for g, r in zip(got, ref)]).norm() / torch.cat([r.flatten() for r in ref]).norm())


def chunked(model, b):
    ids = b["input_ids"]
    return model(ids, attention_mask=b["attention_mask"], labels=ids, document_ids=b["document_ids"]).loss


@pytest.mark.parametrize("kind", ["streaming", "dense", "pruned", "planner-executor"])
def test_every_model_kind_trains_on_the_chunked_ce(kind, models, monkeypatch):
    """model(..., labels).loss and its gradients (every trainable parameter: LoRA, new modules) equal today's
    CE read from ``out.logits``, in fp32, with the head in chunks of 8 rows; the output keeps its logits."""
    monkeypatch.setattr(losses, "CHUNK_LOGITS", 8 * V)
    model, b = models[kind].eval(), batch()  # (eval: no dropout or sampling noise between the two passes)
    ids = b["input_ids"]
    ref_loss, ref = grads_of(model, lambda: today(model, b))
    out = model(ids, attention_mask=b["attention_mask"], labels=ids, document_ids=b["document_ids"])
    assert not LazyField.computed(out, "logits")  # the loss did not build them
    loss, got = grads_of(model, lambda: chunked(model, b))
    assert relative(loss, ref_loss) <= RTOL
    assert len(got) > 10 and sum(float(g.abs().sum()) for g in got) > 0
    assert gradient_error(got, ref) <= RTOL
    with torch.no_grad():  # reading them builds the logits today's forward returned
        plain = model(ids, attention_mask=b["attention_mask"], document_ids=b["document_ids"]).logits
        assert torch.equal(out.logits.detach(), plain)
    if kind == "dense":  # negative control: a CE that lets the packed documents predict across their boundary
        wrong_loss, wrong = grads_of(model, lambda: next_token_loss(model(ids, attention_mask=b["attention_mask"],
                                                                          document_ids=b["document_ids"]).logits,
                                                                    ids, b["attention_mask"].bool()))
        assert relative(wrong_loss, ref_loss) > 100 * RTOL and gradient_error(wrong, ref) > 100 * RTOL


@pytest.mark.parametrize("kind", ["streaming", "dense"])
def test_logits_read_after_the_head_changed_are_refused(kind, models):
    """Deferred logits are the forward's or nothing: read before an optimizer step they equal an eager
    head's (control); read after it, or after a dtype move, a clear error instead of other weights' logits."""
    model, b = models[kind].eval(), batch()
    head = model.backbone.lm_head
    run = lambda: model(b["input_ids"], attention_mask=b["attention_mask"], document_ids=b["document_ids"])  # noqa: E731
    with torch.no_grad():
        before, after = run(), run()
        expected, saved = before.logits.clone(), head.weight.clone()  # read in time: fine
        head.weight.add_(1.0)  # what an optimizer step does
        try:
            with pytest.raises(RuntimeError, match="Read out.logits before changing the model"):
                after.logits
            assert torch.equal(before.logits, expected)  # already read: kept
            moved = run()
            model.double()
            with pytest.raises(RuntimeError, match="dtype/device move"):
                moved.logits
        finally:
            model.float()
            head.weight.copy_(saved)


@pytest.mark.parametrize("kind", ["streaming", "dense"])
def test_a_training_step_builds_at_most_a_chunk_of_logits(kind, monkeypatch):
    """The whole step (autocast, forward, backward, AdamW) under a dispatch mode that records the largest
    [rows, V] tensor any op made (views excluded): a chunk of 8 rows with the bf16 base; today's path (an fp32
    base, the CE read from out.logits): every position of the batch."""
    monkeypatch.setattr(losses, "CHUNK_LOGITS", 8 * V)
    b, model, rows = batch(), make(kind).train(), {}
    for version in ("today", "new"):
        if version == "new":
            store_frozen_base(model, torch.bfloat16)
        counter = StepCounter(vocab=V)
        with counter:
            assert torch.isfinite(training_step(model, b, version))
        rows[version] = counter.logit_rows
    assert rows["new"] <= 8
    assert rows["today"] >= 3 * 24  # negative control: the [B, T, V] logits


def test_bf16_chunked_ce_stays_close_to_fp32():
    """Under autocast with a bf16-stored base, the chunked CE (fp32 accumulation) equals today's bf16 CE
    (logits in bf16, upcast) to fp32 rounding, and the fp32 CE to bf16's."""
    model = DenseModel(_lora(concept.build(tiny_config())).backbone).eval()
    b, ids = batch(), batch()["input_ids"]
    with torch.no_grad():
        fp32 = today(model, b)
        store_frozen_base(model, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            old = today(model, b)
            new = model(ids, attention_mask=b["attention_mask"], labels=ids, document_ids=b["document_ids"]).loss
    assert new.dtype == torch.float32
    assert relative(new, old) <= 1e-5
    assert relative(new, fp32) <= 0.02 and new != fp32


def test_the_deep_input_is_gathered_to_time_order_only_when_read():
    """``out.deep_input`` (what the alignment objective reads) is deferred like the logits: a forward does not
    gather it; read, it is the deep stack's input in time order, bit for bit (captured at the first deep layer),
    with its gradient path. Negative control: another slot map gives other values."""
    from tests.conftest import mixed_model

    model = mixed_model("null").train()
    try:
        seen = []
        hook = model.deep[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]),
                                                       with_kwargs=True)
        try:
            ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
            out = model(ids)
        finally:
            hook.remove()
        assert not LazyField.computed(out, "deep_input")
        slots = out.layout.slot_of_time
        want = seen[0].gather(1, slots[..., None].expand(-1, -1, seen[0].shape[-1]))
        assert torch.equal(out.deep_input, want) and out.deep_input.requires_grad
        wrong = seen[0].gather(1, slots.roll(1, dims=1)[..., None].expand(-1, -1, seen[0].shape[-1]))
        assert not torch.equal(out.deep_input, wrong)
    finally:
        model.eval()
