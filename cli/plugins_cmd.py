"""``concept plugins list [--check] [--kind KIND] [--json]``."""
from __future__ import annotations

import click
from rich.markup import escape

from .output import print_json, status, stdout, styled_status, table

BROKEN = ("error", "conflict")


@click.group()
def plugins() -> None:
    """Installed component plugins (built-in and third-party, found through entry points)."""


def _kinds(requested: tuple[str, ...]) -> list[str]:
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.registry import KINDS, registry

    if not requested:
        return list(KINDS)
    kinds = []
    for kind in requested:
        kind = kind.replace("-", "_")
        registry(kind)  # unknown kind -> UnknownComponentError with suggestions (exit 2)
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def _listed(kinds: list[str]) -> list[dict]:
    """Lazy listing from entry-point metadata: imports no plugin."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import PluginConflictError
    from concept.registry import registry

    rows = []
    for kind in kinds:
        reg = registry(kind)
        for name, ps in reg.providers().items():
            row = dict(kind=kind, name=name, provider=", ".join(p.label for p in ps),
                       target=", ".join(p.target for p in ps), status="not checked", detail="")
            if len(ps) > 1:
                try:
                    reg.provider(name)
                except PluginConflictError as exc:
                    row.update(status="conflict", detail=str(exc))
            rows.append(row)
    return rows


def _checked(kinds: list[str]) -> list[dict]:
    """Import every plugin and report ok / error / conflict, and run each component's conformance forward."""
    from dataclasses import asdict

    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.conformance import problem
    from concept.registry import check_all

    return [asdict(r) for r in check_all(conformance=problem) if r.kind in kinds]


@plugins.command("list")
@click.option("--check", is_flag=True, help="Import every plugin and report ok / error / conflict (exit 1 if any is broken).")
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only this component kind (family, backbone, length_policy, sampler, position_scheme, "
                   "vocabulary, attention, tail_fusion); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list to stdout.")
def list_plugins(check: bool, kinds: tuple[str, ...], as_json: bool) -> None:
    """List every registered component: kind, name, provider, target and status.

    Without --check nothing is imported (status "not checked", or "conflict" when two
    distributions provide one name).
    """
    selected = _kinds(kinds)
    rows = _checked(selected) if check else _listed(selected)
    broken = [r for r in rows if r["status"] in BROKEN]

    if as_json:
        print_json(rows)
    else:
        t = table("kind", "name", "provider", "target", "status", fold=("target", "provider"))
        for r in rows:
            t.add_row(escape(r["kind"]), escape(r["name"]), escape(r["provider"]), escape(r["target"]),
                      styled_status(r["status"]))
        stdout.print(t)
        for r in rows:
            if r["detail"]:
                stdout.print(f"{styled_status(r['status'])} {escape(r['kind'])} {escape(r['name'])}: "
                             f"{escape(r['detail'])}", soft_wrap=True)

    if check:
        if broken:
            status("plugins:", f"{len(broken)} of {len(rows)} broken")
        else:
            status("plugins:", f"all {len(rows)} import cleanly")
    if check and broken:
        click.get_current_context().exit(1)
