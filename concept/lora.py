"""LoRA adapters on the frozen backbone, through peft (injected in place, so the concept model's
views of the decoder layers stay valid)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS  # comma-separated linear-layer names (attention and MLP)

    def validate(self) -> list[str]:
        problems = []
        if self.rank < 1:
            problems.append(f"lora rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            problems.append(f"lora dropout must be in [0, 1), got {self.dropout}")
        if not [t for t in self.targets.split(",") if t.strip()]:
            problems.append("lora targets: name at least one linear layer, e.g. q_proj,v_proj")
        return problems

    def to_dict(self) -> dict:
        return asdict(self)


def add_lora(backbone: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA into ``backbone`` in place; only the adapter weights are trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t.strip() for t in settings.targets.split(",") if t.strip()]
    present = {name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in present]
    if missing:
        from .errors import ConceptError

        raise ConceptError(f"LoRA targets {missing} are not linear layers of this backbone; "
                           f"available: {', '.join(sorted(present))}")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, backbone)
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    return backbone


def lora_state_dict(backbone: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in backbone.state_dict().items() if "lora_" in k}


def load_lora_state_dict(backbone: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from .errors import RunFolderError

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
