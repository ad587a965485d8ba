"""Records of run folders written by older versions, brought to today's format in one place.

The one validating reader (``concept.run_files``) passes every record it reads through the ``migrate_*``
function of its kind, before checking it; nothing else in the library knows an older format. Each step is an
explicit rewrite of the record (the formats are listed in docs/training.md, "Run folders of older versions"):

``concept.json`` (:func:`migrate_run`):

- **format 1** (no ``format`` key): built before the ``concept_input`` and ``tail_fusion`` components existed,
  with what they were then: ``concept_input = "embedding"``, ``tail_fusion = none``;
- **format 2 without ``family``**: written before there was a second family: the ``streaming`` family;
- **an empty family section** (older versions wrote every family's section, empty, into every run): dropped;
- **format 2** (flat): the streaming family's keys (its component slots, ``split``, ``concept_input``,
  ``max_ratio``: :data:`FLAT_KEYS`) sat beside ``family``, ``backbone`` and ``seed``; format 3 holds them in their
  section, ``"streaming": {...}`` (:func:`sectioned`; a recipe file written flat is read through it too);
- **a baseline run of the source's build** (before the baselines were families: its train.json says
  ``"baseline": "dense" / "pruned"``, its ``concept.json`` holds the build it was trained from): a build of the
  ``dense`` / ``pruned`` family (:func:`baseline_build`) with the source's backbone and seed, the pruned block and
  the MTP heads train.json recorded, and the source build as ``baseline_of`` (what its checkpoints fingerprinted:
  :func:`fingerprinted`);
- **a format above** :data:`FORMAT_VERSION` (a newer concept wrote it): refused, with the fix (upgrade).

``train.json`` (:func:`migrate_train`):

- **``baseline: true / false``** (before the pruned baseline): ``"dense"`` / null;
- **``baseline``, ``pruned``, ``mtp_heads``, ``prune_layers``** (before the baselines were families): moved into
  the build (``concept.json``, above), and the options the baseline's family does not read dropped (they take
  their defaults, as a new run's train.json leaves them out); a record of only those (a baseline saved untrained)
  is no training record;
- **a relative ``data`` path** (before runs stored absolute paths): made absolute against the working folder,
  the folder it was always read from;
- **the options that moved to their families** (:data:`MOVED_OPTIONS`: core options before the training options
  went by owner, so every run recorded them): dropped from the record of a run whose family does not read them
  (e.g. ``target_ratio`` of a planner-executor run); a baseline's record held every family's options: those its
  run's family does not read are dropped too (``unread``, given by the reader, which knows the family);
- options added since are absent and take their defaults: nothing to rewrite.

A record that is not an object is returned as it is: the reader reports it.
"""
from __future__ import annotations

from .errors import ConceptError

FORMAT_VERSION = 3  # concept.json's format, written by concept.builder
FORMAT_1_COMPONENTS = {"concept_input": "embedding", "tail_fusion": {"name": "none", "params": {}}}
FIRST_FAMILY = "streaming"
# format 2's top-level keys of the streaming family (the planner-executor read them too): format 3's "streaming" section
FLAT_KEYS = ("split", "length_policy", "sampler", "eval_sampler", "position_scheme", "vocabulary", "attention",
             "tail_fusion", "concept_input", "max_ratio")
FLAT_SECTION = "streaming"
# train.json keys of the core's options until they moved to the families that read them (the streaming family; the
# planner-executor reads the Gumbel temperature and anti-collapse ones)
MOVED_OPTIONS = ("target_ratio", "tau_start", "tau_end", "usage_weight", "revive_after", "kmeans_init", "align_at")


class RecordFormatError(ConceptError):
    """A record in a format this version cannot read: ``problem`` (what is wrong) and ``fix`` (what to do); the
    reader names the file."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def migrate_run(record: dict, train: dict | None = None) -> dict:
    """A ``concept.json`` record (a copy) in today's format; :class:`RecordFormatError` for a format that is
    not a version number (``fix`` None: the reader's own) or one above :data:`FORMAT_VERSION`. ``train``: the
    run's train.json as read (unchecked), if it has one."""
    if not isinstance(record, dict):
        return record
    record = dict(record)
    version = record.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordFormatError(f"'format' is {version!r}, not a format version")
    if version > FORMAT_VERSION:
        raise RecordFormatError(f"was written by a newer concept (format {version}; this one reads up to "
                                f"{FORMAT_VERSION})", "upgrade concept (pip install -U concept)")
    config = record.get("config")
    if isinstance(config, dict):
        config = dict(config)
        if version == 1:
            for key, value in FORMAT_1_COMPONENTS.items():
                config.setdefault(key, value)
        config.setdefault("family", FIRST_FAMILY)
        if "length_policy" in config:  # a family with concept slots, written before the static budget: none, as
            config.setdefault("max_ratio", 0.0)  # it was built (not today's auto); a slot-less family has no key
        for key in [k for k, v in config.items() if v == {}]:  # (only a section can be empty: a slot has a name)
            del config[key]
        record["config"] = sectioned(config) if version < 3 else config
        baseline = _baseline_of(train)
        if baseline is not None and record["config"].get("family") not in BASELINES:
            record["config"] = baseline_build(record["config"], baseline, train, record.get("export"))
    record["format"] = FORMAT_VERSION
    return record


BASELINES = ("dense", "pruned")  # the baseline families (concept.baselines)
BASELINE_KEYS = ("baseline", "pruned", "mtp_heads", "prune_layers")  # what train.json recorded of a baseline before


def _baseline_of(train) -> str | None:
    """The baseline an older train.json says its run is (``true``: dense), or None."""
    value = train.get("baseline") if isinstance(train, dict) else None
    value = "dense" if value is True else value
    return value if value in BASELINES else None


def baseline_build(source: dict, name: str, train: dict, export: dict | None) -> dict:
    """The build config of an older baseline run: the ``name`` family's, from the ``source`` build it was
    trained from, with what its train.json recorded (the pruned block; in an export whose backbone lacks the
    block already, ``deleted``)."""
    heads = train.get("mtp_heads") or 0
    section: dict = {"mtp_heads": heads} if isinstance(heads, int) and heads else {}
    pruned = train.get("pruned") if isinstance(train.get("pruned"), dict) else {}
    if name == "pruned":
        block = pruned.get("removed")
        block = block if isinstance(block, list) and len(block) == 2 and block[1] > block[0] else None
        deleted = bool((export or {}).get("backbone_pruned")) and block is not None
        section.update({"layers": None if deleted else block, **({"deleted": block} if deleted else {})})
        if pruned:
            section["matched"] = pruned
    section["baseline_of"] = source
    return {"family": name, "backbone": source.get("backbone"), "seed": source.get("seed", 0), name: section}


def source_modules(config: dict) -> bool:
    """Whether the top-level ``modules.safetensors`` of the run built by ``config`` may be another build's: an
    older baseline run kept its source build's (its own MTP heads are in its checkpoint)."""
    section = config.get(config.get("family")) if isinstance(config, dict) else None
    return isinstance(section, dict) and isinstance(section.get("baseline_of"), dict)


def fingerprinted(config: dict) -> list[dict]:
    """The build configs a checkpoint of the run built by ``config`` may have fingerprinted: ``config``, as format
    2 wrote it (:func:`flat`), and for an older baseline run, the build it was trained from (``baseline_of``)."""
    found = [config, flat(config)]
    section = config.get(config.get("family")) if isinstance(config, dict) else None
    source = section.get("baseline_of") if isinstance(section, dict) else None
    if isinstance(source, dict):
        found += [source, flat(source)]
    return found


def sectioned(config: dict) -> dict:
    """A build config (a copy) with format 2's flat keys of the streaming family (:data:`FLAT_KEYS`) moved into
    its section; one already sectioned is returned as it is (a key in both places: the section's wins)."""
    if not isinstance(config, dict):
        return config
    moved = {k: config[k] for k in FLAT_KEYS if k in config}
    if not moved:
        return config
    rest = {k: v for k, v in config.items() if k not in moved}
    section = rest.get(FLAT_SECTION)
    rest[FLAT_SECTION] = {**moved, **section} if isinstance(section, dict) else moved
    return rest


def flat(config: dict) -> dict:
    """A format-3 build config as format 2 wrote it (the inverse of :func:`sectioned`): what a checkpoint written
    before format 3 fingerprinted (``concept.checkpoint.check_origin``)."""
    if not isinstance(config, dict) or not isinstance(config.get(FLAT_SECTION), dict):
        return config
    return {k: v for k, v in config.items() if k != FLAT_SECTION} | config[FLAT_SECTION]


def migrate_train(record: dict, declared=None, unread=()) -> dict:
    """A ``train.json`` record (a copy) in today's format. ``declared``: the training options of the run's
    family and the core (None: unknown, the moved options stay); ``unread``: the options of the other families
    (a baseline's record held them)."""
    # lazy: the data module imports numpy and torch; reading a run's family (concept.families) needs neither
    from .data import stored_source

    if not isinstance(record, dict):
        return record
    record = dict(record)
    if isinstance(record.get("baseline"), bool):
        record["baseline"] = "dense" if record["baseline"] else None
    baseline = _baseline_of(record)
    if baseline is not None:  # the build holds these now (migrate_run); the options it does not read (``unread``)
        for key in BASELINE_KEYS:  # are dropped below, as train.json leaves them out today (train_config.recorded)
            record.pop(key, None)
    if isinstance(record.get("data"), str) and record["data"].strip():
        record["data"] = stored_source(record["data"])
    if declared is not None:
        dropped = set(MOVED_OPTIONS) | (set(unread) if baseline is not None else set())
        for key in dropped - set(declared):
            record.pop(key, None)
    return record
