"""Routing the backbone's own attention through concept's masks.

The backbone's decoder layers are called unchanged. Their attention module asks
transformers' ``AttentionInterface`` for the function registered under
``config._attn_implementation``; we register ``"concept"`` (idempotently, from the
builder, never at import) and pass an *attention plan* object as the layer's
``attention_mask``. The function calls the plan; anything else (a tensor mask or None,
e.g. when the plain backbone runs as the dense baseline) goes to transformers' own SDPA path.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from einops import rearrange

NAME = "concept"


class AttentionPattern:
    """A prepared attention pattern: ``pattern(q, k, v, scaling) -> [B, L, H, hd]``.

    q: [B, H, Lq, hd], k / v: [B, Hkv, Lk, hd] (grouped-query heads are not expanded).

    Every pattern class is a pytree node (registered as it is defined, third-party ones too): its instance
    attributes are its children, except those named in ``settings`` (a backend's config: compared by value),
    which are its context. A whole forward traced as one graph (``--compile model``) then hands a stack's plan to
    each layer as tensors and constants, which lets dynamo trace one layer of a stack and stamp its graph out for
    the others (``concept.compiled``, "nested compile regions"). An attribute pytree cannot flatten (an object of
    another library) leaves the layers traced one by one: slower to compile, the same graph.
    """

    settings: tuple[str, ...] = ()  # attributes that are settings, not data (a backend's config dataclass)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(cls, _flatten_pattern, _unflatten_pattern,
                                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")

    def __call__(self, query, key, value, scaling):  # pragma: no cover - interface
        raise NotImplementedError


def _flatten_pattern(pattern: AttentionPattern):
    """A pattern's data attributes (children), and its class, their names and its settings (context). A setting
    that is an object (a config dataclass) is in the context as its class and its attributes' values: constants
    that dynamo can compare, where the object itself is not one."""
    names = tuple(sorted(n for n in vars(pattern) if n not in pattern.settings))
    settings = tuple(_as_constant(n, getattr(pattern, n)) for n in pattern.settings)
    return [getattr(pattern, n) for n in names], (type(pattern), names, settings)


def _as_constant(name: str, setting) -> tuple:
    """(name, None, the value) for a constant; (name, its class, its attributes) for an object."""
    if not hasattr(setting, "__dict__"):
        return name, None, setting
    return name, type(setting), tuple(sorted(vars(setting).items()))


def _unflatten_pattern(children, context) -> AttentionPattern:
    cls, names, settings = context
    pattern = cls.__new__(cls)
    pattern.__dict__.update(zip(names, children))
    for name, cls_of_setting, value in settings:
        if cls_of_setting is not None:
            value, attributes = cls_of_setting.__new__(cls_of_setting), value
            value.__dict__.update(attributes)
        setattr(pattern, name, value)
    return pattern


AttentionPlan = AttentionPattern  # its name before 0.1.1, kept for third-party attention plugins (docs/plugins.md)


def sdpa_dtype(device: torch.device, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype SDPA's kernel sees a query of ``dtype`` (None: the default dtype) in: autocast's where it is on
    (SDPA is on its lower-precision list, CPU and CUDA), else its own. Made once per plan for a mask (a wrong
    guess costs one cast in :func:`sdpa`)."""
    dtype = dtype or torch.get_default_dtype()
    if torch.is_autocast_enabled(device.type) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device.type)
    return dtype


def additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean mask [B, Lq, Lk] (True: allowed) as SDPA applies it, once per plan instead of once per layer and
    call: 0 where allowed, -inf elsewhere, in :func:`sdpa_dtype` (SDPA's own conversion of a boolean mask,
    ``where(mask, 0, -inf)`` in the query's dtype: the same values, bit for bit), [B, 1, Lq, Lk]: with the heads'
    dimension SDPA broadcasts over (added once, not in each call)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.full((mask.shape[0], 1, *mask.shape[1:]), float("-inf"), dtype=sdpa_dtype(mask.device),
                      device=mask.device).masked_fill_(mask[:, None], 0.0)


def sdpa(query, key, value, scaling, mask=None, is_causal=False) -> torch.Tensor:
    """SDPA with grouped-query heads, returning [B, H, Lq, hd]. ``mask`` [B, Lq, Lk]: boolean (True: allowed),
    or additive [B, 1, Lq, Lk] (:func:`additive`; cast to the query's dtype if it was made in another, the same
    values)."""
    if mask is not None and mask.dtype != torch.bool:
        dtype = sdpa_dtype(query.device, query.dtype)
        mask = mask if mask.dtype == dtype else mask.to(dtype)  # (0 and -inf are exact in every float dtype)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=None if mask is None else mask if mask.dim() == 4 else mask[:, None],
        is_causal=is_causal, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )


@functools.lru_cache(maxsize=2)
def causal_block(length: int, device: torch.device) -> torch.Tensor:
    """The causal rule of ``length`` elements [1, L, L] (bool, lower triangle), built once per (length, device)
    and kept (two lengths: a forward's shallow and middle stacks): it depends on the shape alone. Read only."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]


class CausalPattern(AttentionPattern):
    """Plain causal attention over real elements (shallow and middle stacks), optionally
    restricted to the same document. ``causal``: whether plain causal SDPA is exact for every real
    query (right padding or none, one document per row); None: found out from the data (a host sync).
    False builds the mask without looking (static shapes, no sync)."""

    def __init__(self, valid: torch.Tensor, doc: torch.Tensor | None = None, causal: bool | None = None):
        if causal is None:  # Right padding (or none) and one document per row: causal SDPA is exact.
            n = valid.sum(1, keepdim=True)
            right_padded = bool((valid == (torch.arange(valid.shape[1], device=valid.device) < n)).all())
            causal = right_padded and (doc is None or bool((doc == doc[:, :1]).all()))
        self.mask = None
        if not causal:
            L = valid.shape[1]
            block = causal_block.__wrapped__ if torch.compiler.is_compiling() else causal_block  # (a graph: no cache)
            allowed = block(L, valid.device) & valid[:, None, :]
            if doc is not None:
                allowed = allowed & (doc[:, :, None] == doc[:, None, :])
            self.mask = additive(allowed | ~valid[:, :, None])  # (converted once, not in each layer's SDPA)

    def __call__(self, query, key, value, scaling):
        out = sdpa(query, key, value, scaling, self.mask, is_causal=self.mask is None)
        return rearrange(out, "b h l d -> b l h d")


def concept_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if isinstance(attention_mask, AttentionPattern):
        return attention_mask(query, key, value, scaling).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> None:
    """Register ``"concept"`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if AttentionInterface._global_mapping.get(NAME) is not concept_attention:
        AttentionInterface.register(NAME, concept_attention)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


def route(model: torch.nn.Module) -> None:
    """Make every attention layer of a HF model call :func:`concept_attention`."""
    register()
    try:
        model.set_attn_implementation(NAME)
    except Exception:  # older transformers: set the config field directly
        for cfg in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
            cfg._attn_implementation = NAME
