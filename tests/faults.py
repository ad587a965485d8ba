"""Fault injection for the commands that write: count every filesystem write a command makes under a
folder, then run it again with a fault at the k-th one (an ``OSError``, a real SIGINT, or a real
SIGKILL in a child process) and check what it left.

A write is any call, for a path under the watched folder, of ``open``/``io.open`` in a writing mode,
``os.open`` with a writing flag, ``os.mkdir``, ``os.rename``, ``os.replace``, ``os.unlink``,
``os.remove`` or ``os.rmdir``, or a Linux ``renameat2`` (``concept.fs._rename2``: the atomic swap and
the no-replace rename that publish a folder); ``shutil.rmtree``, ``tempfile``, ``Path.write_*``,
``shutil.copy2`` and ``torch.save`` all go through these. (safetensors' ``save_file`` writes from Rust,
so its files are seen only through the renames and folders around them.)

Run as a script, it is the child of a SIGKILL injection, or of a pause (the child stops at the write
and waits to be killed, e.g. while a test runs a second writer against it)::

    python tests/faults.py ROOT K -- concept ARGS...    # kill itself at the K-th write under ROOT
    python tests/faults.py ROOT K --match S --pause FILE -- concept ARGS...
        # at the K-th write whose path contains S: create FILE, then wait to be killed
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import io
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class Injector:
    """Counts writes under ``root``; at write number ``at`` (1-based) does ``action``:
    "error" (raise OSError EIO), "sigint" (send this process SIGINT) or "sigkill"."""

    root: Path
    at: int = 0
    action: str = "error"  # or "sigint", "sigkill", "pause" (create ``pause_file``, then wait to be killed)
    count: int = 0
    log: list = field(default_factory=list)
    fired: bool = False
    match: str | None = None  # count only the writes whose path (relative to root) contains this
    pause_file: Path | None = None
    matched: int = 0

    def hit(self, what: str, path) -> None:
        if isinstance(path, int) or path is None:
            return
        try:
            p = Path(os.fsdecode(path))
        except TypeError:
            return
        p = p if p.is_absolute() else Path.cwd() / p
        if p != self.root and not str(p).startswith(str(self.root) + os.sep):
            return
        self.count += 1
        rel = str(p.relative_to(self.root)) if p != self.root else "."
        self.log.append((self.count, what, rel))
        if self.match is None or self.match in rel:
            self.matched += 1
        if self.matched == self.at and not self.fired:
            self.fired = True
            if self.action == "error":
                raise OSError(errno.EIO, f"injected fault at write {self.count} ({what})", str(p))
            if self.action == "pause":
                self.pause_file.write_text(f"{what} {rel}")
                while True:
                    signal.pause()
            os.kill(os.getpid(), signal.SIGINT if self.action == "sigint" else signal.SIGKILL)


@contextlib.contextmanager
def injected(injector: Injector):
    """Patch the write primitives so that ``injector`` sees every write (restored afterwards)."""
    real = {name: getattr(os, name) for name in ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")}
    real_open = builtins.open

    def opener(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            injector.hit(f"open({mode})", file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & WRITE_FLAGS and kwargs.get("dir_fd") is None:
            injector.hit("os.open", path)
        return real["open"](path, flags, *args, **kwargs)

    def one_path(name):
        def wrapped(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None:
                injector.hit(name, path)
            return real[name](path, *args, **kwargs)
        return wrapped

    def two_paths(name):
        def wrapped(src, dst, *args, **kwargs):
            injector.hit(name, dst)
            return real[name](src, dst, *args, **kwargs)
        return wrapped

    patches = {"open": os_open, "rename": two_paths("rename"), "replace": two_paths("replace"),
               **{n: one_path(n) for n in ("mkdir", "unlink", "remove", "rmdir")}}
    for name, fn in patches.items():
        setattr(os, name, fn)
    builtins.open = io.open = opener
    from concept import fs

    real_rename2 = fs._rename2

    def rename2(a, b, flags):
        injector.hit("renameat2", b)
        return real_rename2(a, b, flags)

    fs._rename2 = rename2
    try:
        yield injector
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
        builtins.open = io.open = real_open
        fs._rename2 = real_rename2


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (folders as "<dir>", symbolic links as "<link TARGET>")."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = (f"<link {os.readlink(p)}>" if p.is_symlink() else "<dir>" if p.is_dir()
                    else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def under(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder + "/")


def leftovers(after: dict, before: dict, output: str) -> list[str]:
    """New paths outside ``output`` (a killed writer's staging folder and lock file are the only ones allowed:
    the next writer sweeps the one, the other is free once its process is gone)."""
    name = output.rsplit("/", 1)[-1]
    parent = output.rsplit("/", 1)[0] + "/" if "/" in output else ""
    staging, lock = f"{parent}.{name}.partial", f"{parent}.{name}.lock"
    return [rel for rel in after if rel not in before and not under(rel, output)
            and not under(rel, staging) and rel != lock]


def damaged(before: dict, after: dict, output: str) -> list[str]:
    """Pre-existing paths outside ``output`` that changed or vanished."""
    return [rel for rel, digest in before.items() if not under(rel, output) and after.get(rel) != digest]


def part(snap: dict, output: str) -> dict:
    """The entries of ``snap`` inside ``output``, relative to it."""
    return {rel[len(output) + 1:]: d for rel, d in snap.items() if rel.startswith(output + "/")}


def _child(root: Path, at: int, argv: list[str], extra: list[str], env: dict | None):
    cmd = [sys.executable, str(Path(__file__).resolve()), str(root), str(at), *extra, "--", *map(str, argv)]
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return cmd, env


def run_killed(root: Path, at: int, argv: list[str], env: dict | None = None) -> int:
    """Run ``concept ARGV`` in a child that SIGKILLs itself at write ``at`` under ``root``."""
    cmd, env = _child(root, at, argv, [], env)
    return subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode


def start_paused(root: Path, match: str, argv: list[str], pause_file: Path, at: int = 1,
                 env: dict | None = None) -> subprocess.Popen:
    """Start ``concept ARGV`` in a child that stops at the ``at``-th write under ``root`` whose path contains
    ``match``: it creates ``pause_file`` there and waits to be killed (``child.kill()``: a real SIGKILL)."""
    cmd, env = _child(root, at, argv, ["--match", match, "--pause", str(pause_file)], env)
    with open(Path(pause_file).with_suffix(".log"), "wb") as log:  # (its stderr: what went wrong, if it did)
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log)


if __name__ == "__main__":
    root, at, *rest = sys.argv[1:]
    sep = rest.index("--")
    options, argv = dict(zip(rest[:sep:2], rest[1:sep:2])), rest[sep + 1:]
    from concept_cli.main import cli

    pause = options.get("--pause")
    injector = Injector(Path(root).resolve(), int(at), "pause" if pause else "sigkill", match=options.get("--match"),
                        pause_file=Path(pause) if pause else None)
    with injected(injector):
        try:
            cli.main(args=argv, prog_name="concept", standalone_mode=True)
        except SystemExit as exc:
            sys.exit(exc.code)
