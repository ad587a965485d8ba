"""Host syncs per forward, on CPU, as a CUDA device would see them: by attention backend, with forced decisions
and with the policy deciding.

    python benchmarks/forward_syncs.py [--seq-len 256] [--json]
    TRITON_INTERPRET=1 python benchmarks/forward_syncs.py --device-scan    # + the decided rows with the device scan

The tiny backbone of ``op_counts.py`` (6 layers, hidden 64, split 2,2,2, the default budget), the default
``null`` policy (its tracker on: one declared host scan per decided forward), 2 rows of random ids in two
packed documents. ``forced``: ``keep`` given (one boundary every 8 tokens), no policy scan; ``decided``: the
policy decides. Counted by ``concept.syncs.HostSyncs`` (eager): the ops forcing a device -> host read and
the tensors made from Python data (a blocking host -> device copy on CUDA), outside the declared points.
``flex``: its BlockMask (the ranges, torch's ``create_block_mask``) is counted; its kernel call is one fused
op on CUDA and runs outside the counter here (eager FlexAttention compiles itself, which a dispatch mode stops).
``--device-scan``: the decided forward once more with the policy's scan on the device, as on CUDA with Triton
(``concept.streaming.device_scan``; here in Triton's interpreter, so set ``TRITON_INTERPRET=1``; its op is one
op to the counter, whose inside ``tests/test_device_scan.py`` shows reads nothing).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.utils._python_dispatch import _disable_current_modes

import concept
from concept import BuildConfig, ComponentRef
from concept.streaming import device_scan
from concept.syncs import HostSyncs

BACKENDS = {"chunked": {}, "flex": {"compile": False}, "cascade": {}}


def kernel_outside_the_counter():
    """FlexPattern's kernel call run with the counting modes off (see the module's docstring)."""
    from concept_plugins.attention.flex import FlexPattern

    call = FlexPattern.__call__

    def uncounted(self, *args, **kwargs):
        with _disable_current_modes():
            return call(self, *args, **kwargs)

    FlexPattern.__call__ = uncounted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device-scan", action="store_true", help="also decide with the scan on the device "
                        "(Triton's interpreter: TRITON_INTERPRET=1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernel_outside_the_counter()
    T = args.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, T), generator=g)
    doc = (torch.arange(T) >= T // 3).long().expand(2, T)
    keep = (torch.arange(T) % 8 == 7).expand(2, T)
    rows = []
    for backend, options in BACKENDS.items():
        cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2,
                                                              "vocab": 256}),
                          split="2,2,2", vocabulary=ComponentRef("embedding", {"size": 32}),
                          attention=ComponentRef(backend, options))
        model = concept.build(cfg).eval()
        cases = [("forced", {"keep": keep}, False), ("decided", {}, False)]
        cases += [("decided, device scan", {}, True)] if args.device_scan else []
        for case, extra, on_device in cases:
            with torch.no_grad(), device_scan.choose(on_device):
                model(ids, document_ids=doc, **extra)
                with HostSyncs() as seen:
                    model(ids, document_ids=doc, **extra)
            rows.append({"backend": backend, "decisions": case, "hidden": dict(seen.syncs),
                         "declared": dict(seen.declared), "ops": seen.ops})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['backend']:8} {row['decisions']:20} ops={row['ops']:5} hidden={row['hidden']} "
              f"declared={row['declared']}")


if __name__ == "__main__":
    main()
