"""A training run's optimizer: AdamW over one parameter group per trained part, each with its learning rate."""
from __future__ import annotations

import torch


def param_groups(model, lr: float, lr_new: float) -> list[dict]:
    """The trainable LoRA parameters (``lr``) and each new module's (its own ``learning_rate`` if it has one,
    else ``lr_new``), each group named; parts with nothing to train have none."""
    lora = [p for p in model.backbone.parameters() if p.requires_grad]
    groups = [{"params": lora, "lr": lr, "name": "lora"}] if lora else []
    for name, module in model.new_modules().items():
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": getattr(module, "learning_rate", None) or lr_new, "name": name})
    return groups


def adamw(model, config) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` of ``model`` (``config``: a ``TrainConfig``). Fused: a step whose loss or
    gradients are not finite is skipped on the device (``found_inf``, set by the trainer's step), its step
    counters too, and the counters live on the device (no host read)."""
    groups = param_groups(model, config.lr, config.lr_new)
    return torch.optim.AdamW(groups, weight_decay=config.weight_decay, fused=True)
