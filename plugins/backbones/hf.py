"""`hf`: any local Hugging Face causal-LM folder or hub id with a Llama/Qwen2/Mistral-style decoder."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from concept.backbone import (
    BackboneInfo,
    LoadedBackbone,
    info_from_hf_config,
    read_folder_config,
)
from concept.contracts import Backbone
from concept.errors import BackboneError, one_line


@dataclass
class HFConfig:
    path: str = ""  # local folder or hub id
    revision: str = "main"
    dtype: str = "float32"

    def validate(self) -> list[str]:
        problems = []
        if not self.path:
            problems.append("path: required (a local model folder or a hub id), e.g. --set backbone.path=./my-model")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype: must be float32, bfloat16 or float16, got {self.dtype!r}")
        return problems


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists() or path.startswith((".", "/", "~"))


class HFBackbone(Backbone):
    Config = HFConfig

    @classmethod
    def describe(cls, config: HFConfig) -> BackboneInfo:
        from transformers import AutoConfig

        if _is_local(config.path):
            folder = Path(config.path).expanduser()
            read_folder_config(folder)  # clear error for missing / corrupt folders
            try:
                hf_cfg = AutoConfig.from_pretrained(folder)
            except Exception as exc:
                raise BackboneError(one_line(f"backbone folder {folder}: cannot read its config ({exc})")) from exc
        else:
            try:
                hf_cfg = AutoConfig.from_pretrained(config.path, revision=config.revision)
            except Exception as exc:
                raise BackboneError(
                    f"cannot fetch '{config.path}' from the Hugging Face hub ({type(exc).__name__}). "
                    f"Without network access, pass a local folder: --set backbone.path=/path/to/model"
                ) from exc
        return info_from_hf_config(hf_cfg, config.path, pretrained=True)

    @classmethod
    def provenance(cls, config: HFConfig) -> dict:
        """A hub id is the base model itself; a local folder's model card (README.md) may name its base and license."""
        if not _is_local(config.path):
            return {"base_model": config.path, "license": None}
        readme = Path(config.path).expanduser() / "README.md"
        if not readme.is_file():
            return {}
        try:
            from huggingface_hub import ModelCard

            data = ModelCard.load(readme).data
        except Exception:  # no metadata, or not a card: nothing known
            return {}
        base = data.base_model if isinstance(data.base_model, str) else None
        return {"base_model": base, "license": data.license}

    @classmethod
    def load(cls, config: HFConfig) -> LoadedBackbone:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        info = cls.describe(config)
        source = str(Path(config.path).expanduser()) if _is_local(config.path) else config.path
        kwargs = {} if _is_local(config.path) else {"revision": config.revision}
        try:
            model, report = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, config.dtype),
                                                                 output_loading_info=True, **kwargs)
        except Exception as exc:
            raise BackboneError(one_line(f"cannot load backbone weights from {source}: {type(exc).__name__}: "
                                         f"{exc}")) from exc
        problems = [f"{len(report[key])} {what} (e.g. {sorted(map(str, report[key]))[0]!r})"
                    for key, what in (("missing_keys", "weights missing: they would be random"),
                                      ("mismatched_keys", "weights of another shape"))
                    if report.get(key)]
        if _is_local(config.path):
            problems += integer_weights(Path(source), model)
        if problems:
            raise BackboneError(f"the backbone folder {source} does not hold this model's weights ({'; '.join(problems)}); "
                                f"restore its files (or export the run again)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        except Exception:
            tokenizer = None
        return LoadedBackbone(model=model, tokenizer=tokenizer, info=info)


def integer_weights(folder: Path, model) -> list[str]:
    """The folder's safetensors tensors stored as integers where the model's are floating point (loading casts
    them silently: a damaged file, not weights)."""
    from safetensors import safe_open

    state = model.state_dict()
    odd = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            odd += [k for k in f.keys() if k in state and state[k].is_floating_point()
                    and not f.get_slice(k).get_dtype().startswith(("F", "BF"))]
    return [f"{len(odd)} weights stored as integers (e.g. {odd[0]!r})"] if odd else []
