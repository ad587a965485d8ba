"""Compiled decoding over a preallocated, static KV cache (``--compile``; docs/decoding.md, "Compiled decoding").

A decoding step whose caches grow changes shapes at every token, so no graph could serve two steps. Here
every cache has a fixed capacity from the start (the prompt, the new-token budget and, for the streaming
model, the static concept budget ``max_ratio`` bound what can ever be held), and everything a step
changes lives in preallocated device tensors updated in place: KV entries written with ``scatter_`` at
the row's first free slot (a tensor index), positions, concept counts, policy state and decisions as
tensors. One step is then one graph, compiled with ``torch.compile(fullgraph=True, dynamic=False)``: no
graph break, no recompile whatever the decisions, no host sync; on CUDA its mode is ``reduce-overhead``
(CUDA graphs; the tensors it mutates are marked static addresses, as transformers' ``StaticCache`` does).

:class:`StaticSlotCache` (one layer stack's cache) and :class:`StaticDenseDecoder` (the dense / pruned
baseline's own equivalent of transformers' static cache, the same kernels as the streaming stacks) live
here; the streaming model's step is ``concept.streaming.static_decoding``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import packing
from .attention import CausalPattern
from .backbone import decoder, run_layers
from .config import device_mode, uses_cuda_graphs
from .decoding import last_real
from .kv_cache import CacheSizes, DecodePattern, SlotCache


CAPACITY_BUCKET = 64  # a static cache's slots per row: rounded up to a multiple of this, so a few graphs serve all


def capacity(entries: int) -> int:
    """Slots for ``entries`` entries plus the spare one a row that does not write uses, in whole buckets."""
    return -(-(entries + 1) // CAPACITY_BUCKET) * CAPACITY_BUCKET


def layer_ids(layers) -> list[int]:
    """The KV-cache index (``layer_idx``) each decoder layer's attention writes under."""
    found = [m.layer_idx for layer in layers for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    return list(dict.fromkeys(found))


def kv_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of a backbone config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return getattr(config, "num_key_value_heads", None) or heads, head_dim


def static(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked as a tensor whose address never changes (CUDA graphs may then mutate it in place)."""
    torch._dynamo.mark_static_address(t)
    return t


class StaticSlotCache(CacheSizes):
    """The KV cache of one layer stack with a fixed ``capacity`` of slots per row: keys / values
    [B, Hkv, capacity, hd] per layer, ``valid`` / ``tail`` [B, capacity], and the step's slot, all
    allocated once and changed only in place. Same protocol and meaning as :class:`SlotCache`
    (``begin`` -> the layers call ``update`` -> ``commit``), after a prefill recorded by one."""

    recording = False  # a step is always begun: the layers write one entry per row

    def __init__(self, prefilled: SlotCache, capacity: int, layers: list[int], kv: tuple[int, int], dtype):
        B, held = prefilled.valid.shape
        if held + 1 > capacity:
            raise ValueError(f"static KV cache: {held} entries held already, capacity {capacity}")
        device = prefilled.valid.device
        self.valid = static(F.pad(prefilled.valid, (0, capacity - held)))
        self.tail = static(F.pad(prefilled.tail, (0, capacity - held)))
        self.k, self.v = {}, {}
        for i in layers:
            for store, old in ((self.k, prefilled.k.get(i)), (self.v, prefilled.v.get(i))):
                t = torch.zeros(B, kv[0], capacity, kv[1], dtype=dtype, device=device)
                if old is not None:
                    t[:, :, : old.shape[2]] = old
                store[i] = static(t)
        self.slot = static(torch.zeros(B, dtype=torch.long, device=device))
        self.write = static(torch.zeros(B, dtype=torch.bool, device=device))
        self.new_tail = static(torch.zeros(B, dtype=torch.bool, device=device))


    # -- a step --------------------------------------------------------------------------
    def drop_tail(self, rows: torch.Tensor) -> None:
        self.valid &= ~(self.tail & rows[:, None])
        self.tail &= self.valid

    def begin(self, write: torch.Tensor, tail: torch.Tensor | bool = False) -> torch.Tensor:
        """Rows ``write`` [B] add one entry (a tail token where ``tail``) at their first free slot (the
        capacity guarantees one). Returns the step's mask [B, N]: the row's real entries and its new
        element (also where it does not write: such a row's output is never read, and seeing itself keeps
        it finite)."""
        slot = (~self.valid).to(torch.int8).argmax(1)
        self.slot.copy_(slot)
        self.write.copy_(write)
        if isinstance(tail, torch.Tensor):
            self.new_tail.copy_(tail.expand_as(write))
        else:  # a Python bool: filled on the device (a tensor made of it would be a host -> device copy, a sync)
            self.new_tail.fill_(tail)
        return self.valid.scatter(1, slot[:, None], True)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by the backbone's attention layers: the new key / value [B, Hkv, 1, hd] go to the step's slot."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        index = self.slot[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3])
        k.scatter_(2, index, key.to(k.dtype))
        v.scatter_(2, index, value.to(v.dtype))
        return k, v

    def commit(self) -> None:
        at = self.slot[:, None]
        self.valid.scatter_(1, at, self.valid.gather(1, at) | self.write[:, None])
        self.tail.scatter_(1, at, torch.where(self.write[:, None], self.new_tail[:, None], self.tail.gather(1, at)))


class CompiledStep:
    """``fn`` compiled once (``fullgraph=True``, static shapes) in the mode of a ``--compile`` choice on a device
    type (``on``: ``reduce-overhead`` on CUDA); its outputs are cloned (a CUDA graph's are overwritten by the
    next replay). ``choice`` None: ``fn`` runs eagerly (the reference the tests compare with)."""

    def __init__(self, fn, choice: str | None, device_type: str):
        self.mode = None
        if choice is None:
            self.fn = fn
        elif choice == "aot-eager":
            self.fn = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
        else:
            self.mode = device_mode(choice, device_type)
            self.fn = torch.compile(fn, fullgraph=True, dynamic=False, mode=self.mode)
        self.cuda_graphs = uses_cuda_graphs(self.mode, device_type)

    def __call__(self, *args):
        if self.cuda_graphs:  # (reduce-overhead, max-autotune): each step a new generation of the graphs' memory
            torch.compiler.cudagraph_mark_step_begin()
        out = self.fn(*args)
        return out.clone() if self.mode is not None else out


class StaticDenseDecoder:
    """The dense / pruned baseline decoded over a :class:`StaticSlotCache` with a compiled step: the
    same layers, RoPE and SDPA masks as the streaming model's stacks (the fair comparison), the prompt
    in one forward first. ``new_tokens``: the most steps it will run (the cache's capacity)."""

    static = True  # generate() runs its device loop (concept.generation._device_loop)

    def __init__(self, model, new_tokens: int, compile_choice: str | None = "on"):
        self.model = model
        self.new_tokens = new_tokens
        self.compile_choice = compile_choice
        self.keep = None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        model = self.model
        inner = decoder(model.backbone)
        B, P = input_ids.shape
        recorder = SlotCache(B, input_ids.device)
        pos = packing.time_positions(valid)
        x = run_layers(model.layers, inner.embed_tokens(input_ids), pos, CausalPattern(valid, None, False),
                       inner.rotary_emb, cache=recorder)
        recorder.adopt(valid)
        dtype = next(model.parameters()).dtype
        self.cache = StaticSlotCache(recorder, capacity(P + self.new_tokens), layer_ids(model.layers),
                                     kv_shape(model.backbone.config), dtype)
        self.pos = static(valid.sum(1))
        self._step = CompiledStep(self.step_eager, self.compile_choice, input_ids.device.type)
        h = x[torch.arange(B, device=x.device), last_real(valid)]
        return model.backbone.lm_head(inner.norm(h))

    def step_eager(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """One token per row [B] -> logits [B, V]; rows not ``active`` keep nothing (what is compiled)."""
        model, cache = self.model, self.cache
        inner = decoder(model.backbone)
        x = run_layers(model.layers, inner.embed_tokens(tokens[:, None]), self.pos[:, None],
                       DecodePattern(cache.begin(active)), inner.rotary_emb, cache=cache)
        cache.commit()
        self.pos.add_(active.long())
        return model.backbone.lm_head(inner.norm(x))[:, 0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        active = torch.ones_like(tokens, dtype=torch.bool) if active is None else active
        return self._step(tokens, active)

    def kv_stats(self) -> list[dict]:
        layers = len(self.model.layers)
        entry = self.cache.entry_bytes()
        return [{"tokens": t, "entries": {"dense": layers * t}, "bytes": layers * t * entry,
                 "dense_bytes": layers * t * entry, "allocated_bytes": self.cache.allocated_bytes()}
                for t in self.pos.tolist()]
