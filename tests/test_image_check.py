"""``make image-check`` (``benchmarks/image_check.py``): the suite under the GPU image's versions, read from the
newest lease's ``setup.json``."""
from __future__ import annotations

import json

from benchmarks import image_check


def _setup(folder, started_at, torch, dry=False):
    folder.mkdir(parents=True)
    environment = {"torch": torch, "transformers": "5.17.0", "peft": "0.21.0", "triton": "3.6.0", "python": "3.12.3"}
    (folder / "setup.json").write_text(json.dumps({"dry": dry, "started_at": started_at,
                                                   "result": {"environment": environment}}))


def test_the_newest_leases_versions_are_pinned(tmp_path, monkeypatch):
    """The newest real lease wins (a dry run never does); torch without its build suffix; the venv is made with
    them pinned and the project's extras, then the default suite runs in it."""
    monkeypatch.setattr(image_check, "ROOT", tmp_path)
    _setup(tmp_path / "h100", "2026-11-26T07:53:19Z", "2.10.0+cu128")
    _setup(tmp_path / "h200", "2026-11-27T16:01:34Z", "2.11.0+cu130")
    _setup(tmp_path / "dry", "2026-11-28T00:00:00Z", "2.13.0+cpu", dry=True)
    versions = image_check.image_versions(tmp_path)
    assert {k: versions[k] for k in image_check.PACKAGES} == {"torch": "2.11.0", "transformers": "5.17.0",
                                                              "peft": "0.21.0", "triton": "3.6.0"}
    assert versions["from"] == "h200/setup.json" and versions["python"] == "3.12.3"
    venv = image_check.venv_for(versions, tmp_path)
    install = image_check.install_commands(versions, venv)
    assert "torch==2.11.0" in install[2] and "transformers==5.17.0" in install[2] and install[2][-2] == "-e"
    assert install[3][-3:] == ["--no-deps", *image_check.NO_DEPS]
    run = image_check.test_command(venv, ["tests/test_torch_versions.py"])
    assert run[0] == str(venv / "bin" / "python") and "not slow" in run and run[-1] == "tests/test_torch_versions.py"


def test_the_dry_run_names_the_image_and_installs_nothing(capsys, tmp_path):
    """On the repository's own lease records: torch 2.11, the image's, and the commands, nothing run."""
    assert image_check.main(["--dry", "--venv", str(tmp_path / "venv")]) == 0
    out = capsys.readouterr().out
    assert "torch 2.11.0" in out and "pip install" in out and "pytest" in out
    assert not (tmp_path / "venv").exists()
