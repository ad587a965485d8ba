"""docs/plugins.md is re-checked by running its examples (issue 41, item 6), so they cannot go stale.

Its python blocks are extracted and run in a temporary folder: a block after ``<!-- file: PATH -->`` is written to
PATH there (with ``; entry point: GROUP NAME = TARGET`` also registered), a ``pyproject.toml`` block's entry points
are registered as its distribution's, a block after ``<!-- part of: PATH -->`` must be a piece of PATH's block, and
every other python block is run as a script, in order, each ``print`` line's comment being what it prints. The
registration is a scratch one: ``*.dist-info`` folders in the temporary folder, put on ``sys.path``."""
from __future__ import annotations

import contextlib
import io
import re
import sys
import tomllib
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
FIXTURE = Path(__file__).parent / "fixtures" / "concept-fixture-plugin" / "concept_fixture_plugin" / "every_other.py"
BLOCK = re.compile(r"(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>python|toml)\n(?P<code>.*?)\n```\n", re.S)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, marker or "", code) of each python or toml block of ``text``, in order."""
    return [(m["lang"], m["marker"] or "", m["code"] + "\n") for m in BLOCK.finditer(text)]


def expected_prints(code: str) -> list[str]:
    return [line.split("  # ", 1)[1] for line in code.splitlines() if line.lstrip().startswith("print(")]


def dist_info(site: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))


def lay_out(site: Path, found: list[tuple[str, str, str]]) -> tuple[dict[str, str], list[str]]:
    """Write the file blocks and the scratch registrations into ``site``; return (path -> code, scripts)."""
    files, scripts, extra = {}, [], {}
    for lang, marker, code in found:
        if marker.startswith("file: "):
            path, _, entry = marker[len("file: "):].partition("; entry point: ")
            files[path] = code
            if entry:
                group, assignment = entry.split(" ", 1)
                name, target = (part.strip() for part in assignment.split("="))
                extra.setdefault(group, {})[name] = target
        elif lang == "python" and not marker:
            scripts.append(code)
    for path, code in files.items():
        if path == "pyproject.toml":
            project = tomllib.loads(code)["project"]
            dist_info(site, project["name"], project["version"], project.get("entry-points", {}))
            continue
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(code)
        if (site / path).parent != site and not (site / path).parent.joinpath("__init__.py").exists():
            (site / path).parent.joinpath("__init__.py").write_text("")
    dist_info(site, "plugin-docs-examples", "0.0", extra)
    return files, scripts


@pytest.fixture()
def scratch(tmp_path, monkeypatch):
    from concept import families, registry

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_REGISTRIES", {})
    monkeypatch.setattr(families, "_INSTANCES", {})
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:  # the examples' modules (concept_fixture_plugin, ...) are this test's
        if name.split(".")[0] in ("concept_fixture_plugin", "veto_policy", "bias_family"):
            del sys.modules[name]


def test_the_examples_of_the_plugin_guide_run(scratch, one_thread):
    found = blocks(DOC.read_text())
    files, scripts = lay_out(scratch, found)
    assert {"pyproject.toml", "concept_fixture_plugin/every_other.py", "veto_policy.py", "bias_family.py"} <= set(files)
    assert files["concept_fixture_plugin/every_other.py"] == FIXTURE.read_text()  # the doc shows the fixture as it is
    for lang, marker, code in found:
        if marker.startswith("part of: "):
            assert code in files[marker[len("part of: "):]], code
    assert len(scripts) == 3
    for code in scripts:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
        assert out.getvalue().splitlines() == expected_prints(code), code


def test_a_stale_example_fails(scratch, one_thread):
    """Negative control: the guide's length policy with a step rule off by one token is caught by the check the
    guide's checklist asks for (``plugins list --check``'s conformance forward), and a wrong printed comment fails
    the comparison."""
    from concept import conformance

    found = blocks(DOC.read_text())
    files, scripts = lay_out(scratch, found)
    stale = files["concept_fixture_plugin/every_other.py"].replace("return t % 2 == self.phase, t + 1",
                                                                  "return t % 2 != self.phase, t + 1")
    (scratch / "concept_fixture_plugin" / "every_other.py").write_text(stale)
    from concept_fixture_plugin.every_other import EveryOtherPolicy

    assert "decide() and step() disagree" in conformance.problem("length_policy", EveryOtherPolicy)
    script = scripts[-1].replace("# True", "# False")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, str(DOC), "exec"), {"__name__": "__doc_example__"})
    assert out.getvalue().splitlines() != expected_prints(script)
