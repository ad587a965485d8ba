"""The library on the torch the GPU machines run (2.11 on 2026-11-27's image), not only on the 2.13 of this CPU.

Run under torch 2.11 (``make image-check``, ``docs/gpu.md``), the default suite found five faults that no 2.13 run
can show, each of which would have cost a lease its compiled rows or its sync counts; four are held here on 2.13 by a
stand-in for the older torch's behaviour:

- ``import concept.compiled`` raised: ``nested_compile_region`` takes no ``max_reuse_entries`` there;
- ``model`` compiled with each layer a region failed a training step (a dynamo fault of 2.11, with the fused
  adapters' ``autograd.Function`` inside a region): a traced adapted layer runs plain ops (``tests/test_fused_lora.py``
  holds that no Function is traced), and the regions are on by default from ``REGIONS_FROM``, the oldest torch they
  were tested in;
- the ratio controller's ``torch.nanquantile`` read a device value back in every training step (2.11 checks
  ``q`` on the device: ``aten::equal``);
- the profiler's ``with_stack`` records no Python frames there: ``sync_stacks`` then come from the dispatch
  counter (``tests/test_profiling.py``).

(The fifth, a dynamo of 2.11 unable to trace ``is`` between two lists in ``StackRuns.run_stack``, is held by the
``model`` tests themselves when run on 2.11.)
"""
from __future__ import annotations

import pytest
import torch

import concept.compiled
from concept.streaming.ratio import nanquantile
from concept.syncs import HostSyncs


def test_a_region_is_made_with_the_reuse_limit_only_where_torch_takes_one(monkeypatch):
    """torch 2.13's ``nested_compile_region(fn, max_reuse_entries=...)``; 2.11's has no such keyword; before 2.8
    there is none (the layers are then traced inline). Negative control: the old call with the keyword raises on
    2.11's signature."""
    calls = []

    def region_2_11(fn=None, options=None):
        calls.append(options)
        return ("region", fn)

    monkeypatch.setattr(torch.compiler, "nested_compile_region", region_2_11)
    assert concept.compiled.layer_region(len) == ("region", len) and calls == [None]
    with pytest.raises(TypeError, match="max_reuse_entries"):
        torch.compiler.nested_compile_region(len, max_reuse_entries=32)

    def region_2_13(fn=None, options=None, max_reuse_entries=8):
        calls.append(max_reuse_entries)
        return ("region", fn)

    monkeypatch.setattr(torch.compiler, "nested_compile_region", region_2_13)
    assert concept.compiled.layer_region(len) == ("region", len) and calls[-1] == concept.compiled.REGION_REUSE
    monkeypatch.delattr(torch.compiler, "nested_compile_region")
    assert concept.compiled.layer_region(len) is None


def test_the_regions_are_on_from_the_torch_they_were_tested_in(monkeypatch):
    """Unset, ``CONCEPT_LAYER_REGIONS`` follows the torch release; ``0`` / ``1`` decide on any torch; without a
    region maker, ``regions()`` is off whatever the setting."""
    for version, on in (("2.10.1", False), ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", True),
                        ("3.0.0", True)):
        monkeypatch.setattr(torch, "__version__", version)
        assert concept.compiled.default_layer_regions({}) is on
        assert concept.compiled.default_layer_regions({"CONCEPT_LAYER_REGIONS": "1"}) is True
        assert concept.compiled.default_layer_regions({"CONCEPT_LAYER_REGIONS": "0"}) is False
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", True)
    monkeypatch.setattr(concept.compiled, "_layer_region", None)
    assert concept.compiled.regions() is False


@pytest.mark.parametrize("q", [0.0, 0.125, 0.5, 0.875, 1.0, 1 / 3])
def test_the_controllers_quantile_is_torchs_bit_for_bit_and_reads_nothing_back(q):
    """``nanquantile`` against ``torch.nanquantile`` (float32, as the controller calls it; float64), NaNs where
    tokens are padding, one element, all NaN; no sync counted. Negative control: the op 2.11's quantile ran,
    ``aten::equal``, is counted as the sync it is."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 100, 4097):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(n, generator=g, dtype=dtype)
            x[torch.rand(n, generator=g) < 0.3] = float("nan")
            with HostSyncs() as seen:
                ours = nanquantile(x, q)
            assert seen.hidden == 0
            theirs = torch.nanquantile(x, q)
            assert torch.equal(ours, theirs) or (ours.isnan() and theirs.isnan()), (n, dtype, ours, theirs)
    assert nanquantile(torch.full((5,), float("nan")), q).isnan()
    with HostSyncs() as seen:
        torch.equal(torch.ones(2), torch.ones(2))
    assert dict(seen.syncs) == {"equal": 1}


def test_a_quantile_out_of_range_is_refused_on_the_host():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nanquantile(torch.ones(3), 1.5)
