"""Concept models on the Hugging Face hub and in transformers.

* **Hub ids.** ``concept.load("org/name")`` downloads the repo with ``huggingface_hub.snapshot_download``
  (its cache, ``revision``, ``token``, ``local_files_only``) and opens the folder (:func:`local_folder`).
* **Saving.** :func:`save_pretrained` writes a model as a ``concept export`` folder (``concept.export``,
  the same writer as ``concept export RUN``), which :func:`push_to_hub` / :func:`push_folder` upload as
  one commit (``HfApi.create_commit``); ``dry_run`` lists the files instead.
* **The transformers side of an export folder** (:func:`write_hf_files`): ``config.json`` (a
  ``concept.hf.configuration_concept`` config with ``auto_map``) and the two modeling files, so that
  ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` opens the concept model;
  the model card (:func:`card`: ``huggingface_hub.ModelCard`` with ``base_model``, ``pipeline_tag``
  and ``license``).
* :class:`HubMixin` gives the concept models ``.config``, ``save_pretrained``, ``push_to_hub`` and
  ``from_pretrained``.

The peft adapter of an export (``adapter/``) names its base by the absolute path of the export's
``backbone/`` (exact weights, offline; it resolves while the folder stays where it was written).
The copy pushed to the hub names the backbone's real hub id instead where it has one and keeps all
its layers (SmolLM2: ``HuggingFaceTB/SmolLM2-135M-Instruct``), else no base: the card then loads the
base from the repo's ``backbone`` subfolder.
"""
from __future__ import annotations

import json
import os
import pkgutil
import re
import tempfile
from pathlib import Path

from . import __version__
from .config import make_component_config
from .errors import ConceptError, RunFolderError
from .migrate import migrate_run
from .registry import registry

HF_CONFIG_FILE = "config.json"
HF_CODE = ("configuration_concept.py", "modeling_concept.py")  # copied from concept/hf/ into every export
PIPELINE_TAG = "text-generation"
ADAPTER_CONFIG = "adapter/adapter_config.json"
# The loader and the export writer stand above the model classes (they build, load and check models), so a
# model reaches them by name at call time, as an entry point is reached, and this module imports neither.
LOADER = "concept.builder:load"
WRITER = "concept.export:write_export"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# -- hub ids ------------------------------------------------------------------------------------
def is_repo_id(text: str) -> bool:
    """``org/name`` (and not a local path that exists)."""
    text = str(text)
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "~")) and not Path(text).exists()


def local_folder(path, revision: str | None = None, cache_dir=None, token=None, local_files_only: bool = False,
                 force_download: bool = False, subfolder: str | None = None) -> Path:
    """``path`` itself when it is a local path (or not a hub id); a hub id's snapshot folder, downloaded
    into (or read from) the Hugging Face cache, otherwise."""
    if not is_repo_id(str(path)):
        return Path(path) / subfolder if subfolder else Path(path)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(str(path), revision=revision, cache_dir=cache_dir, token=token,
                                   local_files_only=local_files_only, force_download=force_download)
    except Exception as exc:  # offline, unknown repo, no access: one line, with what to do
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunFolderError(
            f"{path} is not a local folder, and fetching it from the Hugging Face hub failed ({type(exc).__name__}"
            f"{': ' + reason if reason else ''}); check the repo id, your network and login (`hf auth login`), "
            f"or pass a local folder") from None
    return Path(folder) / subfolder if subfolder else Path(folder)


# -- the transformers side of a model -----------------------------------------------------------
def model_kind(model) -> str:
    """The model's family (a baseline's: ``dense`` / ``pruned``), as the export's ``modeling_concept.py`` asks it."""
    return model.family


def exported_layers(model) -> int:
    """The layers of the backbone an export of ``model`` holds (a pruned baseline's skipped ones are deleted)."""
    removed = getattr(model, "removed", None)
    return int(model.backbone.config.num_hidden_layers) - (removed[1] - removed[0] if removed else 0)


def hf_config(model):
    """The model's ``config.json`` as a transformers config of its kind (``concept.hf``), with ``auto_map``."""
    # lazy: transformers, which `concept export --help` and the hub ids do not need
    from .hf.configuration_concept import config_class

    kind = model_kind(model)
    backbone = model.backbone.config
    config = config_class(kind)
    model_name = model_class_name(config)
    return config(concept_kind=kind, concept_version=__version__, vocab_size=backbone.vocab_size,
                  hidden_size=backbone.hidden_size, num_hidden_layers=exported_layers(model),
                  max_position_embeddings=getattr(backbone, "max_position_embeddings", None),
                  bos_token_id=getattr(backbone, "bos_token_id", None), eos_token_id=getattr(backbone, "eos_token_id", None),
                  architectures=[model_name],
                  auto_map={"AutoConfig": f"configuration_concept.{config.__name__}",
                            "AutoModelForCausalLM": f"modeling_concept.{model_name}"})


def model_class_name(config: type) -> str:
    """The name of the ``concept.hf.modeling_concept`` class of a config class (``ConceptStreamingConfig`` ->
    ``ConceptStreamingForCausalLM``): the modeling file imports this module, so it is named, not imported."""
    return config.__name__.removesuffix("Config") + "ForCausalLM"


def write_hf_files(model, folder: Path) -> None:
    """``config.json`` and the modeling code (``concept/hf``) into an export folder."""
    folder = Path(folder)
    hf_config(model).save_pretrained(folder)
    source = Path(__file__).parent / "hf"
    for name in HF_CODE:
        (folder / name).write_text((source / name).read_text())


# -- the model card ------------------------------------------------------------------------------
def provenance(backbone: dict | None) -> dict:
    """``{"base_model": hub id or None, "license": ...}`` of a backbone (``{"name", "params"}`` as in a build
    config), from its plugin's ``provenance(config)``; ``license`` is ``other`` when it is not known."""
    found = {}
    try:
        cls = registry("backbone").get((backbone or {}).get("name", ""))
        config, _ = make_component_config(cls, dict((backbone or {}).get("params") or {}), "backbone")
        if config is not None and callable(getattr(cls, "provenance", None)):
            found = cls.provenance(config) or {}
    except ConceptError:
        pass
    return {"base_model": found.get("base_model"), "license": found.get("license") or "other"}


def card(body: str, kind: str, backbone: dict | None, lora: str | None):
    """The model card: ``body`` under metadata (``huggingface_hub.ModelCardData``)."""
    from huggingface_hub import ModelCard, ModelCardData

    source = provenance(backbone)
    tags = ["concept", kind, "custom_code"] + (["peft", "lora"] if lora == "adapter" else [])
    data = ModelCardData(base_model=source["base_model"], pipeline_tag=PIPELINE_TAG, license=source["license"],
                         library_name="transformers", tags=tags)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


# -- saving and pushing --------------------------------------------------------------------------
def save_pretrained(model, folder, force: bool = False, merge_lora: bool = False, check: bool = True, report=None):
    """Write ``model`` as a ``concept export`` folder (:func:`concept.export.write_export`): what
    ``concept export`` writes for a run, from the model in memory. ``force`` replaces a non-empty
    folder (atomically, once the new one is complete). Returns the ``ExportResult``."""
    write_export = pkgutil.resolve_name(WRITER)
    return write_export(model, Path(folder), merge_lora=merge_lora, force=force, check=check, report=report)


def upload_files(folder: Path) -> list[dict]:
    folder = Path(folder)
    return [{"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()]


def hub_adapter_base(record: dict) -> str | None:
    """The base the pushed ``adapter_config.json`` names: the backbone's real hub id when it has one and the
    export keeps all its layers, else None (see the module docstring)."""
    exported = record.get("export") or {}
    if exported.get("backbone_pruned"):
        return None
    return provenance(exported.get("backbone") or record["config"].get("backbone"))["base_model"]


def push_folder(folder, repo_id: str, private: bool | None = None, token: str | None = None,
                revision: str | None = None, commit_message: str | None = None, dry_run: bool = False) -> dict:
    """Upload the export folder ``folder`` to the hub model repo ``repo_id`` (created if missing) as one commit.
    Returns ``{"repo", "files": [{"path", "bytes"}], "dry_run", "adapter_base", "url", "commit"}``; with
    ``dry_run`` nothing is uploaded (``url`` and ``commit`` are None)."""
    folder = Path(folder)
    if not (folder / HF_CONFIG_FILE).is_file() or not (folder / "concept.json").is_file():
        raise RunFolderError(f"{folder} is not a concept export folder (no {HF_CONFIG_FILE} / concept.json); write one "
                             f"with `concept export RUN -o {folder}` or model.save_pretrained({str(folder)!r})")
    if not _REPO_ID.match(repo_id or ""):
        raise ConceptError(f"--push-to-hub {repo_id!r}: expected a hub repo id NAMESPACE/NAME, e.g. my-org/my-model")
    record = migrate_run(json.loads((folder / "concept.json").read_text()))  # (an older format's: today's)
    files = upload_files(folder)
    adapter = None
    result = {"repo": repo_id, "files": files, "dry_run": dry_run, "adapter_base": None, "url": None, "commit": None}
    if (folder / ADAPTER_CONFIG).is_file():
        settings = json.loads((folder / ADAPTER_CONFIG).read_text())
        settings["base_model_name_or_path"] = result["adapter_base"] = hub_adapter_base(record)
        adapter = json.dumps(settings, indent=2, sort_keys=True).encode()
        next(f for f in files if f["path"] == ADAPTER_CONFIG)["bytes"] = len(adapter)
    if dry_run:
        return result
    from huggingface_hub import CommitOperationAdd, HfApi

    kind = (record.get("export") or {}).get("kind") or record["config"]["family"]
    operations = [CommitOperationAdd(path_in_repo=f["path"], path_or_fileobj=adapter if f["path"] == ADAPTER_CONFIG
                                     else str(folder / f["path"])) for f in files]
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        info = api.create_commit(repo_id=repo_id, operations=operations, revision=revision,
                                 commit_message=commit_message or f"Upload a concept {kind} model ({len(files)} files)")
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConceptError(f"pushing {folder} to the hub repo {repo_id} failed ({reason}); the folder is intact: check "
                           f"your network and login (`hf auth login`), then push it again") from None
    result.update(repo=repo_id, url=getattr(info, "commit_url", None), commit=getattr(info, "oid", None))
    return result


def push_to_hub(model, repo_id: str, private: bool | None = None, token: str | None = None, revision: str | None = None,
                commit_message: str | None = None, dry_run: bool = False, merge_lora: bool = False) -> dict:
    """:func:`save_pretrained` into a temporary folder, then :func:`push_folder` it."""
    with tempfile.TemporaryDirectory(prefix="concept-push-") as tmp:
        folder = Path(tmp) / "export"
        save_pretrained(model, folder, merge_lora=merge_lora)
        return push_folder(folder, repo_id, private=private, token=token, revision=revision,
                           commit_message=commit_message, dry_run=dry_run)


class HubMixin:
    """``model.config`` (its transformers config), ``model.save_pretrained(folder)``,
    ``model.push_to_hub(repo_id)`` and ``Class.from_pretrained(folder_or_hub_id)`` on a concept model."""

    @property
    def config(self):
        return hf_config(self)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs):
        """:func:`concept.hub.save_pretrained` (``force``, ``merge_lora``, ``check``)."""
        return save_pretrained(self, save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs) -> dict:
        """:func:`concept.hub.push_to_hub` (``private``, ``token``, ``revision``, ``commit_message``, ``dry_run``)."""
        return push_to_hub(self, repo_id, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path, **hub_kwargs):
        """``concept.load(name_or_path)`` (a folder or a hub id; ``revision``, ``token`` ...), which must hold a model
        of this class."""
        load = pkgutil.resolve_name(LOADER)
        model = load(name_or_path, **hub_kwargs)
        if not isinstance(model, cls):
            raise ConceptError(f"{name_or_path} holds a {model_kind(model)} model ({type(model).__name__}), not a "
                               f"{cls.__name__}; open it with concept.load")
        return model
