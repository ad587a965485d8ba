"""Writing to disk so that nothing already written is ever lost.

One rule for every command that writes a folder (``build``, ``train``, ``export``, ``frontier``,
``bench --save``, the backbone cache):

- the output is built whole in a *staging* folder beside it (``.NAME.partial``), never in place;
- it is published with one atomic rename when, and only when, the command succeeded; an existing
  output (``--force``) is swapped out at that moment and only then removed;
- an output folder that contains one of the command's own inputs is refused before anything
  is touched;
- a failure at any point (an exception, Ctrl-C, ``kill -9``) leaves every file that existed
  before byte-identical: the staging folder is removed, or, after ``kill -9``, left for the next
  command on that output to sweep away (its owner's lock is gone).

Single files (``train.json``, reports, caches) are replaced with :func:`write_atomic`: a
temporary file in the same folder renamed over the old one.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .errors import RunFolderError

STAGING_SUFFIX = ".partial"
_RENAME_EXCHANGE = 2  # linux/fs.h


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_permissions(path: Path) -> None:
    """The usual umask-based modes for a finished folder and everything in it (``mkdtemp`` makes
    folders 0700, ``mkstemp`` and safetensors make files 0600)."""
    mask = umask()
    path = Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``data`` (bytes, text, or a function writing to a binary file object):
    written to a temporary file beside it, flushed to disk, then renamed over it. A reader sees the
    old file or the new one, never a torn one. An existing file keeps its mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode(encoding) if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _renameat2():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the paths ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``). False where
    the system or the filesystem cannot; then nothing was changed."""
    try:
        fn = _renameat2()
    except OSError:
        return False
    if fn is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, dest: Path) -> None:
    """Publish the finished folder ``new`` as ``dest``. An existing ``dest`` is swapped with it in one
    atomic step and removed afterwards; where no atomic swap exists, it is renamed aside first and
    renamed back if the second rename fails."""
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.rename(new, dest)  # (onto nothing: atomic)
        return
    if exchange(new, dest):
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now names the old folder
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def contains(folder: Path, path: Path) -> bool:
    """``path`` is ``folder`` or lies inside it (symlinks resolved)."""
    folder, path = Path(folder).resolve(), Path(path).resolve()
    return folder == path or folder in path.parents


def check_target(dest: Path, force: bool, inputs: Mapping[str, str | os.PathLike | None] = (), flag: str = "--out",
                 what: str = "") -> None:
    """Refuse, before anything is read or written, an output that is not ours to (re)place: a file,
    a folder holding one of the command's ``inputs`` (name -> path; replacing it would delete
    them), or a non-empty folder without ``force``."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise RunFolderError(f"{flag} {dest} exists and is not a folder; choose another {flag}")
    for name, path in dict(inputs).items():
        if path is not None and Path(path).exists() and contains(dest, Path(path)):
            it = "is" if Path(path).resolve() == dest.resolve() else "contains"
            raise RunFolderError(f"{flag} {dest} {it} the {name} {path}: the output must be a folder of its own, "
                                 f"outside the command's inputs (replacing it would destroy them); choose another {flag}")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise RunFolderError(f"{flag} {dest} already exists and is not empty{what}; choose another {flag}, or pass "
                             f"--force to replace it (the old folder is kept until the new one is complete)")


def staging_path(dest: Path) -> Path:
    return Path(dest).with_name(f".{Path(dest).name}{STAGING_SUFFIX}")


class Staging:
    """A staging folder for ``dest``, held under an exclusive lock (``.NAME.partial.lock``) for as long
    as this object lives: a second writer of the same ``dest`` is refused, and a folder whose lock
    nobody holds (its writer was killed) is swept away when the next writer starts."""

    def __init__(self, dest: str | os.PathLike):
        self.dest = Path(dest)
        self.path = staging_path(self.dest)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock = None
        self.swept = False

    def open(self) -> "Staging":
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError(f"another process is writing {self.dest} (it holds {self.lock_path}); wait for it "
                                 f"to finish, or choose another output") from None
        self._lock = fd
        try:
            if self.path.exists():  # left by a writer that was killed: nobody holds its lock
                shutil.rmtree(self.path)
                self.swept = True
            self.path.mkdir()
        except BaseException:
            self.close()
            raise
        return self

    def publish(self) -> Path:
        """Move the staged folder to ``dest`` (replacing an existing one in the same atomic step)."""
        try:
            publish_permissions(self.path)
            replace_dir(self.path, self.dest)
        finally:
            self.close()
        return self.dest

    def discard(self) -> None:
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self.close()

    def close(self) -> None:
        """Release the lock (and remove its file: a leftover file is harmless, a held lock is not)."""
        if self._lock is None:
            return
        fd, self._lock = self._lock, None
        try:
            os.unlink(self.lock_path)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged(dest: str | os.PathLike) -> Iterator[Path]:
    """``with staged(out) as tmp:`` write the output into ``tmp``; it becomes ``out`` when the block
    finishes, and is removed (``out`` untouched) when the block raises, Ctrl-C included."""
    staging = Staging(dest).open()
    try:
        yield staging.path
    except BaseException:
        staging.discard()
        raise
    staging.publish()


def fill_cache(folder: str | os.PathLike, write: Callable[[Path], None], prefix: str = ".cache-") -> Path:
    """Fill the cache folder ``folder`` once: ``write(tmp)`` writes it whole into a fresh temporary
    sibling, which is then renamed to ``folder`` (readable by the group and others as the umask
    allows). When another process published ``folder`` meanwhile, this copy is dropped and theirs
    kept. A failure (Ctrl-C included) removes the temporary folder and leaves ``folder`` as it was."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
    try:
        write(tmp)
        publish_permissions(tmp)
        if folder.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def cache_root() -> Path:
    """The library's cache folder (converted backbones, tokenised corpora): ``$CONCEPT_CACHE``, else
    ``$XDG_CACHE_HOME/concept``, else ``~/.cache/concept``."""
    if os.environ.get("CONCEPT_CACHE"):
        return Path(os.environ["CONCEPT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "concept"


def replace_marked(text: str, begin: str, end: str, block: str) -> str:
    """``text`` with what lies between its one ``begin`` marker and the one ``end`` marker after it replaced
    by ``block`` (on lines of its own); ``ValueError`` when the markers are not there once each, in order.
    How the generated tables in docs/ are refreshed (frontier, reliability sweep, mutation check, GPU kit)."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"needs exactly one line {begin} followed by one line {end} (found {text.count(begin)} "
                         f"and {text.count(end)})")
    return text[:text.index(begin) + len(begin)] + "\n" + block + "\n" + text[text.index(end):]
