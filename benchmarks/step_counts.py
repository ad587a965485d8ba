"""What one training step dispatches, counted on the CPU (a proxy for the GPU's kernel launches and copies).

:class:`StepCounter` is a ``TorchDispatchMode``: every aten op that reaches it (forward, backward and the
optimizer step: the autograd engine runs the backward under the same mode) is counted, and so is

- every cast whose SOURCE is a frozen parameter (``_to_copy`` / ``copy_`` / autocast's own casts reading a
  frozen weight's storage): what autocast does to an fp32 base at every use, forward and backward;
- the peak of the bytes alive in tensors that ops created during the step (each output storage is followed
  until it is freed: a weak reference to its preserved Python object): an allocator-level measure of the
  step's memory, parameters excluded. On CUDA ``torch.cuda.max_memory_allocated`` measures the same thing;
- the most rows of a [rows, V] tensor (V: the vocabulary) that any op created (views excluded): the logits a
  step built.

``training_step`` runs one step of a tiny model as the trainer does (LoRA, AdamW over the trainable
parameters, bf16 autocast) in two versions: ``today`` (the fp32 base under bf16 autocast, the CE read from
logits of the whole batch, as before issue 39) and ``new`` (the frozen base stored in bf16, the CE from the
LM head's input states in chunks: ``concept.precision``, ``concept.losses``).
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from concept.losses import next_token_loss
from concept.planner.model import text_loss

CASTS = {"_to_copy", "copy_", "to", "_autocast_to_reduced_precision", "_autocast_to_full_precision"}


def _storage(t):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # (e.g. a sparse or meta tensor)
        return None


class StepCounter(TorchDispatchMode):
    """Counts aten ops, casts read from ``frozen`` tensors, the largest [rows, V] output (``vocab``: V) and,
    with ``memory``, the peak of the live bytes ops created (slower: a weak reference per new storage)."""

    def __init__(self, frozen=(), vocab: int | None = None, memory: bool = False):
        super().__init__()
        self.frozen = {t.untyped_storage().data_ptr() for t in frozen}
        self.vocab, self.memory = vocab, memory
        self.ops: Counter = Counter()
        self.frozen_casts: Counter = Counter()
        self.live = self.peak = 0
        self.logit_rows = 0
        self._alive: dict[int, int] = {}

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in CASTS:
            source = args[1] if name == "copy_" else args[0]
            if isinstance(source, torch.Tensor) and source.device.type != "meta":
                storage = _storage(source)
                if storage is not None and storage.data_ptr() in self.frozen:
                    self.frozen_casts[name] += 1
        out = func(*args, **kwargs)
        if not (self.memory or self.vocab):
            return out
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if self.vocab and t.dim() >= 1 and t.shape[-1] == self.vocab and t.is_floating_point() and not func.is_view:
                self.logit_rows = max(self.logit_rows, t.numel() // self.vocab)  # (a view, e.g. weight.t(), is not new)
            if not self.memory:
                continue
            storage = _storage(t)
            if storage is None or storage.nbytes() == 0 or id(storage) in self._alive:
                continue
            if storage.data_ptr() in self.frozen:
                continue
            self._alive[id(storage)] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, id(storage))
        return out


def frozen_parameters(model) -> list[torch.Tensor]:
    """Every parameter of ``model`` that does not train."""
    return [p for p in model.parameters() if not p.requires_grad]


def training_step(model, batch: dict, version: str, optimizer=None, dtype=torch.bfloat16):
    """One step of ``model`` (LoRA already injected, the base frozen): ``version`` ``today`` reads the CE from
    the logits of the whole batch, ``new`` from the model's own loss (chunked through the LM head). Both under
    autocast to ``dtype`` (fp32: none) on the batch's device; the caller stores the base as the version wants
    (``concept.precision.store_frozen_base``). Returns the loss."""
    ids = batch["input_ids"]
    device = ids.device
    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype != torch.float32):
        if version == "new":
            loss = model(ids, attention_mask=batch["attention_mask"], labels=ids,
                         document_ids=batch.get("document_ids")).loss
        else:
            out = model(ids, attention_mask=batch["attention_mask"], document_ids=batch.get("document_ids"))
            if getattr(out, "y", None) is not None:  # planner-executor: the CE of the executed text
                loss = text_loss(out.logits, out.y, out.y_valid)
            else:
                loss = next_token_loss(out.logits, ids, batch["attention_mask"].bool(), batch.get("document_ids"))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
