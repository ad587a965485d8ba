"""The `xformers` backend: both its layouts (gathered, shared-prefix) are exactly the one-pass rule.

On CPU (CI) the kernels cannot run, so the biases themselves are checked: materialised over small
layouts (every edge pattern of the equivalence tests, padding, packed documents, ``emit`` > 1, rows
without concepts / tails / real tokens, long documents), each key slot mapped back to its position,
and the allowed set compared with ``concept.packing.allowed`` with no key counted twice. Both layouts
then run with reference kernels (the shared one: partials merged by their log-sum-exps, and its
split-key backward) against the dense-mask ``sdpa`` backend, outputs and gradients, and in whole
models against the naive per-step reference (here, test_equivalence and test_decoding); the shared
layout also through xformers' entry points emulated in torch (both log-sum-exp layouts). Negative
controls: broken partials, a wrong merge, a wrong backward. The CUDA kernels against the reference
kernels run where a GPU is (``-m cuda``).
"""
from __future__ import annotations

import pytest
import torch

attn_bias = pytest.importorskip("xformers.ops.fmha", reason="the xformers extra is not installed").attn_bias

import concept
from concept import ComponentRef
from concept.attention import sdpa
from concept.errors import ConceptError
from concept.packing import allowed, pack
from concept_plugins.attention.auto import AutoBackend
from concept_plugins.attention.shared_prefix import MergedAttention, ReferencePartials
from concept_plugins.attention.xformers import (XFormersBackend, XFormersConfig, XFormersPattern, gathered_keys,
                                                kernel_unavailable, query_blocks, shared_partials)
from tests.conftest import assert_packed_documents_equal_separate_rows, randomize_new_modules, tiny_config
from tests.reference import reference_logits
from tests.test_cli import TINY, fails, invoke, ok
from tests.test_equivalence import (ATOL, PATTERNS, assert_gradients_match_naive, assert_padded_batch_matches_naive,
                                    inputs, padded_batch, pattern)

T = 12


def layout_inputs():
    """(name, pack arguments): every edge pattern, a padded batch, packed documents, emit > 1, mixed
    rows (no concepts / no tail / no real token / left padding), long documents."""
    out = [(name, (pattern(name)[None], torch.ones(1, T, dtype=torch.bool), None, 1)) for name in PATTERNS]
    _, mask, keep = padded_batch()
    out.append(("padded", (keep, mask.bool(), None, 1)))
    keep = torch.tensor([[0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1]],
                        dtype=torch.bool)
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 10 + [2] * 3])
    valid = torch.ones_like(keep)
    valid[1, 14:] = False
    out.append(("packed", (keep, valid, doc, 1)))
    out.append(("packed-emit2", (keep, valid, doc, 2)))
    out.append(("rate-0.5-emit3", (pattern("rate-0.5")[None], torch.ones(1, T, dtype=torch.bool), None, 3)))
    # rows with no concepts, only concepts, no real token at all, and left padding, side by side
    keep = torch.stack([pattern("none"), pattern("all"), pattern("runs"), pattern("runs")])
    valid = torch.ones_like(keep)
    valid[2] = False
    valid[3, :5] = False
    out.append(("mixed-rows", (keep, valid, None, 1)))
    # longer documents: concept prefixes up to ~20 (five prefix levels), runs across documents
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(2, 80, generator=g) < 0.4
    doc = torch.tensor([[0] * 30 + [1] * 50, [0] * 10 + [1] * 45 + [2] * 25])
    valid = torch.ones_like(keep)
    valid[1, 73:] = False
    out.append(("long-docs", (keep, valid, doc, 1)))
    return out


def packed(args, device="cpu"):
    keep, valid, doc, emit = args
    return pack(keep.to(device), valid.to(device), None if doc is None else doc.to(device), emit=emit)


LAYOUTS = [(name, packed(args)) for name, args in layout_inputs()]
IDS = [name for name, _ in LAYOUTS]


CPU = torch.device("cpu")


def implied_pairs(partials, n):
    """How often the partials' biases allow each (query slot, key slot) pair: [n, n] counts over flat
    slots. ``partials``: (q_index, kv_index, bias) triples."""
    counts = torch.zeros(n, n, dtype=torch.long)
    for q_index, kv_index, bias in partials:
        ok_ = bias.materialize((q_index.numel(), kv_index.numel()), dtype=torch.float32) == 0
        rows, cols = ok_.nonzero().unbind(1)
        counts.index_put_((q_index[rows], kv_index[cols]), torch.ones_like(rows), accumulate=True)
    return counts


def gathered_partial(layout, bias_class=attn_bias.BlockDiagonalCausalFromBottomRightMask):
    blocks = query_blocks(layout)
    kv_index, kv_lens = gathered_keys(*blocks)
    return blocks.q_index, kv_index, bias_class.from_seqlens(blocks.q_lens.tolist(), kv_lens.tolist(), device=CPU)


def shared_triples(layout):
    return [(p.q_index, p.kv_index, p.bias) for p in shared_partials(query_blocks(layout), CPU)]


def expected_allowed(layout):
    meta = layout.meta
    B, L = meta.time.shape
    rule = allowed(meta, meta)
    dense = torch.zeros(B * L, B * L, dtype=torch.bool)
    for b in range(B):
        dense[b * L:(b + 1) * L, b * L:(b + 1) * L] = rule[b]
    return dense


def assert_is_the_rule(layout, partials):
    """Every real query is allowed exactly the keys of the one-pass rule, none of them twice
    (padding queries are left out)."""
    real = layout.meta.valid.reshape(-1)
    counts = implied_pairs(partials, real.numel())
    assert counts.max() <= 1, "a query reads one key slot twice"
    assert torch.equal(counts[real] > 0, expected_allowed(layout)[real])
    assert not counts[~real].any()


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=IDS)
def test_gathered_bias_is_the_one_pass_rule(name, layout):
    assert_is_the_rule(layout, [gathered_partial(layout)])


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=IDS)
def test_shared_partials_are_the_one_pass_rule(name, layout):
    """The local partial and the prefix levels together allow exactly the rule, each pair once
    (disjoint key sets: what makes the log-sum-exp merge exact)."""
    assert_is_the_rule(layout, shared_triples(layout))


def test_negative_control_top_left_causal_blocks_break_the_rule():
    """The same gathering with causal-from-top-left blocks hides the concept prefix: caught."""
    _, layout = LAYOUTS[IDS.index("runs")]
    with pytest.raises(AssertionError):
        assert_is_the_rule(layout, [gathered_partial(layout, attn_bias.BlockDiagonalCausalMask)])


def _drop_top_level(parts):
    return parts[:-1]


def _shift_intervals(parts):  # every prefix interval one concept late (an offset off by one)
    return parts[:1] + [(q, kv + 1, bias) for q, kv, bias in parts[1:]]


def _local_not_causal(parts):  # square blocks without the causal rule: a segment sees its future
    q, kv, bias = parts[0]
    return [(q, kv, attn_bias.BlockDiagonalMask(q_seqinfo=bias.q_seqinfo, k_seqinfo=bias.k_seqinfo))] + parts[1:]


@pytest.mark.parametrize("corrupt", [_drop_top_level, _shift_intervals, _local_not_causal],
                         ids=["drop-top-level", "shift-intervals", "local-not-causal"])
def test_negative_control_broken_shared_partials_are_caught(corrupt):
    _, layout = LAYOUTS[IDS.index("long-docs")]
    with pytest.raises(AssertionError):
        assert_is_the_rule(layout, corrupt(shared_triples(layout)))


def test_gathered_keys_count():
    """A segment's keys are its document's earlier concepts plus its own tokens (about C^2/2 repeats)."""
    keep = (torch.arange(16) % 4 == 3)[None]  # a concept every 4th token: 4 concepts, segments of 3 tail tokens
    blocks = query_blocks(pack(keep, torch.ones_like(keep)))
    kv_index, kv_lens = gathered_keys(*blocks)
    assert blocks.q_lens.tolist() == [4, 3, 3, 3, 3]
    assert kv_lens.tolist() == [4, 3, 3 + 1, 3 + 2, 3 + 3]
    assert kv_index.numel() == 4 + 12 + (1 + 2 + 3)


def test_shared_prefix_levels():
    """Prefixes of 0..3 concepts: level 0 reads the odd prefixes' last concept, level 1 the first two
    concepts of prefixes 2 and 3; every key is one slot of the plain sequence, none copied per segment."""
    keep = (torch.arange(16) % 4 == 3)[None]
    layout = pack(keep, torch.ones_like(keep))
    local, level0, level1 = shared_partials(query_blocks(layout), CPU)
    assert torch.equal(local.kv_index, local.q_index)
    tail = layout.num_concepts + torch.arange(12).view(4, 3)  # tail slots by segment (prefix 0, 1, 2, 3)
    assert torch.equal(level0.q_index, torch.cat([tail[1], tail[3]])) and level0.kv_index.tolist() == [0, 2]
    assert torch.equal(level1.q_index, tail[2:].reshape(-1)) and level1.kv_index.tolist() == [0, 1]
    assert level1.bias.q_seqinfo.seqstart_py == [0, 6] and level1.bias.k_seqinfo.seqstart_py == [0, 2]


def _qkv(B, L, H=4, Hkv=2, hd=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, hd, generator=g) for h in (H, Hkv, Hkv))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def attention_and_grads(layout, attend):
    """``attend(q, k, v)`` -> [B, L, H, hd] on fixed inputs with grouped-query heads: its valid
    outputs, its padding outputs, and the gradients of the valid outputs' sum."""
    B, L = layout.meta.time.shape
    valid = layout.meta.valid
    q, k, v = _qkv(B, L, grad=True)
    out = attend(q, k, v)
    return out[valid], out[~valid], torch.autograd.grad(out[valid].sum(), (q, k, v))


def dense_mask_sdpa(layout):
    return lambda q, k, v: sdpa(q, k, v, 0.35, allowed(layout.meta, layout.meta)).transpose(1, 2)


def assert_matches_dense_mask_sdpa(layout, attend, atol=1e-5):
    out, padding, grads = attention_and_grads(layout, attend)
    ref, _, ref_grads = attention_and_grads(layout, dense_mask_sdpa(layout))
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    assert (padding == 0).all()
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=atol, rtol=atol)


@pytest.mark.parametrize("layout_name", ["gathered", "shared"])
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=IDS)
def test_reference_kernel_matches_dense_mask_sdpa(name, layout, layout_name):
    """Each layout with the materialised biases (the shared one: partials merged by their
    log-sum-exps, the split-key backward) equals SDPA under the dense one-pass mask, outputs and
    gradients, with grouped-query heads."""
    plan = XFormersPattern(layout, XFormersConfig(kernel="reference", layout=layout_name))
    assert_matches_dense_mask_sdpa(layout, lambda q, k, v: plan(q, k, v, 0.35))
    assert plan.chosen == layout_name


class AveragingMerge(ReferencePartials):
    """A wrong merge: every partial's log-sum-exp reported as 0, so the partials are averaged."""

    def forward(self, q, k, v, bias, scale):
        out, lse, state = super().forward(q, k, v, bias, scale)
        return out, torch.zeros_like(lse), state


class OwnLSEBackward(ReferencePartials):
    """A wrong backward: each partial's softmax normalised over its own keys, not the merged ones."""

    def backward(self, d_out, out, lse, q, k, v, bias, scale, state=None):
        return super().backward(d_out, out, self.forward(q, k, v, bias, scale)[1], q, k, v, bias, scale, state)


@pytest.mark.parametrize("wrong", [AveragingMerge, OwnLSEBackward])
def test_negative_control_wrong_merge_is_caught(wrong):
    _, layout = LAYOUTS[IDS.index("long-docs")]
    B, L = layout.meta.time.shape
    partials = XFormersPattern(layout, XFormersConfig(kernel="reference")).shared()

    def merged(kernels):
        def attend(q, k, v):
            flat = [t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[-1]) for t in (q, k, v)]
            return MergedAttention.apply(*flat, partials, kernels, 0.35).view(B, L, q.shape[1], -1)
        return attend

    assert_matches_dense_mask_sdpa(layout, merged(ReferencePartials()))
    with pytest.raises(AssertionError):
        assert_matches_dense_mask_sdpa(layout, merged(wrong()))


def fake_kernels(lse_format: str):
    """xformers' forward-with-LSE and backward entry points emulated in torch, with the log-sum-exp
    in a kernel's own layout: "packed" [1, H, >= M] (flash) or "per-block" [blocks, H, >= longest]
    (cutlass), the unused entries filled with NaN so that reading one shows."""

    def spans(bias):
        starts = bias.q_seqinfo.seqstart_py
        return list(enumerate(zip(starts, starts[1:])))

    def forward(q, k, v, attn_bias, scale):
        out, lse, _ = ReferencePartials().forward(q[0], k[0], v[0], attn_bias, scale)
        M, H = lse.shape
        if lse_format == "packed":
            kernel_lse = torch.full((1, H, M + 3), float("nan"))
            kernel_lse[0, :, :M] = lse.T
        else:
            longest = max(e - s for _, (s, e) in spans(attn_bias))
            kernel_lse = torch.full((len(spans(attn_bias)), H, longest + 3), float("nan"))
            for b, (s, e) in spans(attn_bias):
                kernel_lse[b, :, :e - s] = lse[s:e].T
        return out[None].to(q.dtype), kernel_lse

    def backward(grad, output, lse, q, k, v, attn_bias, scale):
        if lse_format == "packed":
            flat = lse[0, :, :q.shape[1]].T
        else:
            flat = torch.cat([lse[b, :, :e - s].T for b, (s, e) in spans(attn_bias)])
        grads = ReferencePartials().backward(grad[0], output[0], flat, q[0], k[0], v[0], attn_bias, scale)
        return tuple(g[None] for g in grads)

    return forward, backward


@pytest.mark.parametrize("lse_format", ["packed", "per-block"])
def test_xformers_partials_read_and_write_the_kernels_lse_layouts(monkeypatch, lse_format):
    """The shared layout through the xformers entry points (emulated on CPU): the log-sum-exp is read
    per query from the kernel's layout for the merge, and the merged one written back into that
    layout for the backward."""
    from concept_plugins.attention import xformers as plugin

    forward, backward = fake_kernels(lse_format)
    monkeypatch.setattr(plugin._fmha(), "memory_efficient_attention_forward_requires_grad", forward)
    monkeypatch.setattr(plugin._fmha(), "memory_efficient_attention_backward", backward)
    _, layout = LAYOUTS[IDS.index("long-docs")]
    plan = XFormersPattern(layout, XFormersConfig(layout="shared"))
    assert_matches_dense_mask_sdpa(layout, lambda q, k, v: plan(q, k, v, 0.35))


def test_memory_limit_is_a_clear_error():
    """A forced gathered layout over the limit is refused, naming the shared layout and the other backends."""
    _, layout = LAYOUTS[IDS.index("rate-0.5")]
    plan = XFormersPattern(layout, XFormersConfig(kernel="reference", layout="gathered", memory_limit_gib=1e-9))
    with pytest.raises(ConceptError, match="gathered key/value layout needs .* attention.layout=shared .*--attention flex"):
        plan(*_qkv(1, layout.length), 0.35)


def test_auto_layout_is_chosen_by_the_gathered_size():
    """auto: gathered while its K/V of one layer is at most gathered_max_mib and fits the memory
    limit, else shared; decided once per forward."""
    _, layout = LAYOUTS[IDS.index("long-docs")]
    B, L = layout.meta.time.shape
    need = 2 * XFormersPattern(layout, XFormersConfig()).num_keys * 4 * 8 * 4  # K and V, 4 heads of 8, fp32

    def chosen(**options):
        plan = XFormersPattern(layout, XFormersConfig(kernel="reference", **options))
        with torch.no_grad():
            plan(*_qkv(B, L, H=4, Hkv=4), 0.35)
        return plan.chosen

    assert chosen(gathered_max_mib=need / 2**20) == "gathered"
    assert chosen(gathered_max_mib=(need - 1) / 2**20) == "shared"
    assert chosen(memory_limit_gib=(need - 1) / 2**30) == "shared"  # over the limit: shared, not an error
    assert chosen(layout="shared", gathered_max_mib=1e6) == "shared"
    assert chosen(layout="gathered", gathered_max_mib=0) == "gathered"


def test_config_validation():
    assert XFormersConfig().validate() == []
    problems = XFormersConfig(kernel="cutlass", layout="copied", gathered_max_mib=-1, memory_limit_gib=-1).validate()
    assert [p.split(":")[0] for p in problems] == ["kernel", "layout", "gathered_max_mib", "memory_limit_gib"]


def test_a_batch_without_real_tokens_gives_zeros():
    keep = torch.zeros(2, 6, dtype=torch.bool)
    layout = pack(keep, keep)
    for name in ("gathered", "shared"):
        out = XFormersPattern(layout, XFormersConfig(kernel="reference", layout=name))(*_qkv(2, layout.length), 0.35)
        assert out.shape == (2, layout.length, 4, 8) and (out == 0).all()


SHARED = {"kernel": "reference", "layout": "shared"}


@pytest.fixture(scope="module")
def shared_model():
    """A tiny model whose deep stack runs the shared-prefix layout (reference kernels)."""
    cfg = tiny_config(attention="xformers")
    cfg.attention = ComponentRef("xformers", SHARED)
    return randomize_new_modules(concept.build(cfg))


@pytest.mark.parametrize("name", PATTERNS)
def test_shared_layout_model_matches_naive(shared_model, name):
    """Whole model, every edge pattern: the one pass with the shared-prefix layout equals the naive
    per-step reference (tests/reference.py)."""
    ids, keep = inputs(), pattern(name)[None]
    with torch.no_grad():
        out = shared_model(ids, keep=keep)
        ref, _ = reference_logits(shared_model, ids, keep=keep)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


def test_shared_layout_model_padded_batch_documents_and_gradients_match_naive(shared_model):
    """Padding (right and left), packed documents, and the gradients of every trainable parameter."""
    assert_padded_batch_matches_naive(shared_model)
    keep = torch.tensor([[0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert_packed_documents_equal_separate_rows(shared_model, inputs(B=1, T=16, seed=7), keep, ATOL)
    grads = assert_gradients_match_naive(shared_model)
    assert any(n.startswith("vocabulary.head") for n in grads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_machine_refuses_the_kernel_clearly(tmp_path):
    assert "CUDA" in kernel_unavailable()
    assert "CUDA" in XFormersBackend.unavailable_reason()
    assert AutoBackend.choice("cpu") == "chunked"  # auto never picks xformers on CPU
    listed = ok(invoke("plugins", "list", "--check"))
    assert "xformers" in listed.output and "needs a CUDA device" in listed.output
    fails(invoke("build", *TINY, "--attention", "xformers", "-o", tmp_path / "x"), 2,
          "needs a CUDA device", "--attention flex (CUDA) or chunked")
    assert not (tmp_path / "x").exists()
    # the exact, slow reference kernel builds anywhere
    ok(invoke("build", *TINY, "--attention", "xformers", "--set", "attention.kernel=reference", "-o", tmp_path / "r"))


CUDA_KERNEL = pytest.mark.skipif(bool(kernel_unavailable()), reason="needs CUDA and xformers' CUDA kernels")


@pytest.mark.cuda
@CUDA_KERNEL
@pytest.mark.parametrize("layout_name", ["gathered", "shared"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name,args", layout_inputs(), ids=IDS)
def test_cuda_kernel_matches_reference(name, args, dtype, atol, layout_name):
    """xformers' kernels against the reference kernels on the same layout, outputs and gradients
    (the shared layout: the kernels' partials, their log-sum-exps and their split-key backward)."""
    layout = packed(args, "cuda")
    B, L = layout.meta.time.shape
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in _qkv(B, L, hd=64))
    valid = layout.meta.valid
    fast = XFormersPattern(layout, XFormersConfig(layout=layout_name))(q, k, v, 0.125)
    slow = XFormersPattern(layout, XFormersConfig(kernel="reference", layout=layout_name))(q, k, v, 0.125)
    torch.testing.assert_close(fast[valid].float(), slow[valid].float(), atol=atol, rtol=atol)
    grads = torch.autograd.grad(fast[valid].float().sum(), (q, k, v))
    ref = torch.autograd.grad(slow[valid].float().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=10 * atol, rtol=10 * atol)
    with torch.no_grad():  # forward only (gathered: the grouped 5-D call)
        again = XFormersPattern(layout, XFormersConfig(layout=layout_name))(q, k, v, 0.125)
    torch.testing.assert_close(again[valid].float(), slow[valid].float(), atol=atol, rtol=atol)


def test_an_xformers_build_without_cuda_kernels_is_named(monkeypatch):
    """The probe asks xformers' own dispatch with a real call: on this CPU it refuses (as it refused every call
    on the GPU image of 2026-11-27, where each operator's ``is_available()`` was true), and the build says so."""
    from concept_plugins.attention import xformers as plugin

    monkeypatch.setattr(plugin, "PROBE_DEVICE", "cpu")
    reason = kernel_unavailable()
    assert reason.startswith("xformers ") and "refuses every attention call here" in reason, reason
    assert "device=cpu" in reason
    problems = XFormersBackend.check_compatible(XFormersConfig(), {})
    assert len(problems) == 1 and "refuses every attention call" in problems[0] and "--attention flex" in problems[0]
    assert XFormersBackend.check_compatible(XFormersConfig(kernel="reference"), {}) == []


LEASE_REFUSAL = """No operator found for `memory_efficient_attention_forward` with inputs:
     query       : shape=(1, 8192, 9, 64) (torch.bfloat16)
     attn_bias   : <class 'xformers.ops.fmha.attn_bias.BlockDiagonalCausalMask'>
     p           : 0.0
`fa3F@0.0.0` is not supported because:
    xFormers wasn't build with CUDA support
    operator wasn't built - see `python -m xformers.info` for more info
`fa2F@2.5.7-pt` is not supported because:
    xFormers wasn't build with CUDA support
`cutlassF-pt` is not supported because:
    xFormers wasn't build with CUDA support"""


def test_the_probe_reports_the_leases_refusal_and_passes_a_working_kernel():
    """The H100 image's refusal (speed call 5, 2026-11-27) in one line naming each operator; a kernel that
    runs the tiny call is '' (the negative control: the probe does not refuse everything)."""
    from types import SimpleNamespace

    from concept_plugins.attention import xformers as plugin

    def refusing(*args, **kwargs):
        raise NotImplementedError(LEASE_REFUSAL)

    bias = plugin._fmha().attn_bias
    reason = plugin.probe(SimpleNamespace(memory_efficient_attention=refusing, attn_bias=bias), torch.device("cpu"))
    assert ("`fa3F@0.0.0`: xFormers wasn't build with CUDA support, operator wasn't built" in reason
            and "`fa2F@2.5.7-pt`: xFormers wasn't build with CUDA support; `cutlassF-pt`:" in reason), reason
    assert "query" not in reason and "\n" not in reason
    works = SimpleNamespace(memory_efficient_attention=lambda q, k, v, attn_bias: q, attn_bias=bias)
    assert plugin.probe(works, torch.device("cpu")) == ""


def test_auto_never_chooses_xformers(monkeypatch):
    """On CUDA `auto` is `flex` (or `chunked` without FlexAttention), whether or not xformers' kernels run."""
    from concept_plugins.attention import auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert AutoBackend.choice("cuda") == "flex" and AutoBackend.choice("cpu") == "chunked"
    monkeypatch.setattr(auto, "_flex_available", lambda: False)
    assert AutoBackend.choice("cuda") == "chunked"


@pytest.mark.parametrize("layout_name,kernel", [("gathered", "memory_efficient_attention"),
                                                ("shared", "memory_efficient_attention_forward_requires_grad")])
def test_inputs_no_kernel_accepts_are_a_clear_error(monkeypatch, layout_name, kernel):
    """xformers' "No operator found" (a head dim or dtype its kernels refuse) becomes one line naming
    the backends to use instead."""
    from concept_plugins.attention import xformers as plugin

    def refuse(*args, **kwargs):
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs:\n"
                                  "`cutlassF` is not supported because:\n    max(query.shape[-1]) > 256")

    monkeypatch.setattr(plugin._fmha(), kernel, refuse)
    _, layout = LAYOUTS[IDS.index("runs")]
    with pytest.raises(ConceptError, match=r"no xformers kernel accepts .*max\(query.shape\[-1\]\) > 256.*--attention flex"):
        XFormersPattern(layout, XFormersConfig(layout=layout_name))(*_qkv(1, layout.length), 0.35)
