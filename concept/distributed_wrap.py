"""The training forward under ``torchrun`` (``concept.distributed``): wrapped in DDP or sharded with FSDP2, and
FSDP2's root parameters gathered whole for a forward outside the training step."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .distributed import Dist


def wrap(module: nn.Module, layers, dist: Dist, device: torch.device) -> nn.Module:
    """The training forward ``module`` under torchrun: DDP (gradients all-reduced in backward) or FSDP2 (each
    decoder layer in ``layers`` and the rest sharded over the ranks, gathered for its forward); else ``module``."""
    if dist.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=False)
    if dist.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(module)
        # FSDP2 initialises lazily in the root's first forward; calibration and evaluation call the layers
        # outside it, so initialise now (else each layer would take itself for a root)
        module._get_fsdp_state()._lazy_init()
    return module


@contextmanager
def gathered(module: nn.Module, dist: Dist):
    """FSDP2: the root ``module``'s parameters (embeddings, head, new modules) gathered whole, for a forward
    outside the training step (calibration, evaluation); the decoder layers gather their own. Else nothing."""
    if dist.mode != "fsdp2":
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
