"""Writing to disk so that nothing already written is ever lost.

One rule for every command that writes a folder (``build``, ``train``, ``export``, ``frontier``,
``bench --save``, the backbone cache):

- the output is built whole in a *staging* folder beside it (``.NAME.partial``), never in place;
- it is published with one atomic rename when, and only when, the command succeeded; an existing
  output (``--force``) is swapped out at that moment and only then removed;
- an output folder that contains one of the command's own inputs is refused before anything
  is touched;
- a failure at any point (an exception, Ctrl-C, ``kill -9``) leaves every file that existed
  before byte-identical: the staging folder (and the parent folders the command created) is
  removed, or, after ``kill -9``, left for the next command on that output to sweep away (its
  owner's lock is gone).

Whoever writes an output, new or in place (``train --resume``), holds its lock (:class:`Lock`,
the file ``.NAME.lock`` beside it) for as long as it writes: a second writer is refused in one
line. The output path itself is checked before any work (:func:`check_output_path`: no
symbolic link, not the working folder or one that holds it, a name the filesystem takes, a
folder we may write in), and ``--force`` replaces only a concept run folder (:func:`replace_problem`),
checked again right before publishing. Full disks, file-size limits and quotas become one
line naming the folder (:func:`disk_errors`).

Single files (``train.json``, reports, caches) are replaced with :func:`write_atomic`: a
temporary file in the same folder renamed over the old one.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import os
import re
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .errors import RunFolderError

STAGING_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
RUN_MARKER = "concept.json"  # what makes a folder a concept run (concept.builder.RUN_FILE)
_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCHANGE = 2


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


def _rename2(a: Path, b: Path, flags: int) -> bool:
    """Linux ``renameat2(a, b, flags)``. False where the system or the filesystem cannot; then nothing was
    changed."""
    try:
        fn = _renameat2()
    except OSError:
        return False
    if fn is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the paths ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``). False where
    the system or the filesystem cannot; then nothing was changed."""
    return _rename2(a, b, _RENAME_EXCHANGE)


def rename_new(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest``, which must not exist: ``FileExistsError`` if something (even an empty
    folder) is there. Atomic with Linux ``renameat2(RENAME_NOREPLACE)``; elsewhere checked, then renamed."""
    if _rename2(src, dest, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dest):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest))
    os.rename(src, dest)


def replace_dir(new: Path, dest: Path) -> None:
    """Publish the finished folder ``new`` as ``dest``. An existing ``dest`` is swapped with it in one
    atomic step and removed afterwards; where no atomic swap exists, it is renamed aside first and
    renamed back if the second rename fails."""
    new, dest = Path(new), Path(dest)
    if not os.path.lexists(dest):
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


# -- the output path ------------------------------------------------------------------------------
def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # (unreachable)


def is_run_folder(folder: Path) -> bool:
    """``folder`` is a concept run folder (a build, a training run, an export): it holds a ``concept.json``
    file (possibly damaged: rebuilding a damaged run with ``--force`` must stay possible)."""
    marker = Path(folder) / RUN_MARKER
    return marker.is_file() and not marker.is_symlink()


def existing_ancestor(path: Path) -> Path:
    """The nearest folder at or above ``path`` (absolute) that exists."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _missing_parents(dest: Path) -> list[Path]:
    """The folders above ``dest`` that do not exist yet, innermost first (a failure removes what it created)."""
    missing, parent = [], Path(os.path.abspath(dest)).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


def _symlink_problem(dest: Path, flag: str) -> str | None:
    if not dest.is_symlink():
        return None
    target = os.readlink(dest)
    try:
        dest.resolve(strict=True)
    except RuntimeError:  # (Python < 3.13: a loop)
        return f"{flag} {dest} is a symbolic link loop ({dest} -> {target}); remove the link or choose another {flag}"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{flag} {dest} is a symbolic link loop ({dest} -> {target}); remove the link or choose another {flag}"
        return (f"{flag} {dest} is a symbolic link to {target}, which does not exist; remove the link or choose "
                f"another {flag}")
    return (f"{flag} {dest} is a symbolic link (to {target}); an output is never written through a link: pass "
            f"the folder itself ({flag} {dest.resolve()}) or another {flag}")


def check_output_path(dest: str | os.PathLike, flag: str = "--output") -> None:
    """Refuse, before any work, an output path no command can write: a symbolic link (dangling, a loop,
    or to a folder: publishing would replace the link), the working folder or one that holds it, a name
    the filesystem does not take (with room for its staging folder ``.NAME.partial``), a path under a
    file, or a folder we may not create files in."""
    dest = Path(dest)
    if dest.name in ("", ".", ".."):
        raise RunFolderError(f"{flag} {dest} is not a folder name: an output is a folder of its own, written whole "
                             f"and renamed into place; choose a new folder, e.g. {flag} NAME")
    problem = _symlink_problem(dest, flag)
    if problem:
        raise RunFolderError(problem)
    try:
        resolved, cwd = dest.resolve(), Path.cwd().resolve()
    except (OSError, RuntimeError) as exc:  # a loop in a parent
        raise RunFolderError(f"{flag} {dest}: its path cannot be resolved ({exc}); choose another {flag}") from None
    if resolved == cwd or resolved in cwd.parents:
        it = "is" if resolved == cwd else "holds"
        raise RunFolderError(f"{flag} {dest} {it} the current working folder ({cwd}); an output is replaced whole, "
                             f"so it may never be the folder you work in or one that holds it; choose another {flag}")
    ancestor = existing_ancestor(resolved.parent)
    if not ancestor.is_dir():
        raise RunFolderError(f"{flag} {dest}: {ancestor} is a file, not a folder; choose another {flag}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RunFolderError(f"{flag} {dest}: no permission to create files in {ancestor}; choose another {flag}")
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
        path_max = os.pathconf(ancestor, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    extra = len(f".{STAGING_SUFFIX}".encode())  # .NAME.partial (the longest sibling: .NAME.lock is shorter)
    for part in [*(p.name for p in _missing_parents(resolved)), resolved.name]:
        size = len(os.fsencode(part)) + (extra if part == resolved.name else 0)
        if size > name_max:
            longest = name_max - (extra if part == resolved.name else 0)
            raise RunFolderError(f"{flag} {dest}: the name {part[:40]}... is {len(os.fsencode(part))} bytes long; this "
                                 f"filesystem takes at most {longest} for it (an output needs room for its staging "
                                 f"folder .NAME{STAGING_SUFFIX}); choose a shorter name")
    if len(os.fsencode(str(resolved))) + 128 > path_max:  # (+ the files inside: checkpoint/..., adapter/...)
        raise RunFolderError(f"{flag} {dest}: the path is {len(os.fsencode(str(resolved)))} bytes long, too long for "
                             f"the files a run holds (at most about {path_max - 128}); choose a shorter path")


def contains(folder: Path, path: Path) -> bool:
    """``path`` is ``folder`` or lies inside it (symlinks resolved)."""
    folder, path = Path(folder).resolve(), Path(path).resolve()
    return folder == path or folder in path.parents


def check_inputs(dest: Path, inputs: Mapping[str, str | os.PathLike | None], flag: str = "--output") -> None:
    """Refuse an output folder that is or holds one of the command's ``inputs`` (name -> path): replacing it
    would delete them, so not even ``--force`` may."""
    for name, path in dict(inputs).items():
        if path is not None and Path(path).exists() and contains(dest, Path(path)):
            it = "is" if Path(path).resolve() == Path(dest).resolve() else "contains"
            raise RunFolderError(f"{flag} {dest} {it} the {name} {path}: the output must be a folder of its own, "
                                 f"outside the command's inputs (replacing it would destroy them); choose another {flag}")


def _listing(folder: Path, limit: int = 3) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def replace_problem(dest: Path, replace: bool, flag: str = "--output", what: str = "") -> str | None:
    """Why ``dest`` may not be (re)placed now, or None: it may be absent or an empty folder; a folder with
    anything in it only with ``replace`` (``--force``), and only when it is a concept run folder; a file or a
    symbolic link never. ``--force`` is suggested only where it would be allowed."""
    dest = Path(dest)
    problem = _symlink_problem(dest, flag)
    if problem:
        return problem
    if not dest.exists():
        return None
    if not dest.is_dir():
        return f"{flag} {dest} exists and is not a folder; choose another {flag}"
    if not any(dest.iterdir()):
        return None
    if not is_run_folder(dest):
        return (f"{flag} {dest} already exists and is not a concept run folder (it holds {_listing(dest)}); "
                f"commands replace only run folders and empty folders: choose another {flag}")
    if not replace:
        return (f"{flag} {dest} already exists and is not empty{what}; choose another {flag}, or pass --force to "
                f"replace it (the old folder is kept until the new one is complete)")
    return None


def check_target(dest: Path, force: bool, inputs: Mapping[str, str | os.PathLike | None] = (), flag: str = "--output",
                 what: str = "") -> None:
    """Refuse, before anything is read or written, an output that is not ours to (re)place: a path no
    command can write (:func:`check_output_path`), a folder holding one of the command's ``inputs`` (name ->
    path; replacing it would delete them), a non-empty folder without ``force``, anything but a run folder
    with it (:func:`replace_problem`), or an output another process is writing now."""
    dest = Path(dest)
    check_output_path(dest, flag)
    if dest.exists() and not dest.is_dir():
        raise RunFolderError(f"{flag} {dest} exists and is not a folder; choose another {flag}")
    check_inputs(dest, inputs, flag)
    problem = replace_problem(dest, force, flag, what)
    if problem:
        raise RunFolderError(problem)
    Lock(dest).probe()


def check_space(folder: Path, need: int, what: str, fix: str = "") -> None:
    """Refuse, before writing, when the disk holding ``folder`` has less than ``need`` bytes free (an estimate
    of what the command writes)."""
    where = existing_ancestor(Path(folder))
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if free < need:
        raise RunFolderError(f"the disk holding {folder} has {human_size(free)} free, less than the about "
                             f"{human_size(need)} {what} writes; free some space or choose a folder on another "
                             f"disk{fix}; nothing was written")


# -- full disks, file-size limits, quotas -----------------------------------------------------------
DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")


def disk_errno(exc: BaseException) -> int | None:
    """The errno of a full disk, a file-size limit or a quota behind ``exc`` (an ``OSError``, or the errors
    safetensors raises with the OS error in their text), else None."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return exc.errno
    for match in _OS_ERROR.finditer(str(exc)):
        code = int(match.group(1) or match.group(2))
        if code in DISK_ERRNOS:
            return code
    return None


def disk_message(code: int, folder: Path) -> str:
    """One line for a full disk (``ENOSPC``), a file-size limit (``EFBIG``) or a quota (``EDQUOT``) met while
    writing into ``folder``: what happened and what to do."""
    if code == errno.ENOSPC:
        return (f"the disk holding {folder} is full ({os.strerror(code)}); free some space or choose a folder on "
                f"another disk")
    if code == errno.EDQUOT:
        return f"your disk quota on the disk holding {folder} is used up; free some space or choose a folder on another disk"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (f"a file in {folder} would exceed this shell's file-size limit ({human_size(limit)}, `ulimit -f`); "
                f"raise it (`ulimit -f unlimited`) or choose a folder on another disk")
    return f"a file in {folder} is larger than its filesystem allows; choose a folder on another disk"


def resource_error(exc: BaseException, folder: Path, what: str = "") -> RunFolderError | None:
    """``exc`` as one line naming ``folder`` when it is a full disk, a file-size limit or a quota, else None.
    ``what``: what was not written and what is intact, e.g. "; the old folder is unchanged"."""
    code = disk_errno(exc)
    return None if code is None else RunFolderError(disk_message(code, Path(folder)) + what)


@contextlib.contextmanager
def disk_errors(folder: str | os.PathLike, what: str = "; nothing existing was changed") -> Iterator[None]:
    """Turn a full disk, a file-size limit or a quota met while writing into ``folder`` into one line
    (:func:`resource_error`); every other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        error = resource_error(exc, Path(folder), what)
        if error is None:
            raise
        raise error from exc


class RecordingWriter:
    """A binary file wrapper that hashes what it writes and keeps the ``OSError`` of a failed write: torch's
    writer turns it into "unexpected pos ..." and loses the errno (a full disk looks like a bug)."""

    def __init__(self, file):
        self.file, self.error = file, None
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(memoryview(data)[:written] if written is not None else data)
        return written

    def flush(self) -> None:
        self.file.flush()


def write_file(path: Path, data: bytes | Callable) -> str:
    """Write ``path`` (bytes, or a function writing to a binary file object), flushed to disk; returns its
    SHA-256. A failed write raises its ``OSError`` (errno kept), even from inside ``torch.save``."""
    with open(path, "wb") as f:
        writer = RecordingWriter(f)
        try:
            if callable(data):
                data(writer)
            else:
                writer.write(data)
        except Exception:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.digest.hexdigest()


# -- locks and staging ------------------------------------------------------------------------------
def lock_path(dest: Path) -> Path:
    """The lock file of the output ``dest``: ``.NAME.lock`` beside it (its real path: one lock however
    ``dest`` is spelled)."""
    real = Path(dest).resolve()
    return real.with_name(f".{real.name}{LOCK_SUFFIX}")


class Lock:
    """The exclusive lock of the output ``dest``, held by whoever writes it (a new output while it is staged,
    a run trained, resumed or replaced in place) for as long as it writes. A second writer is refused in one
    line. It is an advisory ``flock`` on ``.NAME.lock`` beside ``dest``: the system releases it when its
    process dies (``kill -9`` included), so a lock nobody holds means its writer is gone."""

    def __init__(self, dest: str | os.PathLike):
        self.dest = Path(dest)
        self.path = lock_path(self.dest)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _try(self) -> bool:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666 & ~umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder may have removed the file between our open and our lock: then lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)

    def holder(self) -> str:
        try:
            pid = self.path.read_text().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid.isdigit() else "it"

    def acquire(self) -> "Lock":
        """Take the lock, or raise ``RunFolderError`` naming the process that holds it."""
        if not self._try():
            raise RunFolderError(f"another process is writing {self.dest} ({self.holder()} holds {self.path}); wait "
                                 f"for it to finish, or choose another output") from None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.write(self._fd, str(os.getpid()).encode())
        return self

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it (False also where no lock file can be made, e.g. a read-only
        parent folder)."""
        try:
            return self._try()
        except OSError:
            return False

    def probe(self) -> None:
        """Refuse now, before any work, an output another process is writing (the lock is taken for real when
        writing starts)."""
        if not os.path.isdir(self.path.parent):
            return
        if self.try_acquire():
            self.release()
        elif self.path.exists():
            self.acquire()  # (raises, naming the holder)

    def release(self) -> None:
        """Release the lock (and remove its file: a leftover file is harmless, a held lock is not)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "Lock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def staging_path(dest: Path) -> Path:
    return Path(dest).with_name(f".{Path(dest).name}{STAGING_SUFFIX}")


class Staging:
    """A staging folder for ``dest``, written under ``dest``'s :class:`Lock`: a second writer of the same
    ``dest`` is refused, and a staging folder left by a writer that was killed (nobody holds its lock) is
    swept away when the next writer starts. ``replace``: an existing run folder at ``dest`` may be replaced
    (``--force``). What ``dest`` holds is checked again when the lock is taken and right before publishing:
    a folder another program created or filled there meanwhile is never replaced. A failure removes the
    staging folder and the parent folders it created."""

    def __init__(self, dest: str | os.PathLike, replace: bool = False, flag: str = "--output"):
        self.dest = Path(dest)
        self.path = staging_path(self.dest)
        self.replace, self.flag = replace, flag
        self.lock: Lock | None = None
        self.swept = False
        self.existed = False  # dest was there when the lock was taken (empty, or a run to replace)
        self.created: list[Path] = []  # parent folders this staging created, innermost first

    @property
    def lock_path(self) -> Path:
        return lock_path(self.dest)

    def open(self) -> "Staging":
        self.created = _missing_parents(self.dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.lock = Lock(self.dest).acquire()
            problem = replace_problem(self.dest, self.replace, self.flag)  # as it is now that we hold the lock
            if problem:
                raise RunFolderError(problem)
            self.existed = self.dest.exists()
            if os.path.lexists(self.path):  # left by a writer that was killed: nobody else holds the lock
                if self.path.is_dir() and not self.path.is_symlink():
                    shutil.rmtree(self.path)
                else:
                    os.unlink(self.path)
                self.swept = True
            self.path.mkdir()
        except BaseException:
            self._abandon()
            raise
        return self

    def _changed(self) -> str | None:
        """Why ``dest`` may not be published over now (another program changed it while we worked), or None."""
        if not self.existed and os.path.lexists(self.dest):
            return (f"{self.dest} was created by another program while this command ran; it was left as it is and "
                    f"the new output was discarded; choose another {self.flag} (or move it away) and run again")
        return replace_problem(self.dest, self.replace, self.flag) if self.existed else None

    def publish(self, keep_lock: bool = False) -> Path:
        """Move the staged folder to ``dest`` (replacing an existing one in the same atomic step), after
        checking ``dest`` once more. ``keep_lock``: go on holding ``dest``'s lock (``self.lock``; the caller
        releases it), e.g. to train in the published run. On any failure the staging folder is discarded."""
        try:
            problem = self._changed()
            if problem:
                raise RunFolderError(problem)
            publish_permissions(self.path)
            if self.existed:
                replace_dir(self.path, self.dest)
            else:
                try:
                    rename_new(self.path, self.dest)
                except FileExistsError:
                    raise RunFolderError(self._changed() or f"{self.dest} appeared while this command ran") from None
        except BaseException:
            self.discard()
            raise
        self.created = []  # (they hold the output now)
        if not keep_lock:
            self.close()
        return self.dest

    def discard(self) -> None:
        """Remove the staging folder, release the lock and remove the parent folders this staging created."""
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._abandon()

    def _abandon(self) -> None:
        self.close()
        for folder in self.created:  # innermost first; a folder someone else put something in stays
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.created = []

    def close(self) -> None:
        """Release the lock (and remove its file)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@contextlib.contextmanager
def staged(dest: str | os.PathLike, replace: bool = False, flag: str = "--output") -> Iterator[Path]:
    """``with staged(out) as tmp:`` write the output into ``tmp``; it becomes ``out`` when the block
    finishes, and is removed (``out`` untouched) when the block raises, Ctrl-C included. A full disk, a
    file-size limit or a quota is one line naming the folder (:func:`disk_errors`)."""
    staging = Staging(dest, replace=replace, flag=flag).open()
    try:
        with disk_errors(dest, "; nothing was written" + (f" ({dest} is unchanged)" if staging.existed else "")):
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
