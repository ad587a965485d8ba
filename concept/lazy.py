"""Output fields computed on first read: a model's logits [B, T, V] are built only when something reads them.

A training step takes its CE from the LM head's input states (``concept.losses.head_cross_entropy``);
evaluation, decoding and the distillation objective read ``out.logits`` as before, and only then is
the head applied to every position::

    @dataclass
    class DenseOutput:
        logits: torch.Tensor = LazyField()

    DenseOutput(Deferred(lambda: head(states), like=states))

The head runs under the autocast state of the forward that deferred it (the reader may be outside
it, e.g. an objective after the model's forward), and under the reader's grad mode. Its weights must be
the ones the forward ran with: a read after an optimizer step or a ``.to(dtype)`` of the head is refused
with an error that says to read ``out.logits`` first (``watch``), never answered with other weights.
"""
from __future__ import annotations

import torch


class Deferred:
    """A tensor computed by ``fn()`` on first read, under the autocast state of the moment it was made
    (``like``: a tensor on the device whose autocast state matters)."""

    def __init__(self, fn, like: torch.Tensor, watch: torch.nn.Module | None = None):
        self.fn = fn
        self.device_type = like.device.type
        self.autocast = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)
        self.watched = [] if watch is None else [(p, _state(p)) for p in watch.parameters()]

    def __call__(self) -> torch.Tensor:
        if any(_state(p) != state for p, state in self.watched):
            raise RuntimeError("out.logits was read after the LM head's weights changed (an optimizer step, an "
                               "in-place update or a dtype/device move since the forward): the logits would "
                               "not be the forward's. Read out.logits before changing the model.")
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast):
            return self.fn()


def _state(p: torch.Tensor) -> tuple:
    """What changes when a parameter's values do: its in-place version, storage and dtype."""
    return p._version, p.data_ptr(), p.dtype


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
