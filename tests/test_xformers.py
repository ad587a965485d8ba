"""The `xformers` backend: its gathered block-diagonal layout is exactly the one-pass rule.

On CPU (CI) the kernel cannot run, so the bias itself is checked: materialised over small layouts
(every edge pattern of the equivalence tests, padding, packed documents, ``emit`` > 1), each
gathered key slot mapped back to its position, and the allowed set compared with
``concept.packing.allowed`` with no key counted twice. The gathered layout then runs as a float
reference attention against the dense-mask ``sdpa`` backend (here and, with whole models, in
test_equivalence / test_decoding). The CUDA kernel against that reference runs where a GPU is.
"""
from __future__ import annotations

import pytest
import torch
from xformers.ops.fmha import attn_bias

from concept.attention import sdpa
from concept.errors import ConceptError
from concept.packing import allowed, pack
from concept_plugins.attention.auto import AutoBackend
from concept_plugins.attention.xformers import (XFormersBackend, XFormersConfig, XFormersPlan, block_layout,
                                                kernel_unavailable)
from tests.test_cli import TINY, fails, invoke, ok
from tests.test_equivalence import PATTERNS, padded_batch, pattern

T = 12


def layout_inputs():
    """(name, pack arguments): every edge pattern, a padded batch, packed documents, emit > 1."""
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
    return out


def packed(args, device="cpu"):
    keep, valid, doc, emit = args
    return pack(keep.to(device), valid.to(device), None if doc is None else doc.to(device), emit=emit)


LAYOUTS = [(name, packed(args)) for name, args in layout_inputs()]
IDS = [name for name, _ in LAYOUTS]


def gathered_allowed(layout, bias_class=attn_bias.BlockDiagonalCausalFromBottomRightMask):
    """The [B*L, B*L] allowed matrix the gathered layout + bias implies (and whether a key repeats)."""
    q_index, kv_index, q_lens, kv_lens = block_layout(layout)
    bias = bias_class.from_seqlens(q_lens.tolist(), kv_lens.tolist(), device=torch.device("cpu"))
    ok_ = bias.materialize((q_index.numel(), kv_index.numel()), dtype=torch.float32) == 0
    n = layout.meta.time.numel()
    implied = torch.zeros(n, n, dtype=torch.bool)
    repeats = False
    for i, q in enumerate(q_index.tolist()):
        keys = kv_index[ok_[i]].tolist()
        repeats |= len(keys) != len(set(keys))
        implied[q, keys] = True
    return implied, q_index, repeats


def expected_allowed(layout):
    meta = layout.meta
    B, L = meta.time.shape
    rule = allowed(meta, meta)
    dense = torch.zeros(B * L, B * L, dtype=torch.bool)
    for b in range(B):
        dense[b * L:(b + 1) * L, b * L:(b + 1) * L] = rule[b]
    return dense


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=IDS)
def test_gathered_bias_is_the_one_pass_rule(name, layout):
    implied, q_index, repeats = gathered_allowed(layout)
    expected = expected_allowed(layout)
    assert not repeats, "a query sees one key slot twice"
    assert torch.equal(implied[q_index], expected[q_index])  # every real query (padding queries are left out)
    assert q_index.numel() == int(layout.meta.valid.sum())


def test_negative_control_top_left_causal_blocks_break_the_rule():
    """The same gathering with causal-from-top-left blocks hides the concept prefix: caught."""
    _, layout = LAYOUTS[PATTERNS.index("runs")]
    implied, q_index, _ = gathered_allowed(layout, attn_bias.BlockDiagonalCausalMask)
    assert not torch.equal(implied[q_index], expected_allowed(layout)[q_index])


def test_gathered_keys_count():
    """A segment's keys are its document's earlier concepts plus its own tokens (about C^2/2 repeats)."""
    keep = (torch.arange(16) % 4 == 3)[None]  # a concept every 4th token: 4 concepts, segments of 3 tail tokens
    q_index, kv_index, q_lens, kv_lens = block_layout(pack(keep, torch.ones_like(keep)))
    assert q_lens.tolist() == [4, 3, 3, 3, 3]
    assert kv_lens.tolist() == [4, 3, 3 + 1, 3 + 2, 3 + 3]
    assert kv_index.numel() == 4 + 12 + (1 + 2 + 3)


def _qkv(B, L, H=4, Hkv=2, hd=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, hd, generator=g) for h in (H, Hkv, Hkv))
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=IDS)
def test_reference_kernel_matches_dense_mask_sdpa(name, layout):
    """The gathered layout with the materialised bias equals SDPA under the dense one-pass mask,
    outputs and gradients, with grouped-query heads."""
    B, L = layout.meta.time.shape
    plan = XFormersPlan(layout, XFormersConfig(kernel="reference"))
    valid = layout.meta.valid
    q, k, v = _qkv(B, L, grad=True)
    out = plan(q, k, v, 0.35)
    ref = sdpa(q, k, v, 0.35, allowed(layout.meta, layout.meta)).transpose(1, 2)
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=1e-5)
    assert (out[~valid] == 0).all()
    grads = torch.autograd.grad(out[valid].sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref[valid].sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_memory_limit_is_a_clear_error():
    _, layout = LAYOUTS[PATTERNS.index("rate-0.5")]
    plan = XFormersPlan(layout, XFormersConfig(kernel="reference", memory_limit_gib=1e-9))
    with pytest.raises(ConceptError, match="gathered key/value layout needs .* use --attention flex"):
        plan(*_qkv(1, layout.length), 0.35)


def test_config_validation():
    assert XFormersConfig().validate() == []
    problems = XFormersConfig(kernel="cutlass", memory_limit_gib=-1).validate()
    assert len(problems) == 2 and "kernel" in problems[0]


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


@CUDA_KERNEL
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name,args", layout_inputs(), ids=IDS)
def test_cuda_kernel_matches_reference(name, args, dtype, atol):
    layout = packed(args, "cuda")
    B, L = layout.meta.time.shape
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in _qkv(B, L, hd=64))
    valid = layout.meta.valid
    fast = XFormersPlan(layout, XFormersConfig())(q, k, v, 0.125)
    slow = XFormersPlan(layout, XFormersConfig(kernel="reference"))(q, k, v, 0.125)
    torch.testing.assert_close(fast[valid].float(), slow[valid].float(), atol=atol, rtol=atol)
    grads = torch.autograd.grad(fast[valid].float().sum(), (q, k, v))
    ref = torch.autograd.grad(slow[valid].float().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=10 * atol, rtol=10 * atol)
    with torch.no_grad():  # forward only: the grouped (5-D) call
        torch.testing.assert_close(XFormersPlan(layout, XFormersConfig())(q, k, v, 0.125)[valid].float(),
                                   slow[valid].float(), atol=atol, rtol=atol)


def test_an_xformers_build_without_cuda_kernels_is_named(monkeypatch):
    from concept_plugins.attention.xformers import _fmha

    fmha = _fmha()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("cutlass", "flash", "flash3"):
        if getattr(fmha, name, None) is not None:
            monkeypatch.setattr(getattr(fmha, name).FwOp, "is_available", classmethod(lambda cls: False))
    assert "has no CUDA attention kernels" in kernel_unavailable()
    problems = XFormersBackend.check_compatible(XFormersConfig(), {})
    assert len(problems) == 1 and "--attention flex" in problems[0]
    assert XFormersBackend.check_compatible(XFormersConfig(kernel="reference"), {}) == []


def test_inputs_no_kernel_accepts_are_a_clear_error(monkeypatch):
    """xformers' "No operator found" (a head dim or dtype its kernels refuse) becomes one line naming
    the backends to use instead."""
    from concept_plugins.attention import xformers as plugin

    def refuse(*args, **kwargs):
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs:\n"
                                  "`cutlassF` is not supported because:\n    max(query.shape[-1]) > 256")

    monkeypatch.setattr(plugin._fmha(), "memory_efficient_attention", refuse)
    _, layout = LAYOUTS[PATTERNS.index("runs")]
    with pytest.raises(ConceptError, match=r"no xformers kernel accepts .*max\(query.shape\[-1\]\) > 256.*--attention flex"):
        XFormersPlan(layout, XFormersConfig())(*_qkv(1, layout.length), 0.35)
