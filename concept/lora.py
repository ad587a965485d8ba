"""LoRA adapters on the frozen backbone, through peft (injected in place, so the concept model's
views of the decoder layers stay valid)."""
from __future__ import annotations

import contextlib
import math
import os
import shutil

import torch
from torch import nn

from . import fs, lora_triton
from .backbone import decoder
from .distributed import full_tensor
from .errors import ConceptError, RunFolderError
from .lazy import tensor_version
from .train_config import DEFAULT_TARGETS, LoraSettings  # noqa: F401 (part of this module's API)


def add_lora(backbone: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA into ``backbone`` in place; only the adapter weights are trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t.strip() for t in settings.targets.split(",") if t.strip()]
    present = {name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ConceptError(f"LoRA targets {missing} are not linear layers of this backbone; "
                           f"available: {', '.join(sorted(present))}")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, backbone)
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    use_fused_lora(backbone, settings.kernel)
    return backbone


# -- one op per matmul: the adapted linear layers' forward and backward ------------------------
# peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` through three
# ``nn.Linear`` calls, a scalar multiply and the autograd of each: about 100 aten ops per adapted layer
# and step, most of them views, transposes, scalar wrappers and casts (docs/benchmarks.md, "Fewer aten ops
# in a streaming step"). ``FusedLoraLinear`` computes the same products in the same order with
# ``torch.mm`` on 2-D views, forward and backward written out (``LoraMatmuls``): about half the ops, the
# same values. Anything else (dropout, several or no active adapters, merged weights, a bias, DoRA and the
# other variants, a trained base weight, mixed dtypes outside autocast) runs peft's own forward.


def _exact_power_of_two(value: float) -> bool:
    mantissa, _ = math.frexp(value)
    return value > 0 and mantissa == 0.5


# traced, a power-of-two scale multiplies the adapter ``B`` [out, r] instead of the product ``t`` [N, out]
FOLD_SCALE = True


def _in_dtype(dtype: torch.dtype, *tensors) -> list[torch.Tensor]:
    """Each tensor in ``dtype``, cast once where it is not (the caller turns autocast off)."""
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def _lora_products(x, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype):
    """``x W^T + s (x A^T) B^T`` in ``dtype`` (autocast off: each operand cast once) and the operands the
    backward reads: ``(y, (xc, w, a, b, h))``. Traced (``torch.compile``) with ``s`` a power of two, ``s``
    scales ``B`` (:data:`FOLD_SCALE`): ``h (s B)^T`` is ``s (h B^T)`` bit for bit, and the compiled graph then
    has no pass over an [N, out] tensor for the scale, forward (``t s``) or backward (``g s``), only one over
    the adapter [out, r], fused with its cast (``docs/benchmarks.md``, "What the compiled step asks of the
    device")."""
    with torch.autocast(x.device.type, enabled=False):
        xc, w, a, b = _in_dtype(dtype, x, weight, lora_a, lora_b)
        if FOLD_SCALE and scaling != 1.0 and _exact_power_of_two(scaling) and torch.compiler.is_compiling():
            b, scaling = b * scaling, 1.0
        y = torch.mm(xc, w.t())
        h = torch.mm(xc, a.t())
        t = torch.mm(h, b.t())
        if scaling == 1.0 or (_exact_power_of_two(scaling) and not torch.compiler.is_compiling()):
            y = torch.add(y, t, alpha=scaling)
        else:  # (traced: inductor on a CPU, torch 2.13, computes an add of a matmul with an alpha as if alpha
            y = y + t * scaling  # were 1; ``t s`` first gives the same bits for a power of two: test_compile_model)
    return y, (xc, w, a, b, h)


def lora_matmuls(x, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """:class:`LoraMatmuls`' forward as plain ops, its backward left to autograd: what a compiled graph traces
    (AOT autograd derives the same products; an ``autograd.Function`` inside a nested compile region breaks
    dynamo 2.11's comparison of the regions' graphs: ``docs/architecture.md``, "torch versions")."""
    return _lora_products(x, weight, lora_a, lora_b, scaling, dtype)[0]


class LoraMatmuls(torch.autograd.Function):
    """``y = x W^T + s (x A^T) B^T`` on 2-D ``x`` [N, in] in ``dtype`` (autocast's or the tensors' own), with
    the frozen ``W`` [out, in] and the adapters ``A`` [r, in], ``B`` [out, r] cast to it once, as autocast casts
    them; the gradients of ``x``, ``A`` and ``B`` in the order autograd computes peft's (the scaled output
    gradient ``g s`` first), cast back to each input's dtype as autocast's cast would. ``s`` folds into the
    final add only when it is a power of two (then ``t s`` is exact and ``y + s t`` rounds once, as
    ``y + (t s)`` does)."""

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype):
        y, (xc, w, a, b, h) = _lora_products(x, weight, lora_a, lora_b, scaling, dtype)
        ctx.save_for_backward(xc, w, a, b, h)
        ctx.scaling = scaling
        ctx.dtypes = (x.dtype, lora_a.dtype, lora_b.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        xc, w, a, b, h = ctx.saved_tensors
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
        grad_x = grad_a = grad_b = None
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad if grad.dtype == xc.dtype else grad.to(xc.dtype)
            scaled = grad if ctx.scaling == 1.0 else grad * ctx.scaling
            if need_b:
                grad_b = torch.mm(scaled.t(), h)
                grad_b = grad_b if grad_b.dtype == b_dtype else grad_b.to(b_dtype)
            grad_h = torch.mm(scaled, b)
            if need_a:
                grad_a = torch.mm(grad_h.t(), xc)
                grad_a = grad_a if grad_a.dtype == a_dtype else grad_a.to(a_dtype)
            if need_x:
                grad_x = torch.mm(grad, w).add_(torch.mm(grad_h, a))
                grad_x = grad_x if grad_x.dtype == x_dtype else grad_x.to(x_dtype)
        return grad_x, None, grad_a, grad_b, None, None


def _kernel_products(x, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """:class:`LoraMatmuls`' ``y`` in ``concept.lora_triton``'s two ops (three kernels): the operands cast to ``dtype`` once
    (autocast off), as the matmuls cast them; their gradients cast back by autograd."""
    with torch.autocast(x.device.type, enabled=False):
        return lora_triton.lora_linear(*_in_dtype(dtype, x, weight, lora_a, lora_b), scaling)


def _compute_dtype(x: torch.Tensor, tensors) -> torch.dtype | None:
    """The dtype the LoRA products run in, as peft + autocast would run them; None where the fused path
    does not apply (mixed dtypes outside autocast, or autocast over something other than fp32)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return dtype if all(t.dtype in (dtype, torch.float32) for t in (x, *tensors)) else None
    return x.dtype if all(t.dtype == x.dtype for t in tensors) else None


def _lora_linear_class():
    from peft.tuners.lora import Linear

    return Linear


class _FusedLoraForward:
    """The forward of :class:`FusedLoraLinear` (a mixin: the class itself is made with peft's ``lora.Linear``
    as its base the first time it is needed, so that importing ``concept.lora`` does not import peft)."""

    adapter_kernel = "matmuls"  # (``use_fused_lora`` sets each layer's: ``LoraSettings.kernel``)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fused = self._fused_inputs(x, args, kwargs)
        if fused is None:
            return super().forward(x, *args, **kwargs)
        base, lora_a, lora_b, scaling, dtype = fused
        casts = getattr(self, "adapter_casts", None)
        if casts is not None and lora_a.dtype != dtype:
            if not torch.compiler.is_compiling():
                lora_a, lora_b = casts.weights(self, lora_a, lora_b, dtype) or (lora_a, lora_b)
            else:  # (a whole forward's graph: the adapters cast before it, ``AdapterCasts.cast_outside``)
                cast = getattr(self, "adapter_cast", None)
                if cast is not None and cast[0].dtype == dtype:
                    lora_a, lora_b, scaling = cast
        x2 = x.reshape(-1, x.shape[-1])
        if lora_triton.chosen(self.adapter_kernel, x.device):  # (``--lora-kernel triton`` / ``auto``)
            flat = _kernel_products(x2, base.weight, lora_a, lora_b, scaling, dtype)
        else:
            matmuls = lora_matmuls if torch.compiler.is_compiling() else LoraMatmuls.apply
            flat = matmuls(x2, base.weight, lora_a, lora_b, scaling, dtype)
        return flat.view(*x.shape[:-1], flat.shape[-1])

    def _fused_inputs(self, x, args, kwargs):
        if args or kwargs or self.disable_adapters or self.merged:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant:
            return None
        name = active[0]
        base = self.get_base_layer()
        if type(base) is not nn.Linear or base.bias is not None or base.weight.requires_grad:
            return None
        if not isinstance(self.lora_dropout[name], nn.Identity):
            return None
        lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = _compute_dtype(x, (base.weight, lora_a, lora_b))
        if dtype is None:
            return None
        return base, lora_a, lora_b, float(self.scaling[name]), dtype


_FUSED_CLASS = None


def fused_lora_class():
    """``FusedLoraLinear``: peft's ``lora.Linear`` with :class:`_FusedLoraForward`'s forward."""
    global _FUSED_CLASS
    if _FUSED_CLASS is None:
        _FUSED_CLASS = type("FusedLoraLinear", (_FusedLoraForward, _lora_linear_class()), {"__module__": __name__})
    return _FUSED_CLASS


def __getattr__(name: str):
    if name == "FusedLoraLinear":  # (pickle and copy find the class by this name)
        return fused_lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_fused_lora(backbone: nn.Module, kernel: str = "matmuls") -> int:
    """Give every peft ``lora.Linear`` of ``backbone`` the fused forward (in place: the module, its
    parameters and its state dict stay as they are), computed by ``kernel`` (``LoraSettings.kernel``: ``triton`` and
    ``auto`` where Triton runs on the input's device, else the matmuls: ``concept.lora_triton.chosen``); returns how
    many."""
    plain, fused = _lora_linear_class(), fused_lora_class()
    count = 0
    for module in backbone.modules():
        if type(module) is plain:
            module.__class__ = fused
            count += 1
    members = [m for m in backbone.modules() if type(m) is fused]
    casts = AdapterCasts(members)
    for module in members:
        module.adapter_kernel = kernel
        module.adapter_casts = casts
        module.__dict__["adapter_cast"] = None  # (``AdapterCasts.cast_outside``'s, for the call of one graph)
    return count


# -- the adapters cast to the compute dtype together ----------------------------------------------
# Under bf16 autocast (or over a base stored in bf16) every adapted layer's fp32 ``A`` and ``B`` are cast to
# bf16 at each use, and their bf16 gradients back to fp32: one small kernel each, per layer and step (420 +
# 420 in a 30-layer SmolLM2 step with LoRA on its 7 projections). ``AdapterCasts`` casts all the adapter
# weights of a backbone at once, at the first adapted layer a forward reaches, and hands each layer its
# views (``CastTogether``: one ``cat`` per group of weights whose trailing dims agree, ONE cast, the views
# back; its backward: the gradients gathered the same way, ONE cast back to fp32, a view for each weight).
# An elementwise cast is the same cast: the values and gradients are bit for bit those of the per-use casts.


class CastTogether(torch.autograd.Function):
    """``weights`` (2-D, one dtype) cast to ``dtype`` with one cast: a view of the result for each weight; the
    gradients of the views (those that get one: the others' stay None) cast back the same way."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights):
        ctx.set_materialize_grads(False)
        ctx.source_dtype = weights[0].dtype
        with torch.autocast(weights[0].device.type, enabled=False):
            return tuple(_cast_together(weights, dtype))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        out = [None] * len(grads)
        if present:
            with torch.autocast(grads[present[0]].device.type, enabled=False):
                for i, g in zip(present, _cast_together([grads[i].contiguous() for i in present], ctx.source_dtype)):
                    out[i] = g
        return (None, *out)


def _cast_together(tensors, dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]`` (2-D, contiguous) with one cast: the tensors whose trailing dims agree
    are concatenated along dim 0 (no copy per tensor: a ``cat`` per group), the groups flattened into one
    vector, cast, and split back (contiguous views, each of its tensor's shape)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape[1:]), []).append(i)
    blocks = [torch.cat([tensors[i] for i in members]) if len(members) > 1 else tensors[members[0]]
              for members in groups.values()]
    flat = torch.cat([b.reshape(-1) for b in blocks]) if len(blocks) > 1 else blocks[0].reshape(-1)
    cast = flat.to(dtype)
    parts = cast.split([b.numel() for b in blocks]) if len(blocks) > 1 else (cast,)
    out: list = [None] * len(tensors)
    for members, block, part in zip(groups.values(), blocks, parts):
        pieces = part.view(block.shape).split([tensors[i].shape[0] for i in members]) if len(members) > 1 \
            else (part.view(block.shape),)
        for i, piece in zip(members, pieces):
            out[i] = piece
    return out


class CastInto(torch.autograd.Function):
    """``weights`` (one dtype and device) cast into ``buffers`` of their own (one a weight, in the compute dtype,
    allocated once: :class:`_Plan`) by one multi-tensor copy (``torch._foreach_copy_``: on CUDA a few kernel
    launches for any number of weights, casting as it copies); returns a view of each buffer. ``scales`` (one a
    weight, a power of two or 1): a weight's cast is multiplied by its scale (a multi-tensor multiply a scale), and
    its gradient is before its cast back, as autograd orders a cast then a multiply. The gradients (those that
    come: the others' stay None) are cast back to the weights' dtype the same way, each into a new tensor.

    Why buffers that keep their addresses, unlike :class:`CastTogether`'s views of one new cast: a graph's nested
    compile regions refuse inputs that share memory, and dynamo takes a tensor it reaches through a module's
    attribute for a static input, whose address CUDA graphs keep from replay to replay
    (``concept.compiled.WholeForward.cast_adapters``). The buffers are written at every call (an optimizer's
    fused step changes the weights without a new version: nothing cheaper says they changed), keeping their
    version, so that a second forward before a backward (two losses summed) does not invalidate the views the
    first one's graph saved, which hold the same values."""

    @staticmethod
    def forward(ctx, buffers: list, scales: tuple, *weights):
        ctx.set_materialize_grads(False)
        ctx.source_dtype, ctx.scales = weights[0].dtype, scales
        with torch.autocast(weights[0].device.type, enabled=False), contextlib.ExitStack() as kept:
            for b in buffers:
                kept.enter_context(torch.autograd._unsafe_preserve_version_counter(b))
            _cast_each(weights, scales, scale_first=False, out=buffers)
        return tuple(b.view_as(b) for b in buffers)

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        out = [None] * len(grads)
        if present:
            cast = [torch.empty_like(grads[i], dtype=ctx.source_dtype) for i in present]
            with torch.autocast(grads[present[0]].device.type, enabled=False):
                _cast_each([grads[i] for i in present], [ctx.scales[i] for i in present], scale_first=True, out=cast)
            for i, g in zip(present, cast):
                out[i] = g
        return (None, None, *out)


def _cast_each(tensors, scales, scale_first: bool, out: list) -> None:
    """``out[i] = tensors[i].to(out[i].dtype) * scales[i]`` (with ``scale_first``: ``(tensors[i] * scales[i]).to(...)``)
    by multi-tensor ops: a copy for all, a multiply a scale other than 1."""
    scaled: dict[float, list[int]] = {}
    for i, s in enumerate(scales):
        if s != 1.0:
            scaled.setdefault(float(s), []).append(i)
    tensors = list(tensors)
    if scale_first:
        for s, members in scaled.items():
            for i, t in zip(members, torch._foreach_mul([tensors[i] for i in members], s)):
                tensors[i] = t
    torch._foreach_copy_(out, tensors)
    if not scale_first:
        for s, members in scaled.items():
            torch._foreach_mul_([out[i] for i in members], s)


def _buffers(weights, dtype: torch.dtype) -> list[torch.Tensor]:
    """A contiguous tensor in ``dtype`` for each weight, for :class:`CastInto` to write (made with inference mode off:
    in a user's inference mode they would be inference tensors, which a later training call could not save for its
    backward)."""
    with torch.inference_mode(False):
        return [torch.empty_like(w, dtype=dtype, memory_format=torch.contiguous_format) for w in weights]


class _Cast:
    """One cast of the adapters: each member's weights as they were cast (``stamps``: the parameters and their
    versions then) and which members used their views already."""

    def __init__(self, members, weights, dtype: torch.dtype):
        self.slot = {id(m): i for i, m in enumerate(members)}
        self.stamps = [(w, tensor_version(w)) for w in weights]
        self.views = CastTogether.apply(dtype, *weights)
        self.used = [False] * len(members)

    def views_of(self, module, lora_a, lora_b):
        """``module``'s cast ``A`` and ``B``; None when it has no slot, its weights changed since, or it used
        them already: a layer's second use is the next forward (or, in one graph, a second use, whose
        gradients would add up in the compute dtype where the per-use casts add them in fp32)."""
        i = self.slot.get(id(module))
        if i is None:
            return None
        (a, va), (b, vb) = self.stamps[2 * i], self.stamps[2 * i + 1]
        if self.used[i] or a is not lora_a or b is not lora_b or tensor_version(a) != va or tensor_version(b) != vb:
            return None
        self.used[i] = True
        return self.views[2 * i], self.views[2 * i + 1]


_PLAIN = (torch.Tensor, nn.Parameter)


class AdapterCasts:
    """The adapter weights of one backbone's fused LoRA layers (``use_fused_lora``), cast to a compute dtype
    together: at the first adapted layer a forward reaches, every member's ``A`` and ``B`` are cast at once
    (:class:`CastTogether`) and each layer then takes its views. A cast is kept per (dtype, device, source
    dtype, whether it records gradients, inference mode) and made again when a layer used its views once
    already (the next forward, a second use in the same graph, a checkpointed layer's
    recomputation in backward) or finds its weights replaced or changed (their versions): so once per
    forward, whatever changed the weights in between. Not used: under ``torch.compile`` (the compiled graph
    casts, or is handed the casts :meth:`cast_outside` made before it), with sharded (FSDP2) adapters, or for a
    layer whose adapters are not the members' dtype (each layer casts its own, as before)."""

    def __init__(self, members):
        self.members = members
        self.casts: dict[tuple, _Cast] = {}
        self.disabled = False
        self.plans: dict[torch.device, _Plan] = {}  # device -> what ``cast_outside`` casts there, and into what

    def __deepcopy__(self, memo):  # (the members refer to their group: the copy is in the memo before them)
        import copy

        copied = memo[id(self)] = AdapterCasts([])
        copied.members, copied.disabled = copy.deepcopy(self.members, memo), self.disabled
        return copied

    def __getstate__(self):
        return {"members": self.members, "casts": {}, "disabled": self.disabled, "plans": {}}

    def weights(self, module, lora_a, lora_b, dtype: torch.dtype):
        """``module``'s ``A`` and ``B`` in ``dtype`` from the current cast (made first if there is none, or if
        ``module`` cannot use it); None where this does not apply: the layer casts its own."""
        if self.disabled:
            return None
        grad = torch.is_grad_enabled() and (lora_a.requires_grad or lora_b.requires_grad)
        key = (dtype, lora_a.device, lora_a.dtype, grad, torch.is_inference_mode_enabled())
        cast = self.casts.get(key)
        if cast is not None and id(module) not in cast.slot:
            return None  # (a layer the cast left out: its own dtype, device or adapters)
        views = cast.views_of(module, lora_a, lora_b) if cast is not None else None
        if views is None:
            cast = self._cast(key)
            views = cast.views_of(module, lora_a, lora_b) if cast is not None else None
        return views

    def _cast(self, key) -> _Cast | None:
        members, weights = self._castable(*key[1:3])
        if not members:
            return None
        self.casts[key] = _Cast(members, weights, key[0])
        return self.casts[key]

    def _castable(self, device, source_dtype):
        """The members whose one active adapter's ``A`` and ``B`` are plain 2-D tensors of ``source_dtype`` on
        ``device``, and those weights (``A``, ``B`` each); none, and this group disabled, where a weight is not a
        plain tensor."""
        members, weights = [], []
        for module in self.members:
            active = [name for name in module.active_adapters if name in module.lora_A]
            if len(active) != 1:
                continue
            a, b = module.lora_A[active[0]].weight, module.lora_B[active[0]].weight
            if type(a) not in _PLAIN or type(b) not in _PLAIN:  # e.g. FSDP2's DTensors (a subclass: not plain)
                self.disabled = True
                self.casts.clear()
                return [], []
            if a.device == b.device == device and a.dtype == b.dtype == source_dtype and a.dim() == b.dim() == 2:
                members.append(module)
                weights += [a, b]
        return members, weights

    def cast_outside(self, dtype: torch.dtype, device: torch.device) -> list:
        """Every member's fp32 ``A`` and ``B`` cast to ``dtype`` at once, eagerly (:class:`CastInto`), for a whole
        forward's graph to take as its inputs instead of casting each weight itself: compiled, each cast is a
        kernel a weight and direction (844 in a SmolLM2 step with LoRA on its 7 projections), where this is one
        multi-tensor copy each way. Each member gets its ``adapter_cast``: ``(A, B, the scale left for its
        products)``, a power-of-two scale folded into ``B``'s cast (:data:`FOLD_SCALE`); an
        attribute of the layer's own, so that a nested compile region's graph traced for one layer serves the
        next. Returns the members given one, whose cast the caller clears (:func:`clear_outside`) after its call."""
        if self.disabled or dtype == torch.float32:
            return []
        plan = self.plans.get(device)
        if plan is None or not plan.current(device):
            members, weights = self._castable(device, torch.float32)
            plan = self.plans[device] = _Plan(members, weights)
        if not plan.members:
            return []
        if dtype not in plan.buffers:
            plan.buffers[dtype] = _buffers(plan.weights, dtype)
        views = CastInto.apply(plan.buffers[dtype], plan.scales, *plan.weights)
        for i, (module, left) in enumerate(zip(plan.members, plan.left)):
            module.__dict__["adapter_cast"] = (views[2 * i], views[2 * i + 1], left)
        return plan.members


class _Plan:
    """What :meth:`AdapterCasts.cast_outside` casts on a device: the members, their weights (``A``, ``B`` each), each
    weight's scale, each member's scale left for its products, and the buffers each compute dtype is cast into (made
    at its first cast: their addresses then stay); kept while every member's active adapter and its weights are the
    same objects (checked at each call through the parameter dicts: 0.07 ms for 210 layers, where finding them
    anew takes about 1 ms)."""

    def __init__(self, members, weights):
        self.members, self.weights = members, weights
        self.buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self.refs = []  # (module, its active adapters, A's and B's parameter dicts)
        scales, self.left = [], []
        for module in members:
            active = module.active_adapters
            name = [n for n in active if n in module.lora_A][0]
            self.refs.append((module, list(active), module.lora_A[name]._parameters, module.lora_B[name]._parameters))
            scaling = float(module.scaling[name])
            fold = FOLD_SCALE and scaling != 1.0 and _exact_power_of_two(scaling)
            scales += [1.0, scaling if fold else 1.0]
            self.left.append(1.0 if fold else scaling)
        self.scales = tuple(scales)

    def current(self, device: torch.device) -> bool:
        if not self.weights or self.weights[0].device != device or self.weights[0].dtype != torch.float32:
            return False  # (none found: looked for again at each call, e.g. until the model is on the device)
        return all(a.get("weight") is self.weights[2 * i] and b.get("weight") is self.weights[2 * i + 1]
                   and module.active_adapters == active for i, (module, active, a, b) in enumerate(self.refs))


def clear_outside(members) -> None:
    """Drop the casts :meth:`AdapterCasts.cast_outside` gave ``members``."""
    for module in members:
        module.__dict__["adapter_cast"] = None


# -- the adapters merged into the base, for inference (``concept.load(..., merge_lora=True)``, ``--merge-lora``) ----
# An adapted projection computes ``x W^T + s (x A^T) B^T``: three matmuls and an add a call, and under bf16 the
# adapters cast to bf16 at every forward (frozen weights, cast per call). Merged, ``W' = W + s B A`` once, in the
# base's fp32, and the projection is the plain ``nn.Linear`` again: the forward of the backbone without adapters,
# whatever the model computes with it. The same values up to fp32 rounding (the order of the sums); under bf16 the
# merged weight is rounded once, the nearest bf16 to the trained weight, as the unmerged base is to the untrained one.

def merge_adapters(backbone: nn.Module) -> int:
    """Merge every LoRA adapter of ``backbone`` into its frozen base weight (peft's own ``merge``, checked for
    non-finite values) and put the plain base layer back in its place, in place; returns how many layers. The base
    must be fp32 (the weights the run saved): merging into bf16 would round the adapters' update away. The backbone
    then records the count (``lora_merged``): its adapters are gone, so anything that needs them apart (the frozen
    backbone without them, saving them) refuses it."""
    from peft.tuners.lora import LoraLayer

    layers = [(name, m) for name, m in backbone.named_modules() if isinstance(m, LoraLayer)]
    for name, layer in layers:
        weight = layer.get_base_layer().weight
        if weight.dtype != torch.float32:
            raise ConceptError(f"merge_lora: {name}'s base weight is {weight.dtype}, not fp32; merge the adapters "
                               f"before storing the base in another dtype (concept.load(..., merge_lora=True, "
                               f"dtype=...) does)")
    for name, layer in layers:
        try:
            layer.merge(safe_merge=True)
        except ValueError as exc:  # (peft: the merged weight has NaN or inf)
            raise ConceptError(f"merge_lora: {name}: {exc} (the run's adapters hold non-finite values); nothing on "
                               f"disk was changed") from None
        parent, _, child = name.rpartition(".")
        setattr(backbone.get_submodule(parent) if parent else backbone, child, layer.get_base_layer())
    backbone.lora_merged = lora_merged(backbone) + len(layers)
    return len(layers)


def lora_merged(backbone: nn.Module) -> int:
    """How many adapted layers :func:`merge_adapters` merged into ``backbone``'s base (0: none)."""
    return getattr(backbone, "lora_merged", 0)


def lora_state_dict(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights, whole (FSDP2-sharded weights are gathered: every rank must call it)."""
    return {k: full_tensor(v).detach().cpu().contiguous() for k, v in backbone.state_dict().items() if "lora_" in k}


def load_lora_state_dict(backbone: nn.Module, state: dict[str, torch.Tensor]) -> None:
    try:
        missing = backbone.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes differ: another rank
        first = next(iter(str(exc).splitlines()[1:]), str(exc)).strip()
        raise RunFolderError(f"adapter weights do not match the model's LoRA settings ({first}); "
                             f"train with the same --lora-rank / --lora-targets") from None
    unexpected = list(missing.unexpected_keys)
    absent = [k for k in missing.missing_keys if "lora_" in k]
    if unexpected or absent:
        raise RunFolderError(f"adapter weights do not match the model's LoRA settings (unexpected {unexpected[:3]}, "
                             f"missing {absent[:3]}); train with the same --lora-rank / --lora-targets")


# -- standard peft adapter folders -----------------------------------------------------------
# ``save_peft_adapter`` writes what ``PeftModel.save_pretrained`` writes for a model wrapped with
# ``get_peft_model``: adapter_config.json (``LoraConfig.save_pretrained``) and adapter_model.safetensors
# (``get_peft_model_state_dict``: no adapter name, keys under ``base_model.model.``), so that
# ``peft.PeftModel.from_pretrained(plain_hf_backbone, folder)`` loads it onto the plain transformers model.

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the wrapped transformers model
_LAYER_INDEX = r"\.layers\.(\d+)\."


def _layer_of(key: str) -> int | None:
    import re

    match = re.search(_LAYER_INDEX, key)
    return int(match.group(1)) if match else None


def _kept_index(i: int, removed: tuple[int, int]) -> int:
    """Layer ``i``'s index once the block ``removed`` is deleted (``i`` is not in it)."""
    return i - (removed[1] - removed[0]) if i >= removed[1] else i


def save_peft_adapter(backbone: nn.Module, folder, base_model_name_or_path: str | None = None,
                      removed: tuple[int, int] | None = None, state: dict[str, torch.Tensor] | None = None,
                      renumber: bool = False):
    """Write the LoRA adapters injected in ``backbone`` (``add_lora``) as a standard peft adapter folder.

    ``removed=(start, stop)`` (the pruned baseline's skipped block): those layers' adapters are left
    out (they never train: the baseline does not run those layers) and the config's
    ``layers_to_transform`` lists the kept layers, so peft injects adapters on the kept layers only.
    Loaded with peft onto the full backbone this gives the dense forward with the pruned run's
    adapters; delete layers ``start..stop-1`` afterwards to get the pruned baseline itself.
    ``state``: the adapter weights as ``lora_state_dict`` returns them, when already at hand (default:
    ``lora_state_dict(backbone)``, which gathers FSDP2-sharded adapters: a collective, so under FSDP2
    gather on every rank and pass ``state`` on the rank that writes). ``renumber``: the removed layers are
    deleted from the base it is saved for too (a pruned ``concept export``): the kept layers' adapters are
    numbered 0..n-1 as that base's layers are, and apply to all of them. Returns the folder."""
    import copy
    from pathlib import Path

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file


    configs = getattr(backbone, "peft_config", None) or {}
    if "default" not in configs:
        raise ConceptError("this backbone carries no LoRA adapters (concept.lora.add_lora); nothing to save")
    config = copy.deepcopy(configs["default"])
    state = lora_state_dict(backbone) if state is None else state
    state = get_peft_model_state_dict(backbone, state_dict=state)  # adapter name removed, as PeftModel.save_pretrained
    if removed is not None and removed[1] > removed[0]:
        start, stop = removed
        num_layers = len(decoder(backbone).layers)
        config.layers_to_transform = [i for i in range(num_layers) if not start <= i < stop]
        state = {k: v for k, v in state.items() if (i := _layer_of(k)) is None or not start <= i < stop}
        if renumber:
            import re

            config.layers_to_transform = None
            state = {re.sub(_LAYER_INDEX, lambda m: f".layers.{_kept_index(int(m.group(1)), removed)}.", k, count=1): v
                     for k, v in state.items()}
    config.inference_mode = True
    config.base_model_name_or_path = base_model_name_or_path
    config.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then gives a PeftModelForCausalLM (generate, ...)
    if isinstance(config.target_modules, (set, list, tuple)):
        config.target_modules = sorted(config.target_modules)  # (a set: the file would differ run to run)
    # written whole into a sibling folder, then swapped in: a crash never leaves a torn adapter folder
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(f".{folder.name}.new-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    try:
        config.save_pretrained(str(fresh))
        save_file({PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()},
                  str(fresh / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    fs.replace_dir(fresh, folder)
    return folder


def read_peft_config(folder):
    """The ``LoraConfig`` of a peft adapter folder, with clear errors."""
    from pathlib import Path

    from peft import LoraConfig


    folder = Path(folder)
    if not (folder / PEFT_CONFIG_FILE).is_file() or not (folder / PEFT_WEIGHTS_FILE).is_file():
        raise RunFolderError(f"{folder} is not a peft adapter folder (needs {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE})")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_CONFIG_FILE} is unreadable or not a LoRA config ({exc})") from exc
    if getattr(config, "peft_type", None) is None or str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        raise RunFolderError(f"{folder}: only LoRA adapters are supported, this one is {config.peft_type}")
    return config


def settings_from_peft(config) -> LoraSettings:
    targets = config.target_modules
    if isinstance(targets, str):  # a regex: concept names its targets by module name
        targets = [targets]
    return LoraSettings(rank=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout),
                        targets=",".join(sorted(targets)))


def load_peft_adapter(backbone: nn.Module, folder) -> LoraSettings:
    """Inject the LoRA adapters of a peft adapter folder (``save_peft_adapter``, or any peft LoRA
    folder of this backbone) into ``backbone`` in place, as ``add_lora`` does (only the adapters
    are trainable), and load their weights. Returns the LoRA settings."""
    from pathlib import Path

    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.utils import load_peft_weights


    folder = Path(folder)
    config = read_peft_config(folder)
    config.inference_mode = False
    try:
        state = load_peft_weights(str(folder), device="cpu")
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_WEIGHTS_FILE} is unreadable ({exc})") from exc
    state = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}
    try:
        inject_adapter_in_model(config, backbone)
    except ValueError as exc:  # e.g. target modules this backbone does not have
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone ({exc})") from None
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    use_fused_lora(backbone)
    expected = set(get_lora_keys(backbone))
    try:
        result = set_peft_model_state_dict(backbone, state)
    except RuntimeError as exc:  # shapes differ
        first = next(iter(str(exc).splitlines()[1:]), str(exc)).strip()
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone ({first})") from None
    unexpected = list(result.unexpected_keys)
    absent = sorted(expected & set(result.missing_keys))
    if unexpected or absent:
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone (unexpected {unexpected[:3]}, "
                             f"missing {absent[:3]})")
    return settings_from_peft(config)


def peft_adapter_state(folder) -> dict[str, torch.Tensor] | None:
    """The weights of a peft adapter folder keyed as ``lora_state_dict`` keys them (the adapter named
    ``default``, no ``base_model.model.`` prefix), for ``load_lora_state_dict``; None when ``folder`` holds
    no adapter."""
    from pathlib import Path

    from peft.utils import load_peft_weights


    folder = Path(folder)
    if not (folder / PEFT_CONFIG_FILE).is_file():
        return None
    read_peft_config(folder)
    try:
        state = load_peft_weights(str(folder), device="cpu")
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_WEIGHTS_FILE} is unreadable ({exc})") from exc
    out = {}
    for key, value in state.items():
        key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        head, _, leaf = key.rpartition(".")  # ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight
        out[f"{head}.default.{leaf}" if head.rsplit(".", 1)[-1].startswith("lora_") else key] = value
    return out


def get_lora_keys(backbone: nn.Module) -> list[str]:
    return [k for k in backbone.state_dict() if "lora_" in k]
