"""Whether a build, a training micro-batch or an evaluation batch fits in memory, estimated from the model's
dimensions before anything is allocated or written: a clear error instead of an out-of-memory kill (or a
machine that swaps for an hour).

The estimates are rough, calibrated so that they refuse only what cannot fit:

- a build: the backbone's weights (``2 V h + 12 L h^2`` numbers: embeddings and head, attention and MLP) and the
  new modules' tables (each ``size`` of the config times ``h``, three times: table, head, initialisation);
- a training micro-batch: ``bytes x tokens x (32 h L + 3 V)`` (SmolLM2's train-step peaks on an H100, weights
  and optimizer included: 1.48 MB per token in bf16 at 2k tokens, 1.37 MB at 8k, docs/gpu.md's speed stage; this
  says 1.40 MB), plus on the CPU 60 KB per token and layer (tiny-llama's resident memory grows by about 560 KB per
  token over 8 layers where the first term says 67 KB); with ``--grad-checkpointing`` two layers instead of ``L``;
- an evaluation batch: no saved activations, twice one layer's plus the logits.

Available memory: CUDA's free memory (``torch.cuda.mem_get_info``); on the CPU ``MemAvailable`` of
``/proc/meminfo``, or less under a cgroup limit.
"""
from __future__ import annotations

import os
from pathlib import Path

GIB = 2 ** 30


def available_bytes(device=None) -> int | None:
    """Memory a new allocation can use on ``device`` (None: unknown)."""
    import torch

    device = torch.device(device or "cpu")
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 2 ** 60:
                found.append(int(cap) - int(Path(usage).read_text().strip()))
                break
        except (OSError, ValueError):
            continue
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return max(0, min(found)) if found else None


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.0f} MiB"


def _sizes(value) -> list[int]:
    """Every integer under a ``size`` key of a config (a vocabulary's K, each planner type's)."""
    if isinstance(value, dict):
        return [v for k, v in value.items() if k == "size" and isinstance(v, int) and not isinstance(v, bool)] + [
            s for k, v in value.items() if k != "size" for s in _sizes(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _sizes(v)]
    return []


def build_bytes(plan) -> tuple[int, str]:
    """(bytes, what) a build of ``plan`` needs at least."""
    info = plan.backbone_info
    h, layers, vocab = info.hidden_size, info.num_layers, info.vocab_size
    width = 2 if str(getattr(plan.components["backbone"].config, "dtype", "float32")) in ("bfloat16", "float16") else 4
    backbone = width * (2 * vocab * h + 12 * layers * h * h)
    sizes = _sizes(plan.config.to_dict())
    tables = 4 * 3 * sum(sizes) * h
    what = f"the backbone's weights ({gib(backbone)})"
    if sizes and tables > backbone / 10:
        what += f" and tables of {' + '.join(f'{s:,}' for s in sizes)} concepts x hidden {h} ({gib(tables)})"
    return backbone + tables, what


def training_bytes(info, batch: int, seq_len: int, grad_checkpointing: bool = False, width: int = 4,
                   cuda: bool = False) -> int:
    """Peak activation memory of one training micro-batch of ``batch`` rows of ``seq_len`` tokens."""
    h, layers, vocab = info.hidden_size, info.num_layers, info.vocab_size
    kept = min(2, layers) if grad_checkpointing else layers
    per_token = width * (32 * h * kept + 3 * vocab) + (0 if cuda else 60_000 * kept)
    return int(batch * seq_len * per_token)


def inference_bytes(info, batch: int, seq_len: int, width: int = 4) -> int:
    """Memory of one forward without gradients: two layers' activations and the logits."""
    h, vocab = info.hidden_size, info.vocab_size
    return int(width * batch * seq_len * (2 * 32 * h + 2 * vocab))


def fits(need: int, device=None) -> tuple[bool, int | None]:
    have = available_bytes(device)
    return (have is None or need <= have), have


def training_problem(info, config, device) -> str | None:
    """The problem of a training config whose micro-batch cannot fit, or None."""
    cuda = getattr(device, "type", "cpu") == "cuda"
    bf16 = config.dtype == "bf16" or (config.dtype == "auto" and cuda)
    need = training_bytes(info, config.batch, config.seq_len, config.grad_checkpointing, 2 if bf16 else 4, cuda)
    ok, have = fits(need, device)
    if ok:
        return None
    per_row = max(1, need // config.batch)
    rows = max(0, int(have // per_row))
    fix = (f"lower --batch (about {rows} fits) and raise --grad-accum to keep the global batch" if rows
           else "lower --seq-len")
    return (f"batch: one micro-batch of --batch {config.batch} x --seq-len {config.seq_len} needs about {gib(need)} "
            f"of activations, and {device} has {gib(have)} available; {fix}"
            f"{'' if config.grad_checkpointing else ', or pass --grad-checkpointing'}")


def inference_problem(info, batch: int, seq_len: int, device) -> str | None:
    need = inference_bytes(info, batch, seq_len)
    ok, have = fits(need, device)
    if ok:
        return None
    per_row = max(1, need // batch)
    return (f"batch: --batch {batch} x --seq-len {seq_len} needs about {gib(need)} for one forward, and {device} has "
            f"{gib(have)} available; lower --batch (about {max(1, int(have // per_row))} fits) or --seq-len")
