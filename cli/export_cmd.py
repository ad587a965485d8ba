"""``concept export``: a run as a self-contained folder (HF backbone, peft adapter, concept modules, transformers
classes, model card), optionally pushed to the Hugging Face hub."""
from __future__ import annotations

import time
from pathlib import Path

import click
from rich.markup import escape

from .output import human_bytes, print_json, quiet_progress_bars, status, stdout, table
from .renamed import renamed

LORA = {"adapter": "peft adapter folder (adapter/)", "merged": "merged into backbone/", None: "none"}


@click.command(name="export")
@click.argument("run", metavar="RUN_DIR", type=click.Path(path_type=Path))
@renamed("-o", "--output", "out", old=("--out",), type=click.Path(path_type=Path), metavar="DIR", required=True,
              help="Folder to write (refused if it exists and is not empty, unless --force).")
@click.option("--merge-lora", is_flag=True,
              help="Merge the LoRA adapters into the backbone's weights (peft merge_and_unload) instead of "
                   "writing them as a peft adapter folder.")
@click.option("--force", is_flag=True,
              help="Replace an existing run folder or export at DIR (never a folder that is not a run); the old "
                   "folder is removed only once the new export is complete.")
@click.option("--no-check", is_flag=True,
              help="Skip loading the export back and comparing its logits with the run's before publishing it.")
@click.option("--push-to-hub", "repo", metavar="ORG/NAME", default=None,
              help="Then upload the folder to this Hugging Face hub model repo (created if missing) as one commit; "
                   "its adapter_config.json names the backbone's hub id as the base where it has one.")
@click.option("--private", is_flag=True, help="--push-to-hub: create the repo private.")
@click.option("--dry-run", is_flag=True, help="--push-to-hub: list the files that would be uploaded; upload nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
def export(run: Path, out: Path, merge_lora: bool, force: bool, no_check: bool, repo: str | None, private: bool,
           dry_run: bool, as_json: bool) -> None:
    """Export a run to a self-contained folder that `concept.load(DIR)` opens anywhere: the backbone as a
    Hugging Face folder, the LoRA adapters as a peft folder (or merged), the concept modules, the build
    plan and a model card with the run's held-out numbers.

    \b
    concept export runs/m1-train -o exports/m1
    concept export runs/m1-train -o exports/m1-merged --merge-lora --json
    concept export runs/dense -o exports/dense --force
    concept export runs/m1-train -o exports/m1 --push-to-hub my-org/m1 --dry-run
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.export import export as export_run
    from concept.hub import push_folder

    if (private or dry_run) and not repo:
        raise click.UsageError(f"{'--dry-run' if dry_run else '--private'} goes with --push-to-hub ORG/NAME")
    quiet_progress_bars()
    start = time.perf_counter()
    result = export_run(run, out, merge_lora=merge_lora, force=force, check=not no_check, report=status)
    if result.check is not None:
        status("checked", f"the export reproduces the run's logits (max |Δ| {result.check['max_abs_diff']:.2g})")
    status("exported", f"{out} in {time.perf_counter() - start:.1f} s")
    pushed = None
    if repo:
        status("pushing" if not dry_run else "dry run", f"{out} -> the hub repo {repo} ...")
        pushed = push_folder(out, repo, private=private or None, dry_run=dry_run)

    if as_json:
        print_json({**result.to_dict(), **({"push": pushed} if pushed else {})})
        return
    step = f", step {result.step}" if result.step is not None else ", untrained"
    stdout.print(f"[bold]exported[/] {escape(str(out))} ({escape(result.kind)} model{step}; "
                 f"LoRA: {escape(LORA[result.lora])})")
    t = table("file", "size", title="files")
    for f in result.files:
        t.add_row(escape(f["path"]), human_bytes(f["bytes"]))
    stdout.print(t)
    if result.heldout:
        ev = result.heldout["eval"]
        stdout.print(f"held-out (run's last evaluation, step {result.heldout['step']}): "
                     f"NLL {ev['nll']:.4f} nats/token, {ev['bits_per_token']:.4f} bits/token"
                     + (f", {ev['ratio']:.4f} concepts/token" if ev.get("ratio") is not None else ""))
    if pushed:
        size = human_bytes(sum(f["bytes"] for f in pushed["files"]))
        if pushed["dry_run"]:
            t = table("file", "size", title=f"would upload to {pushed['repo']} (--dry-run: nothing uploaded)")
            for f in pushed["files"]:
                t.add_row(escape(f["path"]), human_bytes(f["bytes"]))
            stdout.print(t)
        else:
            stdout.print(f"[bold]pushed[/] {len(pushed['files'])} files ({size}) to {escape(pushed['repo'])}"
                         + (f": {escape(str(pushed['url']))}" if pushed["url"] else ""))
        if "adapter/adapter_config.json" in {f["path"] for f in pushed["files"]}:
            base = pushed["adapter_base"]
            stdout.print(f"adapter base on the hub: {escape(base)}" if base else
                         "adapter base on the hub: none (the backbone has no hub id, or is pruned): load it from the "
                         "repo's backbone subfolder (see the card)")
