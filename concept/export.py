"""``concept export``: a run as a self-contained folder that ``concept.load`` opens anywhere.

    from concept.export import export
    result = export("runs/m1-train", "exports/m1")              # base weights + peft adapter folder
    result = export("runs/m1-train", "exports/m1-merged", merge_lora=True, force=True)
    model = concept.load("exports/m1")                          # no run folder, no backbone cache needed

The exported folder::

    README.md            model card: what the model is, held-out numbers, how to load it
    concept.json         the build plan; its backbone is ``hf`` with path ``./backbone`` (relative to
                         this folder: ``concept.load`` finds it wherever the folder is moved); split and
                         every other component unchanged; ``export`` records where it came from
    train.json           the run's training record (baseline kind, pruned layers, LoRA settings, data)
    modules.safetensors  the concept modules (streaming model; baselines only with MTP heads)
    backbone/            the backbone as a Hugging Face folder: config.json, model.safetensors
                         (``save_pretrained``), tokenizer files; LoRA merged in with ``merge_lora``
    adapter/             the LoRA adapters as a standard peft folder (adapter_config.json,
                         adapter_model.safetensors; ``concept.lora.save_peft_adapter``); not with ``merge_lora``
    metrics.jsonl, curves.png   the run's training log and curves, when it has them

Merging uses peft's own ``PeftModel.from_pretrained(...).merge_and_unload()`` on the plain transformers
backbone. The folder is written next to the target under a temporary name, checked (by default it is
loaded back and its logits compared with the run's on fixed tokens) and only then renamed into place,
so a failure never leaves a half-written export and never removes what was there (``force`` replaces an
existing folder only once the new one is complete).
"""
from __future__ import annotations

import json
import shutil
import warnings as warnings_
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__, checkpoint, fs, run_files
from .backbone import decoder
from .precision import DTYPE_NAMES, cast_base
from .builder import (
    MODULES_FILE,
    PEFT_ADAPTER_DIR,
    RUN_FILE,
    TRAIN_FILE,
    _run_record,
    backbone_folder,
    load,
    read_run,
)
from .config import BuildConfig, resolve
from .errors import ConceptError
from .families import family_of
from .hub import card, exported_layers, write_hf_files
from .lora import lora_merged, save_peft_adapter, settings_from_peft
from .train_config import BASELINES

BACKBONE_DIR = "backbone"
BACKBONE_PATH = f"./{BACKBONE_DIR}"  # the hf backbone's path in the exported concept.json (relative to the folder)
CARD_FILE = "README.md"
COPIED = ("metrics.jsonl", "curves.png")  # the run's log and curves travel with the export
CHECK_TOKENS = 48


@dataclass
class ExportResult:
    path: Path
    source: Path
    kind: str  # streaming | planner-executor | dense | pruned
    lora: str | None  # "adapter" (peft folder), "merged" (into backbone/), None (no adapters: an untrained run)
    step: int | None  # the training step of the exported weights (None: untrained)
    files: list[dict] = field(default_factory=list)  # {"path": relative path, "bytes": size}
    heldout: dict | None = None  # the run's last held-out evaluation (see ``last_evaluation``)
    check: dict | None = None  # {"max_abs_diff", "tolerance", "tokens"}: the reloaded export vs the run
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"], d["source"] = str(self.path), str(self.source) if self.source is not None else None
        return d


def last_evaluation(run: Path, train: dict | None) -> dict | None:
    """The run's last held-out evaluation (metrics.jsonl's last row with an ``eval``), with what it was
    measured on: ``{"step", "eval", "data", "split", "batches", "batch", "seq_len", "tokens"}``."""
    row = None
    for parsed in run_files.read_metrics(run):  # (a torn last line is left out)
        if parsed.get("eval"):
            row = parsed
    if row is None:
        return None
    train = train or {}
    return {"step": row.get("step"), "eval": row["eval"], "data": train.get("data"), "split": "heldout",
            "batches": train.get("eval_batches"), "batch": train.get("batch"), "seq_len": train.get("seq_len"),
            "tokens": row["eval"].get("tokens")}


def check_target(run: Path, out: Path, force: bool, config: dict | None = None) -> None:
    """Refuse, before anything is loaded or written, a target that is not ours to (re)place, or that holds
    the run or its local backbone folder (``config``: the run's build config)."""
    fs.check_target(out, force, {"run": run, "backbone": backbone_folder(config or {})})


def _relative_paths(value, absolute: str, relative: str):
    """``value`` with every string equal to ``absolute`` replaced by ``relative`` (nested dicts and lists)."""
    if isinstance(value, dict):
        return {k: _relative_paths(v, absolute, relative) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative_paths(v, absolute, relative) for v in value]
    return relative if value == absolute else value


def _dtype_name(model: torch.nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _files(folder: Path) -> list[dict]:
    return [{"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()]


def _compare(model, folder: Path, merged: bool) -> dict:
    """Load the written folder back and compare its logits with the run's on fixed tokens. A streaming
    model's concept decisions are taken from the run, so that a decision on the threshold cannot flip
    under the rounding of merged weights; the decisions themselves are compared too."""
    again = load(folder)
    vocab = int(model.backbone.config.vocab_size)
    ids = torch.randint(0, vocab, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        keep = getattr(ours, "keep", None)
        theirs = again(ids, keep=keep) if keep is not None else again(ids)
        free = again(ids) if keep is not None else None
    diff = float((ours.logits - theirs.logits).abs().max())
    tolerance = (1e-3 if merged else 1e-5) * max(1.0, float(ours.logits.abs().max()))
    result = {"max_abs_diff": diff, "tolerance": tolerance, "tokens": CHECK_TOKENS}
    if free is not None:
        result["decisions_equal"] = bool(torch.equal(free.keep, keep))
    if not diff <= tolerance:
        raise ConceptError(f"the exported folder does not reproduce the run: its logits differ by up to {diff:.3g} "
                           f"(tolerance {tolerance:.3g}) on a fixed input; nothing was written")
    return result


def export(run, out, merge_lora: bool = False, force: bool = False, check: bool = True,
           report: Callable[[str, str], None] | None = None) -> ExportResult:
    """Export the run folder ``run`` (built, trained, or a dense / pruned baseline) to ``out``.

    ``merge_lora``: merge the LoRA adapters into the backbone's weights (peft's ``merge_and_unload``)
    instead of writing them as a peft adapter folder. ``force``: replace a non-empty ``out`` (atomically).
    ``check``: load the written folder back and compare its logits with the run's before publishing it.
    ``report(verb, detail)`` receives progress lines and warnings (verb ``"warning:"``); without it,
    warnings go through :mod:`warnings`. An untrained run (no training checkpoint) is exported as built,
    with a warning."""
    run, out = Path(run), Path(out)
    record = read_run(run)  # a clear error for anything that is not a run folder
    check_target(run, out, force, record["config"])
    checkpoint.check_intact(run, "export an earlier copy of the run, or retrain it")
    record, train = run_files.check_files(run)  # every file the export reads, before anything is written
    meta = run_files.checkpoint_state(run)
    result_warnings: list[str] = []

    def say(verb: str, detail: str) -> None:
        if report is not None:
            report(verb, detail)
        elif verb == "warning:":
            warnings_.warn(detail, stacklevel=4)  # (say <- warn <- export <- the caller)

    def warn(message: str) -> None:
        result_warnings.append(message)
        say("warning:", message)

    swept = checkpoint.sweep_if_free(run)  # what a writer killed in the run left there
    if swept:
        say("note:", f"removed {', '.join(swept)} from {run}, left by a writer that was killed")
    if train is None:
        warn(f"{run} was built but never trained (no training checkpoint): exporting the model as built, "
             f"with untrained concept modules and no LoRA adapters")
    elif meta is None:
        warn(f"{run} has no training checkpoint (training stopped before its first one?): exporting the weights "
             f"it started from")

    say("loading", f"{run} ...")
    model = load(run)
    return write_export(model, out, merge_lora=merge_lora, force=force, check=check, report=say, run=run, record=record,
                        train=train, step=meta["step"] if meta else None, warnings=result_warnings)


def _plain_backbone(model):
    """The model's backbone as a plain transformers model (no attention routing, no adapters) holding the
    model's base weights, and its tokenizer."""
    bb = model.resolution.components["backbone"]
    loaded = bb.cls.load(bb.config)
    state = {k.replace(".base_layer.", "."): v for k, v in model.backbone.state_dict().items() if "lora_" not in k}
    loaded.model.load_state_dict(state)
    return loaded.model, loaded.tokenizer


def delete_layers(hf_model, removed: tuple[int, int]) -> None:
    """Delete the decoder layers ``start..stop-1`` of a transformers model in place, with its config's
    ``num_hidden_layers`` (and per-layer lists such as ``layer_types``) and the layers' ``layer_idx`` fixed:
    saved, it is a plain checkpoint of the smaller model."""
    start, stop = removed
    inner, config = decoder(hf_model), hf_model.config
    n = len(inner.layers)
    del inner.layers[start:stop]  # (nn.ModuleList renumbers the rest)
    config.num_hidden_layers = len(inner.layers)
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == n and key != "architectures":
            setattr(config, key, value[:start] + value[stop:])
    for i, layer in enumerate(inner.layers):
        for m in layer.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.layer_idx = i


def _check_saved_as_loaded(model) -> None:
    """Refuse a model whose weights in memory are no longer those its run saved: a base its precision cast, or LoRA
    merged into its base (``concept.load``'s ``dtype`` / ``merge_lora``)."""
    cast = cast_base(model)
    if cast is not None:  # (concept.load(..., dtype="bf16"): the fp32 base it was saved with would be written rounded)
        raise ConceptError(f"this model was loaded with dtype={DTYPE_NAMES[cast]!r}, which stores its frozen base "
                           f"weights in {DTYPE_NAMES[cast]}: writing them would replace the fp32 weights it was saved "
                           f"with by rounded ones; load it with dtype='fp32' (the default) to save or export it; nothing "
                           f"was written")
    if lora_merged(model.backbone):  # (concept.load(..., merge_lora=True): the adapters are inside the base weights)
        raise ConceptError(f"this model was loaded with merge_lora=True, which merged its LoRA adapters into its base "
                           f"weights: its run's adapters and base are no longer apart in memory; load it without "
                           f"merge_lora to save or export it (export's own merge_lora / --merge-lora writes the merged "
                           f"backbone); nothing was written")


def write_export(model, out, merge_lora: bool = False, force: bool = False, check: bool = True, report=None, *,
                 run=None, record: dict | None = None, train: dict | None = None, step: int | None = None,
                 warnings: list[str] | None = None) -> ExportResult:
    """Write the model ``model`` (in memory) as an export folder ``out`` (``concept.hub.save_pretrained``;
    :func:`export` for a run folder). ``run``, ``record``, ``train``, ``step``: the run it comes from, its
    ``concept.json`` and ``train.json`` records and training step; by default those it was loaded from
    (``concept.load`` keeps them), else its own build record. ``report(verb, detail)`` receives progress."""
    out = Path(out)
    say = report or (lambda verb, detail: warnings_.warn(detail, stacklevel=3) if verb == "warning:" else None)
    _check_saved_as_loaded(model)
    if record is None:
        record, train, run, step = _loaded_origin(model)
    check_target(run, out, force, record["config"])
    kind = model.family  # (a baseline's: dense, or pruned)
    removed = getattr(model, "removed", None)  # layers the model skips: deleted from the exported backbone
    pruned = removed or getattr(model, "deleted", None)
    has_lora = "default" in (getattr(model.backbone, "peft_config", None) or {})
    if train is None and kind in BASELINES:  # a baseline made in memory: what concept.load reads to rebuild it
        heads = getattr(model, "mtp_heads", None)
        train = {"baseline": kind, "pruned": {"removed": list(pruned)} if pruned else None,
                 "mtp_heads": heads.k if heads is not None else 0}
    lora = ("merged" if merge_lora else "adapter") if has_lora else None
    result_warnings = warnings if warnings is not None else []
    if merge_lora and not has_lora:
        result_warnings.append(f"--merge-lora: {run or 'the model'} has no LoRA adapters; the backbone is exported as it is")
        say("warning:", result_warnings[-1])
    _check_exportable(model, out, removed)
    staging = fs.Staging(out, replace=force).open()
    tmp = staging.path
    try:
        how = {"merged": "LoRA merged into the backbone", "adapter": "LoRA as a peft adapter folder"}.get(lora, "no LoRA")
        say("exporting", f"{kind} model -> {out} ({how}) ...")
        dtype = _write_backbone(model, tmp, out, removed, lora)
        _write_new_modules(model, tmp)
        original_backbone, exported = _write_records(model, tmp, record, train, run, dtype, pruned,
                                                     {"from": str(run.resolve()) if run is not None else None,
                                                      "step": step, "kind": kind, "lora": lora})
        heldout = last_evaluation(run, train) if run is not None else None
        write_hf_files(model, tmp)
        body = model_card(out.name, run, model, train, exported, heldout)
        card(body, kind, original_backbone, lora).save(tmp / CARD_FILE)
        comparison = None
        if check:
            say("checking", "loading the export back and comparing its logits with the run's ...")
            comparison = _compare(model, tmp, lora == "merged")
        files = _files(tmp)
    except BaseException as exc:
        staging.discard()
        full = fs.resource_error(exc, out, "; nothing was written" + (f" ({out} is unchanged)" if staging.existed else ""))
        if full is not None:  # a full disk, a file-size limit or a quota: one line naming the folder
            raise full from exc
        raise
    staging.publish()
    return ExportResult(path=out, source=run, kind=kind, lora=lora, step=exported["step"], files=files,
                        heldout=heldout, check=comparison, warnings=result_warnings)


def _loaded_origin(model) -> tuple[dict, dict | None, Path | None, int | None]:
    """The records, run folder and training step ``model`` was loaded from (``concept.load`` keeps them), else
    its own build record: ``(record, train, run, step)``."""
    origin = getattr(model, "loaded_from", None) or {}
    record = json.loads(json.dumps(origin.get("record") or _run_record(model)))
    train = origin.get("train")
    run = Path(origin["folder"]) if origin.get("folder") else None
    step = (record.get("export") or {}).get("step")
    if run is not None and run.is_dir() and checkpoint.folder(run) is not None:
        step = checkpoint.read_meta(run)["step"]
    return record, train, run, step


def _check_exportable(model, out: Path, removed) -> None:
    """Refuse, before writing anything, a pruned baseline too small to export and an export the disk cannot hold."""
    if removed and exported_layers(model) < 3 and model.resolution.family_object.stacks:  # (a pruned build: none)
        raise ConceptError(f"the pruned baseline keeps {exported_layers(model)} of the backbone's "
                           f"{model.backbone.config.num_hidden_layers} layers; its export deletes the others, and a build "
                           f"plan needs at least 3 (one per stack): prune fewer layers to export it")

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    fs.check_space(out, size(model.backbone.state_dict().values()) + size(model.new_state_dict().values()),
                   "the export")  # (the base weights, the adapters, the new modules)


def _write_backbone(model, tmp: Path, out: Path, removed, lora: str | None) -> str:
    """``tmp/backbone/``: the plain transformers backbone (skipped layers deleted; LoRA merged into it, or
    beside it as a peft adapter folder whose base is ``out``'s backbone/) and its tokenizer. Returns its dtype."""
    hf_model, tokenizer = _plain_backbone(model)
    if removed:
        delete_layers(hf_model, removed)
    if lora is not None:  # the base: this folder's backbone/ where it is published (stated in the card)
        save_peft_adapter(model.backbone, tmp / PEFT_ADAPTER_DIR, base_model_name_or_path=str(out.resolve() / BACKBONE_DIR),
                          removed=removed, renumber=True)
    if lora == "merged":
        from peft import PeftModel

        with warnings_.catch_warnings():  # transformers' deprecation notes from inside peft
            warnings_.simplefilter("ignore", FutureWarning)
            hf_model = PeftModel.from_pretrained(hf_model, str(tmp / PEFT_ADAPTER_DIR)).merge_and_unload()
        shutil.rmtree(tmp / PEFT_ADAPTER_DIR)
    hf_model.save_pretrained(tmp / BACKBONE_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / BACKBONE_DIR)
    return _dtype_name(hf_model)


def _write_new_modules(model, tmp: Path) -> None:
    """``tmp/modules.safetensors``: the model's new modules (none: no file)."""
    modules = model.new_state_dict()
    if modules:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in modules.items()}, tmp / MODULES_FILE)


def _write_records(model, tmp: Path, record: dict, train: dict | None, run, dtype: str, pruned,
                   exported: dict) -> tuple[dict | None, dict]:
    """``tmp/concept.json`` (the build config and its resolution, the backbone now the exported folder: absolute
    while resolving, relative on disk; with ``export``: where it came from), ``train.json`` and the copied run
    files. Returns the original backbone and the ``export`` record."""
    resolution = model.resolution
    config = json.loads(json.dumps(record["config"]))
    original_backbone = ((record.get("export") or {}).get("backbone")  # (an export of an export: the first one's)
                         or _saved_backbone(run) or config.get("backbone"))
    absolute = str((tmp / BACKBONE_DIR).resolve())
    config["backbone"] = {"name": "hf", "params": {"path": absolute, "dtype": dtype}}
    if pruned and isinstance(config.get(config["family"]), dict) and "layers" in config[config["family"]]:
        config[config["family"]] = {**config[config["family"]], "layers": None, "deleted": list(pruned)}  # (gone)
    build = BuildConfig.from_dict(config)
    if pruned:
        build.split = "auto"  # (a baseline runs every layer of its backbone; the plan needs a valid split)
        config = build.to_dict()
    new_resolution = resolve(build)
    if not pruned and tuple(new_resolution.split or ()) != tuple(resolution.split or ()):  # (a family without stacks)
        raise ConceptError(f"the exported backbone resolves to split {new_resolution.split}, not the run's "
                           f"{resolution.split}")
    exported = {**exported, "removed_layers": list(pruned) if pruned else None, "backbone_pruned": bool(pruned),
                "backbone": original_backbone, "concept_version": __version__}
    new_record = {k: v for k, v in record.items() if k != "export"}
    new_record = {**new_record, "config": config, "plan": new_resolution.describe(), "export": exported}
    new_record = _relative_paths(new_record, absolute, BACKBONE_PATH)
    (tmp / RUN_FILE).write_text(json.dumps(new_record, indent=2, sort_keys=True))
    if train is not None:
        (tmp / TRAIN_FILE).write_text(json.dumps(train, indent=2))
    for name in COPIED:
        if run is not None and (run / name).is_file():
            shutil.copy2(run / name, tmp / name)
    return original_backbone, exported


def _saved_backbone(run) -> dict | None:
    """The backbone the run folder ``run`` was built with, as its concept.json says (relative paths unresolved)."""
    if run is None or not (Path(run) / RUN_FILE).is_file():
        return None
    return json.loads((Path(run) / RUN_FILE).read_text())["config"].get("backbone")


# -- the model card --------------------------------------------------------------------------------
def _describe_model(model, kind: str, removed) -> str:
    if kind == "pruned":  # (what the export did to it)
        a, b = removed
        total = exported_layers(model) + b - a
        return (f"the pruned baseline: the backbone with layers {a}..{b - 1} skipped ({b - a} of {total}; they are "
                f"deleted from `backbone/`, which keeps {total - (b - a)}; `train.json` records which)")
    return family_of(model).describe(model)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def model_card(name: str, run: Path, model, train: dict | None, exported: dict, heldout: dict | None) -> str:
    """The card's text (``concept.hub.card`` puts the hub metadata above it)."""
    kind, lora, removed = exported["kind"], exported["lora"], exported["removed_layers"]
    lines = (_card_model(name, run, model, exported) + _card_training(model, train, lora, exported)
             + _card_heldout(name, train, heldout, exported) + _card_files(model, train, lora)
             + _card_loading(name, model, kind, lora, removed, exported))
    return "\n".join(lines)


def _card_model(name: str, run: Path, model, exported: dict) -> list[str]:
    """The card's title, origin, model and backbone."""
    kind, removed = exported["kind"], exported["removed_layers"]
    info = model.resolution.backbone_info
    backbone = exported["backbone"] or {}
    when = f" at training step {exported['step']}" if exported["step"] is not None else " (untrained)"
    origin = f"the run `{run}`" if run is not None else "a model built in memory"
    lines = [f"# {name}", "",
             f"Exported by `concept export` (concept {exported['concept_version']}) from {origin}{when}.", "",
             f"**Model**: {_describe_model(model, kind, removed)}.", "",
             f"**Backbone**: `{backbone.get('name', '?')}` ({info.name}: {info.architecture}, {exported_layers(model)} layers, "
             f"hidden {info.hidden_size}, vocabulary {info.vocab_size}), saved in `backbone/` as a Hugging Face folder.", ""]
    return lines


def _card_training(model, train: dict | None, lora: str | None, exported: dict) -> list[str]:
    """The card's LoRA settings and training (none for a model neither trained nor given LoRA)."""
    lines = []
    if train or lora:
        settings = (train or {}).get("lora") or {}
        if not settings and lora:  # (a model given LoRA in memory: its peft config says how)
            settings = asdict(settings_from_peft(model.backbone.peft_config["default"]))
        where = {"adapter": "a peft adapter folder in `adapter/` (the weights in `backbone/` are the base weights)",
                 "merged": "merged into the weights in `backbone/` (no separate adapter)"}.get(lora, "none")
        lines += [f"**LoRA**: rank {settings.get('rank')}, alpha {settings.get('alpha')}, on "
                  f"`{settings.get('targets')}`: {where}.", ""]
    if train and train.get("seq_len"):  # (a trained run's record)
        data = train.get("data") or "the Python standard library"
        steps = exported["step"] or 0
        tokens = steps * int(train.get("batch", 0)) * int(train.get("grad_accum", 1)) * int(train.get("seq_len", 0))
        accum = int(train.get("grad_accum", 1))
        accumulated = f" x {accum} accumulated" if accum > 1 else ""
        lines += [f"**Training**: {steps:,} steps on {data} (train split), {train.get('batch')} x "
                  f"{train.get('seq_len')} tokens per step{accumulated} (about {tokens:,} tokens).", ""]
    return lines


def _card_heldout(name: str, train: dict | None, heldout: dict | None, exported: dict) -> list[str]:
    """The card's held-out evaluation: the run's last one, and the command that repeats it."""
    lines = ["## Held-out evaluation", ""]
    if heldout:
        ev = heldout["eval"]
        data = heldout["data"] or "the Python standard library"
        lines += [f"The run's last evaluation (`metrics.jsonl`, step {heldout['step']}): the held-out split of {data}, "
                  f"{heldout['batches']} batch{'es' * (heldout['batches'] != 1)} of {heldout['batch']} x {heldout['seq_len']} tokens "
                  f"({_fmt(heldout['tokens'])} predicted tokens).", ""]
        if exported["step"] is not None and heldout["step"] != exported["step"]:
            lines += [f"Note: evaluated at step {heldout['step']}; the exported weights are from step {exported['step']}.", ""]
        lines += ["| metric | value |", "|---|---|"]
        for key, label in (("nll", "NLL (nats / token)"), ("bits_per_token", "bits / token"), ("perplexity", "perplexity"),
                           ("ratio", "concepts / token"), ("usage_perplexity", "concept usage perplexity"),
                           ("tokens", "tokens evaluated")):
            if ev.get(key) is not None:
                lines.append(f"| {label} | {_fmt(ev[key])} |")
        lines.append("")
        if train and train.get("seed", 0) == 0 and heldout["batches"] and heldout["batch"]:
            lines += ["The same batches again (with the training data at its path):", "", "```bash",
                      f"concept eval {name} --eval-batches {heldout['batches']} --batch {heldout['batch']} "
                      f"--seq-len {heldout['seq_len']}", "```", ""]
    else:
        lines += [f"No held-out evaluation was recorded for this run. Evaluate it with `concept eval {name} --data HELD_OUT`.", ""]

    return lines


def _card_files(model, train: dict | None, lora: str | None) -> list[str]:
    """The card's table of the export's files."""
    lines = ["## Files", "", "| path | what |", "|---|---|",
              "| `concept.json` | the build plan (backbone: `hf` at `./backbone`, relative to this folder) |",
              "| `config.json`, `configuration_concept.py`, `modeling_concept.py` | the transformers classes "
              "(`AutoModelForCausalLM` with `trust_remote_code=True`) |",
              "| `backbone/` | the backbone: `config.json`, `model.safetensors`, tokenizer files |"]
    if lora == "adapter":
        lines.append("| `adapter/` | the LoRA adapters, a standard peft folder |")
    if train:
        lines.append("| `train.json` | the training record (baseline kind, pruned layers, LoRA settings, data) |")
    if model.new_modules():
        lines.append(f"| `{MODULES_FILE}` | the concept modules |")
    return lines


def _card_loading(name: str, model, kind: str, lora: str | None, removed, exported: dict) -> list[str]:
    """The card's loading recipes: concept.load, transformers, peft (with an adapter), the pruned backbone."""
    lines = ["", "## Loading", "", "```python", "import concept", "", f'model = concept.load("{name}")   # the whole model; '
              "no run folder or backbone cache needed (a hub id works too)", "```", "",
              f"With transformers (the classes in this folder open it with `concept.load`, so the `concept` library "
              f"must be installed, version {exported['concept_version']} or later; transformers names it when it is "
              f"missing):", "", "```python", "from transformers import AutoModelForCausalLM", "",
              f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
              "logits = model(input_ids).logits   # concept.load's logits", "```", ""]
    if lora == "adapter":
        lines += ["The adapters with peft, on the plain transformers backbone (`adapter/adapter_config.json` names "
                  "its base by the absolute path of this folder's `backbone/` where it was exported, so "
                  f'`AutoPeftModelForCausalLM.from_pretrained("{name}/adapter")` works while the folder stays there; '
                  "a copy pushed with `concept export --push-to-hub` names the backbone's hub id instead when it has "
                  "one). Anywhere:", "", "```python",
                  "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{name}/backbone")   # from the hub: ("org/x", subfolder="backbone")',
                  f'model = PeftModel.from_pretrained(base, "{name}/adapter")     # from the hub: (base, "org/x", subfolder="adapter")',
                  "```", ""]
    elif lora == "merged":
        lines += ["The backbone with the adapters merged in, with transformers alone:", "", "```python",
                  "from transformers import AutoModelForCausalLM", "",
                  f'model = AutoModelForCausalLM.from_pretrained("{name}/backbone")', "```", ""]
    if lora and kind not in BASELINES:
        lines += [f"That is the backbone's ordinary forward with this run's adapters; the {kind} model (with its "
                  f"concept modules) needs `concept.load`.", ""]
    if kind == "pruned":
        a, b = removed
        lines += [f"`backbone/` holds only the kept layers (layers {a}..{b - 1} of the original are deleted and "
                  f"`num_hidden_layers` is {exported_layers(model)}), so that is the pruned baseline itself"
                  f"{' (the adapter is numbered for the kept layers)' if lora == 'adapter' else ''}.", ""]
    return lines
