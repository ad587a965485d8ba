"""``--help`` in sections, one per owner of the options (``concept.options.group_of``: the core's training
options, the LoRA adapters, each family's, data, evaluation, ...), the command's own first."""
from __future__ import annotations

import pkgutil

import click

OWN = "Options"  # the section of the command's own options (those not made from a declaration)


class GroupedHelp(click.Command):
    """A click command whose --help lists its options by ``help_group`` (set on the options made by
    ``concept.options.click_params`` / ``click_options``), each group a section in order of first appearance.

    ``like``: where an option dataclass is declared (``"module:Class"``, imported for --help only) whose groups
    the command's own options of the same flag are listed in (``concept eval``'s ``--data`` and ``--device`` in
    ``concept train``'s sections), except its catch-all ``options_title`` (train's "training"); ``help_group``
    set on an option itself comes first."""

    def __init__(self, *args, like: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.like = like

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        like = self.like_groups()
        sections: dict[str, list] = {OWN: []}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                # its own group, else the group its flag (or the flag it sits beside: ``help_beside``) has in ``like``
                flags = (*param.opts, getattr(param, "help_beside", None))
                group = getattr(param, "help_group", None) or next((like[f] for f in flags if f in like), OWN)
                sections.setdefault(group, []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title[:1].upper() + title[1:]):
                    formatter.write_dl(rows)

    def like_groups(self) -> dict[str, str]:
        """Flag -> help group, of the options declared where ``like`` says (none without it)."""
        if self.like is None:
            return {}
        # lazy: the declarations (and the registry they read) load only for --help
        from concept.options import entries

        cls = pkgutil.resolve_name(self.like)
        return {e.flag: e.group for e in entries(cls) if e.group != getattr(cls, "options_title", "options")}
