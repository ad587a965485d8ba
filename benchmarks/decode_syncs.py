"""Host syncs per decoded token of the dynamic (not compiled) decoder, on CPU, as a CUDA device would see them.

    python benchmarks/decode_syncs.py [--json]

``concept.generate`` (greedy, no EOS: every row runs to the budget) on 2 rows of 8 random prompt ids, once for 4
and once for 12 new tokens; the difference, over 8 tokens, is what each token costs (the prefill and the final
statistics are in both). Counted by ``concept.syncs.HostSyncs``: the ops forcing a device -> host read and the
tensors made from Python data (a blocking host -> device copy on CUDA), hidden (by op) and declared (by name).
The streaming model: the tiny backbone of ``tests/conftest.py`` (split 2,2,2), the ``null`` policy, ``sdpa``;
the dense side: the same backbone as a dense baseline (``DenseDecoder``, transformers' ``DynamicCache``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests.conftest's tiny models)

from concept.dense import DenseModel  # noqa: E402
from concept.generation import generate  # noqa: E402
from concept.syncs import HostSyncs  # noqa: E402
from tests.conftest import mixed_model  # noqa: E402


def count(model, new_tokens: int) -> HostSyncs:
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as seen:
        generate(model, ids, max_new_tokens=new_tokens, eos_token_id=None)
    return seen


def per_token(model) -> dict:
    short, long = count(model, 4), count(model, 12)
    hidden = {k: (long.syncs[k] - short.syncs[k]) / 8 for k in long.syncs if long.syncs[k] != short.syncs[k]}
    declared = {k: (long.declared[k] - short.declared[k]) / 8 for k in long.declared
                if long.declared[k] != short.declared[k]}
    return {"hidden": sum(hidden.values()), "hidden_by_op": hidden, "declared": declared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    streaming = mixed_model("null").eval()
    rows = {"streaming": per_token(streaming), "dense": per_token(DenseModel(streaming.backbone).eval())}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| decoder | hidden syncs per token | by op | declared per token |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['hidden']:g} | {', '.join(f'{k} {v:g}' for k, v in row['hidden_by_op'].items()) or '-'} "
              f"| {', '.join(f'{k} {v:g}' for k, v in row['declared'].items()) or '-'} |")


if __name__ == "__main__":
    main()
