"""`auto`: the exact backend expected to be fastest for the device and the mode, chosen per forward.

| device | training | prefill / evaluation | decoding |
|---|---|---|---|
| CPU | `chunked` | `chunked` | KV caches (no backend) |
| CUDA | `flex` | `flex` | KV caches (no backend) |

On CPU the choice is measured (`docs/benchmarks.md`): `chunked` beats the dense-mask `sdpa`
(full forward 2.00x vs 1.83x against dense) and torch's CPU FlexAttention (attention only,
2.83x vs 0.98x at 4k tokens), and FlexAttention has no backward on CPU. On CUDA `flex` is
chosen for its fused forward and backward kernels; where FlexAttention cannot be imported,
`chunked`. Measured on an H100 (the GPU kit, `docs/benchmarks.md`, "GPU: the GPU kit"): `flex` was
the fastest exact backend for training and for full forwards at 2k, 8k and 16k tokens (train step
0.89-0.97x dense, forward 0.57-0.75x, against `chunked` at 0.29-0.72x and 0.28-0.63x); `xformers`
was not measured there (no wheel for that machine's torch), nor was `cascade` (issue 40: built after that
lease; on this CPU it is slower than `chunked`, 0.46-1.0x of its speed at 1k-8k tokens, so it is not the CPU
choice). The GPU kit's speed stage measures `cascade` and `flex`'s variants (its flex diagnosis) and its
``auto_recommendation`` says whether the CUDA choice should change; until a GPU has measured `cascade`
faster, `auto` does not pick it.
Decoding never uses a backend: a decoding query attends to its row's cache with one SDPA.
The run records ``auto``; :meth:`AutoBackend.choice` says what it resolves to on a device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from concept.attention import AttentionPattern
from concept.contracts import AttentionBackend
from concept.packing import PackedLayout

from .chunked import ChunkedBackend, ChunkedConfig


@dataclass
class AutoConfig:
    chunk: int = 128  # for `chunked`

    def validate(self) -> list[str]:
        return ChunkedConfig(self.chunk).validate()


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


class AutoBackend(AttentionBackend):
    Config = AutoConfig
    supports_backward = True
    plans_deep_block = True  # (`chunked` and `flex` both do)

    def __init__(self, config: AutoConfig | None = None, ctx=None):
        self.config = config or AutoConfig()
        self.backends = {"chunked": ChunkedBackend(ChunkedConfig(self.config.chunk))}

    @staticmethod
    def choice(device) -> str:
        """The backend ``auto`` uses on ``device`` (for training and for full forwards alike)."""
        return "flex" if torch.device(device).type == "cuda" and _flex_available() else "chunked"

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        name = self.choice(layout.meta.time.device)
        if name not in self.backends:
            # lazy: the flex backend (torch's FlexAttention) loads only where a forward picks it
            from .flex import FlexBackend

            self.backends[name] = FlexBackend()
        return self.backends[name].plan(layout)
