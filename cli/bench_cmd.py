"""``concept bench``: the pytest-benchmark suites in a subprocess, baselines per machine, a table of
speed-ups against the dense backbone and against the ideal FLOP ratio."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from concept.config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE

from .output import print_json, status, stdout, table

SUITES = {"forward": "test_forward.py", "train": "test_train_step.py", "decode": "test_decode.py",
          "attention": "test_attention.py", "planner": "test_planner.py", "policy": "test_policy_scan.py",
          "ops": "test_op_counts.py", "adapters": "test_adapters.py", "merged": "test_merged.py"}
FAIL_ON = re.compile(r"^(min|max|mean|median|stddev|iqr):\d+(\.\d+)?%?$")


def benchmarks_dir() -> Path:
    """The suites ship with the source tree (``benchmarks/`` next to ``concept/``)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept

    return Path(concept.__file__).resolve().parent.parent / "benchmarks"


def machine_id(device: str) -> str:
    """A folder name for this machine's baselines: CPU model and core count, or the GPU's name."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        what = torch.cuda.get_device_name(0)
    else:
        what = _cpu_name() or platform.machine()
        what = f"{what}-{os.cpu_count()}c"
    return re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _saved(storage: Path, name: str) -> list[Path]:
    """Saved runs named ``name`` in ``storage`` (pytest-benchmark nests them one folder deeper)."""
    return sorted(storage.glob(f"*/[0-9][0-9][0-9][0-9]_{name}.json")) if storage.is_dir() else []


def publish_new_files(staged: Path, storage: Path) -> None:
    """Copy the files of ``staged`` that ``storage`` lacks into it, each atomically (``concept.fs``)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import fs

    for path in sorted(staged.rglob("*")):
        target = storage / path.relative_to(staged)
        if path.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.write_atomic(target, path.read_bytes())


def own_pytest_env() -> dict[str, str]:
    """The environment for a pytest of our own: without a surrounding pytest-xdist worker's variables, which
    would make pytest-benchmark think it runs under xdist and skip its timings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def run_to_stderr(args: list[str]) -> int:
    """Run a command with its output on our stderr (pytest's own report is status, not data)."""
    env = own_pytest_env()
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (tests): relay the text
        proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        sys.stderr.write(proc.stdout)
        return proc.returncode
    return subprocess.call(args, stdout=sys.stderr, env=env)


def check_fail_on(expressions: tuple[str, ...]) -> list[str]:
    return [f"--fail-on {e!r}: expected STAT:N% or STAT:SECONDS with STAT one of min, max, mean, median, "
            f"stddev, iqr (e.g. mean:10%)" for e in expressions if not FAIL_ON.match(e)]


def render(rows: list[dict]) -> None:
    counts = [r for r in rows if r.get("suite") == "ops"]
    rows = [r for r in rows if r.get("suite") != "ops"]
    if counts:
        c = table("backbone", "call", "model", "tokens", "aten ops", "host syncs", "not torch.optim",
                  title="aten ops and host syncs per call (concept.profiling)")
        for r in counts:
            c.add_row(r["backbone"], r["what"], r["model"], str(r["tokens"]), f"{r['aten_ops']:,}", str(r["host_syncs"]),
                      str(r["syncs_outside_optimizer"]))
        stdout.print(c)
    if not rows:
        return
    groups: dict[tuple, list] = {}  # the rows by what their two sides are (most: dense and concept)
    for r in rows:
        groups.setdefault(tuple(r.get("sides") or ("dense", "concept")), []).append(r)
    for (first, second), group in groups.items():
        stdout.print(side_by_side_table(first, second, group))


def side_by_side_table(first: str, second: str, rows: list[dict]):
    """The timings of ``first`` (the reference, ``dense_s``) and ``second`` (``concept_s``); the ideal and its
    share only where the rows have one (a FLOP ratio: dense vs concept; none for two ways of the same work)."""
    ideal = any(r.get("ideal_speedup") is not None for r in rows)
    columns = [f"{first} s", f"{second} s", f"speed-up ({first} / {second})", *(("ideal", "of ideal") if ideal else ()),
               "concepts/token", f"peak MiB ({first} / {second})"]
    t = table("case", *columns, title=f"{second} vs {first} (measured side by side)")
    for r in rows:
        peak = f"{r['dense_peak_mib']:.0f} / {r['concept_peak_mib']:.0f}" if "dense_peak_mib" in r else "-"
        # the realised concepts per token (decoding: over the timed steps)
        ratio = f"{r['ratio']:.3f}" if isinstance(r.get("ratio"), (int, float)) else "-"
        shares = ()
        if ideal:
            shares = (("-", "-") if r.get("ideal_speedup") is None else
                      (f"{r['ideal_speedup']:.2f}x", f"{100 * r['fraction_of_ideal']:.0f}%"))
        t.add_row(r["case"], f"{r['dense_s']:.4f}", f"{r['concept_s']:.4f}", f"{r['speedup']:.2f}x", *shares, ratio, peak)
    return t


@click.command()
@click.option("--suite", type=click.Choice(["all", *SUITES]), default="all", show_default=True)
@click.option("--smollm2", is_flag=True, help="Add the cases on the real SmolLM2 backbone (minutes on a CPU).")
@click.option("--long", "long_", is_flag=True, help="Add the 16k-token attention cases.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu or cuda.")
@click.option("-k", "keyword", default=None, help="Only the cases matching this pytest -k expression.")
@click.option("--save", default=None, metavar="NAME", help="Store this run as baseline NAME for this machine.")
@click.option("--compare", default=None, metavar="NAME", help="Compare against this machine's latest baseline NAME.")
@click.option("--fail-on", multiple=True, metavar="EXPR",
              help="With --compare: exit non-zero on a regression, e.g. mean:10% (repeatable).")
@click.option("--storage", type=click.Path(path_type=Path), default=None,
              help="Baselines folder (default: benchmarks/baselines/<machine id>).")
@click.option("--smoke", is_flag=True, help="Run every case once with timing disabled (what CI does).")
@click.option("--compile", "compile_", type=click.Choice(COMPILE_CHOICES), default=DEFAULT_COMPILE,
              show_default=True, is_flag=False, flag_value="on", help=COMPILE_HELP + " Passed to the suites (their `compile_choice` fixture).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def bench(suite, smollm2, long_, device, keyword, save, compare, fail_on, storage, smoke, compile_, as_json):
    """Benchmark the streaming model against the dense backbone (pytest-benchmark).

    \b
    concept bench                                        # every suite, tiny cases, a table of ratios
    concept bench --suite attention --long              # attention only, up to 16k tokens
    concept bench --suite ops --smollm2                 # aten ops and host syncs per forward and training step
    concept bench --smollm2 --save mymachine            # store a baseline for this machine
    concept bench --smollm2 --compare mymachine --fail-on mean:10%
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConceptError, ConfigError

    problems = check_fail_on(fail_on)
    if fail_on and not compare:
        problems.append("--fail-on needs --compare NAME (the baseline to compare against)")
    if smoke and (save or compare):
        problems.append("--smoke disables timing, so there is nothing to --save or --compare")
    if problems:
        raise ConfigError(problems)
    if device == "auto":  # as every command: the GPU when there is one
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConceptError(f"--device {device}: no CUDA device is available on this machine; use --device cpu")
    where = benchmarks_dir()
    if not where.is_dir():
        raise ConceptError(f"the benchmark suites are not here ({where}); run from a source checkout of concept")
    mid = machine_id(device)
    storage = storage or where / "baselines" / mid
    args = [sys.executable, "-m", "pytest", *(str(where / f) for f in ([SUITES[suite]] if suite != "all" else SUITES.values())),
            "-q", "-p", "no:cacheprovider", "--rootdir", str(where.parent), f"--device={device}", f"--compile={compile_}",
            f"--benchmark-storage=file://{storage}"]
    args += ["--smollm2"] * smollm2 + ["--long"] * long_ + (["-k", keyword] if keyword else [])
    if smoke:
        args.append("--benchmark-disable")
    if save:
        args.append(f"--benchmark-save={save}")
    if compare:
        runs = _saved(storage, compare)
        if not runs:
            known = sorted({p.stem.split("_", 1)[1] for p in storage.glob("*/*.json")}) if storage.is_dir() else []
            raise ConceptError(f"no baseline named {compare!r} for machine {mid} in {storage} "
                               f"({'saved: ' + ', '.join(known) if known else 'none saved yet'}); "
                               f"store one first with `concept bench --save {compare}`")
        args.append(f"--benchmark-compare={runs[-1].stem.split('_', 1)[0]}")
        args += [f"--benchmark-compare-fail={e}" for e in fail_on]
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "rows.json"
        args.append(f"--concept-results={results}")
        staged = Path(tmp) / "storage"  # --save: pytest-benchmark writes into a copy, published on success
        if save:
            if storage.is_dir():
                shutil.copytree(storage, staged)
            args = [f"--benchmark-storage=file://{staged}" if a.startswith("--benchmark-storage=") else a for a in args]
        status("benchmarking", f"{suite} on {device} (machine {mid}) ...")
        code = run_to_stderr(args)
        rows = json.loads(results.read_text()) if results.is_file() else []
        if code not in (0, 5):  # 5: no case selected
            raise ConceptError(f"the benchmark run failed (pytest exit code {code}"
                               f"{'; a regression against the baseline' if compare and fail_on else ''}); see its "
                               f"output above{'; no baseline was saved' if save else ''}")
        if code == 5 and (save or compare):  # a gate that compared nothing must not pass
            asked = " and ".join(f for f, given in (("--save", save), ("--compare", compare), ("--fail-on", fail_on))
                                 if given)
            raise ConceptError(f"no benchmark case ran ({f'-k {keyword!r} matched none' if keyword else 'none selected'}"
                               f" in suite {suite}), so {asked} had nothing to {'save' if save and not compare else 'compare'}"
                               f"{'; no baseline was saved' if save else ''}; check -k (`concept bench --suite {suite} "
                               f"-k EXPR`) and --suite / --smollm2 / --long")
        if save:
            publish_new_files(staged, storage)
    if save:
        status("saved", f"baseline {save!r} in {storage}")
    if as_json:
        print_json(rows)
    elif rows:
        render(rows)
    elif not smoke:
        status("note:", "no case ran (see -k / --smollm2 / --long)")
