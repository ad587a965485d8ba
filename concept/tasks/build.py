"""Build the offline tasks' data from text this machine has and the runs never trained on.

    python -m concept.tasks.build            # rewrite concept/tasks/data/*.jsonl and cards.json
    python -m concept.tasks.build --check    # build in memory and compare with the shipped files

Sources: the held-out splits of the two built-in corpora (``concept.data``: 5% of documents, chosen
by a hash of each document's name, never read by training on the built-in corpora), so every item
is text no run trained on unless it was trained on these exact files by hand. Deterministic: documents
in name order, items in document order, distractors drawn by ``random.Random(SEED)``; the same
Python standard library gives the same bytes (``cards.json`` records the Python version).

* ``concept_cloze`` (LAMBADA-style): the last word of a sentence of held-out prose (the pydoc
  topics), given the passage before it in its paragraph.
* ``concept_code_continuation`` (HellaSwag-style): which of four 3-line continuations follows the
  first lines of a held-out standard-library function; the wrong ones are the continuations of
  other functions, re-indented to the same depth.
* ``concept_docstring_name``: which of four names a held-out function with this docstring summary has
  (``# summary`` then ``def``); the wrong names are other held-out functions'.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import random
import re
import sys
import textwrap
from pathlib import Path

from concept.data import read_documents
from concept.fs import write_atomic

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SEED = 0
MAX_ITEMS = 400
CHOICES = 4
CONTEXT_CHARS = 600  # a cloze passage: at most this many characters before the word

WORD = re.compile(r"[A-Za-z]{3,}")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


# -- prose: last-word cloze -----------------------------------------------------------------------
def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running prose: blocks between blank lines that are not indented (code, quoted
    grammar) and hold no interpreter prompt, with their lines joined by spaces."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not block.strip() or any(line.startswith((" ", "\t")) for line in lines) or ">>>" in block:
            continue
        out.append(" ".join(line.strip() for line in lines))
    return out


def cloze_items(docs) -> list[dict]:
    items = []
    for doc in docs:
        for p, paragraph in enumerate(prose_paragraphs(doc.text)):
            sentences = SENTENCE_END.split(paragraph)
            for s, sentence in enumerate(sentences):
                words = sentence.split()
                if len(words) < 6 or not sentence.endswith("."):
                    continue
                last = words[-1][:-1]
                if not WORD.fullmatch(last):
                    continue
                before = " ".join(sentences[:s] + [" ".join(words[:-1])])
                if len(before) > CONTEXT_CHARS:  # cut at a word boundary
                    before = before[len(before) - CONTEXT_CHARS:].split(" ", 1)[-1]
                items.append({"id": f"{doc.name}#p{p}s{s}", "context": before, "target": " " + last})
    return items


# -- code: functions of held-out modules ----------------------------------------------------------
def functions(docs) -> list[tuple[str, ast.FunctionDef, list[str]]]:
    """(document name, node, its source lines dedented) of every function and method, in order."""
    out = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        lines = doc.text.split("\n")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                source = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno])).split("\n")
                out.append((doc.name, node, source))
    return sorted(out, key=lambda f: (f[0], f[1].lineno))


def indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def reindent(block: list[str], indent: str) -> list[str]:
    base = indent_of(block[0])
    return [indent + line[len(base):] if line.startswith(base) else indent + line.lstrip() for line in block]


def code_continuation_items(docs, rng: random.Random) -> list[dict]:
    cases = []
    for name, node, source in functions(docs):
        body = [line for line in source if line.strip()]
        if len(body) < 7:
            continue
        k = min(len(body) // 2, 10)
        real = body[k:k + 3]
        if sum(len(line.strip()) for line in real) < 24:
            continue
        cases.append({"id": f"{name}:{node.lineno}:{node.name}", "context": "\n".join(body[:k]) + "\n", "real": real})
    items = []
    for i, case in enumerate(cases):
        indent = indent_of(case["real"][0])
        real = "\n".join(case["real"])
        others = [c for j, c in enumerate(cases) if j != i]
        wrong: list[str] = []
        for other in rng.sample(others, len(others)):
            text = "\n".join(reindent(other["real"], indent))
            if text != real and text not in wrong:
                wrong.append(text)
            if len(wrong) == CHOICES - 1:
                break
        label = rng.randrange(CHOICES)
        choices = wrong[:label] + [real] + wrong[label:]
        items.append({"id": case["id"], "context": case["context"], "choices": choices, "label": label})
    return items


def docstring_name_items(docs, rng: random.Random) -> list[dict]:
    cases, seen = [], set()
    for name, node, _ in functions(docs):
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or node.name in seen:
            continue
        summary = doc.strip().split("\n")[0].strip()
        if len(summary.split()) < 3 or node.name.lower() in summary.lower():
            continue
        seen.add(node.name)
        cases.append({"id": f"{name}:{node.lineno}:{node.name}", "summary": summary, "name": node.name})
    items = []
    for i, case in enumerate(cases):
        others = [c["name"] for j, c in enumerate(cases) if j != i]
        wrong = rng.sample(others, CHOICES - 1)
        label = rng.randrange(CHOICES)
        names = wrong[:label] + [case["name"]] + wrong[label:]
        items.append({"id": case["id"], "context": f"# {case['summary']}\ndef", "choices": [f" {n}(" for n in names],
                      "label": label})
    return items


# -- all of it ------------------------------------------------------------------------------------
SOURCES = {"concept_cloze": "pydoc", "concept_code_continuation": "stdlib", "concept_docstring_name": "stdlib"}


def build() -> dict[str, list[dict]]:
    prose = read_documents("pydoc", "heldout")
    code = read_documents("stdlib", "heldout")
    tasks = {"concept_cloze": cloze_items(prose),
             "concept_code_continuation": code_continuation_items(code, random.Random(SEED)),
             "concept_docstring_name": docstring_name_items(code, random.Random(SEED))}
    pick = random.Random(SEED)
    for name, items in tasks.items():  # at most MAX_ITEMS, spread over the documents, in document order
        if len(items) > MAX_ITEMS:
            keep = sorted(pick.sample(range(len(items)), MAX_ITEMS))
            tasks[name] = [items[i] for i in keep]
    return tasks


def encode(items: list[dict]) -> bytes:
    return "".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items).encode("utf-8")


def document_of(item_id: str) -> str:
    """The source document of an item id (``NAME#pPsS`` for prose, ``PATH:LINE:FUNCTION`` for code)."""
    return item_id.split("#")[0] if "#" in item_id else item_id.rsplit(":", 2)[0]


def cards(tasks: dict[str, list[dict]]) -> dict:
    return {"python": platform.python_version(), "seed": SEED,
            "tasks": {name: {"items": len(items), "source": f"{SOURCES[name]} (held-out split)",
                             "documents": len({document_of(i["id"]) for i in items}),
                             "sha256": hashlib.sha256(encode(items)).hexdigest()}
                      for name, items in tasks.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m concept.tasks.build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare a fresh build with the shipped files")
    parser.add_argument("--out", type=Path, default=DATA, help="folder to write (default: the shipped data)")
    args = parser.parse_args(argv)
    tasks = build()
    if args.check:
        shipped = json.loads((DATA / "cards.json").read_text())
        fresh = cards(tasks)
        differ = [n for n in fresh["tasks"] if fresh["tasks"][n]["sha256"] != shipped["tasks"].get(n, {}).get("sha256")]
        print(f"built with Python {fresh['python']}; shipped with {shipped['python']}: "
              + ("identical" if not differ else f"differ: {', '.join(differ)}"))
        return 1 if differ else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, items in tasks.items():
        write_atomic(args.out / f"{name}.jsonl", encode(items))
        print(f"{name}: {len(items)} items", file=sys.stderr)
    write_atomic(args.out / "cards.json", (json.dumps(cards(tasks), indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
