"""What a run was made with, for train.json: the library versions and, when the code runs from a git
checkout, its commit. Never fails: a version or commit that cannot be read is None."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("concept", "torch", "transformers", "peft")
CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root when concept runs from its sources


def versions() -> dict[str, str | None]:
    """{package: installed version or None}, and the Python version. torch's as it names itself, with its build
    (``2.11.0+cu130``: PyPI's CUDA wheels carry the build in ``torch.__version__`` only, not in their metadata)."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    if "torch" in sys.modules:
        found["torch"] = str(sys.modules["torch"].__version__)
    found["python"] = platform.python_version()
    return found


def git_sha(folder: Path = CHECKOUT) -> str | None:
    """The commit checked out in ``folder`` when it is the root of a git checkout (an installed wheel's
    site-packages is not), else None; a ``+dirty`` suffix when tracked files differ from it."""
    if not (folder / ".git").exists():  # (a folder in a worktree has a .git file)
        return None
    try:
        run = dict(cwd=folder, capture_output=True, text=True, timeout=10)
        sha = subprocess.run(["git", "rev-parse", "HEAD"], **run)
        if sha.returncode != 0 or len(sha.stdout.strip()) < 40:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run)
        return sha.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except Exception:  # no git, a timeout, ...: the record just has no commit
        return None
