"""Output fields computed on first read: a model's logits [B, T, V] are built only when something reads them.

A training step takes its CE from the LM head's input states (``concept.losses.head_cross_entropy``);
evaluation, decoding and the distillation objective read ``out.logits`` as before, and only then is
the head applied to every position::

    @dataclass
    class DenseOutput:
        logits: torch.Tensor = LazyField()

    DenseOutput(Deferred(head, states))

The head runs under the autocast state of the forward that deferred it (the reader may be outside
it, e.g. an objective after the model's forward), and under the reader's grad mode. Its weights must be
the ones the forward ran with: a read after an optimizer step or a ``.to(dtype)`` of the head is refused
with an error that says to read ``out.logits`` first (``watch``), never answered with other weights.
"""
from __future__ import annotations

import copy

import torch


class Deferred:
    """A tensor computed by ``fn(*inputs)`` on first read, under the autocast state of the moment it was made (that
    of ``like``'s device: a tensor whose autocast state matters; by default the first input)."""

    def __init__(self, fn, *inputs, like: torch.Tensor | None = None, watch: torch.nn.Module | None = None):
        self.fn = fn
        self.inputs = inputs
        like = inputs[0] if like is None else like
        self.device_type = like.device.type
        self.autocast = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)
        self.watched = [] if watch is None else [(p, _state(p)) for p in watch.parameters()]

    def copied(self, copy_tensor) -> "Deferred":
        """The same deferred computation over ``copy_tensor`` of each input (a tensor -> its copy), the autocast
        state and the watched weights as they were: a compiled forward's output copied out of CUDA graphs' memory
        (``concept.compiled.copied_out``)."""
        other = copy.copy(self)
        other.inputs = tuple(copy_tensor(x) for x in self.inputs)
        return other

    def __call__(self) -> torch.Tensor:
        if any(_state(p) != state for p, state in self.watched):
            raise RuntimeError("out.logits was read after the LM head's weights changed (an optimizer step, an "
                               "in-place update or a dtype/device move since the forward): the logits would "
                               "not be the forward's. Read out.logits before changing the model.")
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast):
            return self.fn(*self.inputs)


def _state(p: torch.Tensor) -> tuple:
    """What changes when a parameter's values do: its in-place version, storage and dtype."""
    return tensor_version(p), p.data_ptr(), p.dtype


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version (what a cache keyed on a tensor's values compares); -1 for an inference tensor (made
    under ``torch.inference_mode``, e.g. a model loaded there), which keeps no version counter: such a tensor is only
    changed in place under inference mode, where a cache keyed on it is not told. (Traced, ``_version``: dynamo
    cannot trace ``is_inference``.)"""
    if torch.compiler.is_compiling():
        return t._version
    return -1 if t.is_inference() else t._version


class LazyField:
    """A dataclass field (``name: T = LazyField()``, still a required argument; ``LazyField(None)``: with that
    default) whose value may be given as a :class:`Deferred`: computed on first read, then kept."""

    def __init__(self, *default):
        self.default = default  # () : a required argument; (value,): that default (``LazyField(None)``)

    def __set_name__(self, owner, name):
        self.slot = f"_{name}_value"

    def __get__(self, obj, owner=None):
        if obj is None:  # dataclass asks for a default
            if not self.default:
                raise AttributeError(self.slot)
            return self.default[0]
        value = obj.__dict__[self.slot]
        if isinstance(value, Deferred):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value

    @staticmethod
    def computed(obj, name: str) -> bool:
        """Whether ``obj.name`` holds a value (False: still deferred, nothing built yet)."""
        return not isinstance(obj.__dict__.get(f"_{name}_value"), Deferred)
