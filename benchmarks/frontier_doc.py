"""Put a finished frontier into a document: replace the block between a ``<!-- frontier:begin -->`` line
and a ``<!-- frontier:end -->`` line of FILE with the frontier's table, its image (linked relative to FILE)
and the command that produced it (what ``OUT/frontier.md`` holds); the rest of FILE is untouched and the
file is replaced atomically. The library writes only its own output folder; refreshing the docs is this
script's job (as for the other generated tables in docs/)::

    concept frontier ... -o runs/frontier
    .venv/bin/python -m benchmarks.frontier_doc runs/frontier docs/results.md
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

BEGIN, END = "<!-- frontier:begin -->", "<!-- frontier:end -->"


def read_frontier(out: Path) -> dict:
    """``OUT/frontier.json``, the result ``concept frontier -o OUT`` wrote."""
    path = out / "frontier.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file; run `concept frontier -o {out}` first") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: cannot read it ({exc}); rerun `concept frontier -o {out}`") from None


def read_doc(path: Path) -> str:
    """The text of ``path``, which must hold one begin ... end block."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file; create it with a line {BEGIN} and a line {END} "
                         f"where the frontier should go") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    begins, ends = text.count(BEGIN), text.count(END)
    if begins != 1 or ends != 1 or text.index(BEGIN) > text.index(END):
        found = f"found {begins} begin and {ends} end marker(s)" + (", end before begin" if begins == ends == 1 else "")
        raise SystemExit(f"error: {path}: needs exactly one {BEGIN} line followed by one {END} line "
                         f"({found}); add them where the frontier should go and rerun")
    return text


def update_doc(out: Path, path: Path) -> Path:
    """Replace the marked block of ``path`` with the frontier of ``out``; returns the path written."""
    from concept import fs
    from concept.recipes.frontier import report_block

    result, text = read_frontier(out), read_doc(path)
    image = Path(os.path.relpath((out / "frontier.png").resolve(), path.resolve().parent)).as_posix()
    return fs.write_atomic(path.resolve(), fs.replace_marked(text, BEGIN, END, report_block(result, image)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the frontier's output folder (`concept frontier -o OUT`)")
    parser.add_argument("file", type=Path, help=f"the document whose {BEGIN} block gets the frontier")
    args = parser.parse_args(argv)
    print(f"updated {update_doc(args.out, args.file)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
