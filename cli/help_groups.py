"""``--help`` in sections, one per owner of the options (``concept.options.group_of``: the core's training
options, the LoRA adapters, each family's, data, evaluation, ...), the command's own first."""
from __future__ import annotations

import click

OWN = "Options"  # the section of the command's own options (those not made from a declaration)


class GroupedHelp(click.Command):
    """A click command whose --help lists its options by ``help_group`` (set on the options made by
    ``concept.options.click_params`` / ``click_options``), each group a section in order of first appearance."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list] = {OWN: []}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "help_group", OWN), []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title[:1].upper() + title[1:]):
                    formatter.write_dl(rows)
