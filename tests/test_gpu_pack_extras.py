"""The pack's dependencies (benchmarks/gpu_pack.py): the requirements of pyproject.toml's extras that the kit's
stages use are packed like the project's own dependencies (the lease of 2026-11-27 lost a call because `gguf`,
in the `smollm2` extra, was not); the other extras are not. PyPI is faked: each download is a wheel with the
METADATA the test gives it."""
import zipfile

import pytest

from benchmarks import gpu_pack
from benchmarks.gpu_kit.common import KitError

PYPROJECT = """
[project]
name = "concept"
dependencies = ["torch>=2.6", "einops>=0.8"]

[project.optional-dependencies]
smollm2 = ["gguf>=0.10"]
xformers = ["xformers>=0.0.28"]
serve = ["fastapi>=0.110"]
"""
# what each fake wheel requires (its Requires-Dist lines)
REQUIRES = {"gguf": ["numpy>=1.17", "sentencepiece-tools>=0.1"], "sentencepiece-tools": [], "fastapi": []}


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    def download(requirement: str):
        from packaging.requirements import Requirement

        name = gpu_pack.normalize(Requirement(requirement).name)
        wheel = tmp_path / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{name}-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: " + name + "\n"
                       + "".join(f"Requires-Dist: {r}\n" for r in REQUIRES[name]))
        return wheel

    monkeypatch.setattr(gpu_pack, "download", download)
    monkeypatch.setattr(gpu_pack, "xformers_decision", lambda: {"project": "xformers", "pack": None,
                                                                 "reason": "no wheel fits (the test's)"})
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(PYPROJECT)
    return pyproject


def packed(pyproject) -> dict[str, str]:
    wheels, not_packed = gpu_pack.dependency_wheels(pyproject)
    return {w["project"]: w["why"] for w in wheels} | {d["project"]: "NOT: " + d["reason"] for d in not_packed}


def test_the_requirements_of_the_kits_extras_are_packed(fake_pypi):
    found = packed(fake_pypi)
    assert found["gguf"].startswith("the `smollm2` extra")  # only in an extra, and packed
    assert found["sentencepiece-tools"] == "required by gguf"  # what it requires, too
    assert found["numpy"] == found["torch"] == "NOT: on the GPU image"
    assert found["xformers"] == "NOT: no wheel fits (the test's)"  # the extra's decision, with its reason
    assert "fastapi" not in found  # an extra no stage uses


def test_negative_control_without_reading_the_extras_gguf_is_not_packed(fake_pypi, monkeypatch):
    monkeypatch.setattr(gpu_pack, "extra_requirements", lambda project: [])
    found = packed(fake_pypi)
    assert "gguf" not in found and "xformers" not in found  # the defect of 2026-11-27


def test_a_kit_extra_missing_from_pyproject_is_named(fake_pypi):
    fake_pypi.write_text(PYPROJECT.replace("smollm2 =", "backbone ="))
    with pytest.raises(KitError, match="pyproject.toml has no extra smollm2"):
        gpu_pack.dependency_wheels(fake_pypi)


def test_this_projects_pyproject_has_the_kits_extras():
    import tomllib

    from benchmarks.gpu_kit.common import KIT_EXTRAS, ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {text.split(">")[0] for text, _ in gpu_pack.extra_requirements(project)} >= {"gguf", "xformers"}
    assert set(KIT_EXTRAS) <= set(project["optional-dependencies"])
