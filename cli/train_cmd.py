"""``concept train``: LoRA + new modules on text, with ratio control, checkpoints and exact resume."""
from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from concept.config import DEFAULT_TARGET_RATIO

from .output import print_json, quiet_progress_bars, quiet_rank, status, stdout, table

# CLI option -> TrainConfig field (LoRA options map into config.lora)
FIELDS = {"steps": "steps", "seq_len": "seq_len", "batch": "batch", "grad_accum": "grad_accum", "lr": "lr",
          "lr_new": "lr_new", "weight_decay": "weight_decay", "warmup": "warmup", "min_lr": "min_lr", "clip": "clip",
          "target_ratio": "target_ratio", "ratio_control": "ratio_control", "ratio_loss_weight": "ratio_loss_weight",
          "pi_ki": "pi_ki", "usage_weight": "usage_weight", "data": "data",
          "text_field": "text_field", "encoding_errors": "encoding_errors", "seed": "seed",
          "eval_every": "eval_every", "eval_batches": "eval_batches", "checkpoint_every": "checkpoint_every",
          "log_every": "log_every", "grad_checkpointing": "grad_checkpointing", "baseline": "baseline",
          "device": "device", "dtype": "dtype", "tau_start": "tau_start", "tau_end": "tau_end",
          "calibration_batches": "calibration_batches", "prune_layers": "prune_layers", "ce_weight": "ce_weight",
          "distill": "distill", "distill_temperature": "distill_temperature", "align": "align", "align_at": "align_at",
          "align_loss": "align_loss", "train_only": "train_only", "ratio_start": "ratio_start",
          "ratio_warmup": "ratio_warmup", "mtp": "mtp", "mtp_ce": "mtp_ce", "mtp_heads": "mtp_heads",
          "placement": "placement", "task": "task", "context_len": "context_len", "commitment": "commitment",
          "eos_weight": "eos_weight", "quota_weight": "quota_weight", "plan_training": "plan_training",
          "estep_every": "estep_every", "beam": "beam", "plan_ce": "plan_ce", "curriculum": "curriculum",
          "plan_mtp": "plan_mtp", "estep_prior": "estep_prior"}
LORA = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_targets": "targets"}


@click.command()
@click.argument("source", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Run folder to write (default: RUN_DIR-train, or "
              "RUN_DIR-dense / RUN_DIR-pruned with --baseline).")
@click.option("--resume", is_flag=True, help="Continue the training run in RUN_DIR exactly where it stopped "
              "(a larger --steps stretches the LR and temperature schedules from there on; --data continues on "
              "other data).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out folder, once the new run has trained every "
              "step (until then, and after a failure or Ctrl-C, the old folder stays as it was).")
@click.option("--baseline", type=click.Choice(["dense", "pruned"]), is_flag=False, flag_value="dense", default=None,
              help="Train a baseline instead of the streaming model: `dense` (the default of a bare --baseline: "
              "backbone + LoRA, no compression) or `pruned` (the backbone minus a contiguous block of middle layers, "
              "FLOP-matched to the streaming model at --target-ratio and --seq-len).")
@click.option("--prune-layers", metavar="START:STOP", default=None,
              help="With --baseline pruned: skip layers START..STOP-1 (0-based) instead of the FLOP-matched block.")
@click.option("--data", type=str, default=None, help="Text file, folder, or JSONL; or Hugging Face datasets: a save_to_disk folder "
              "(DatasetDict: its train split, or PATH:SPLIT), .parquet / .arrow files "
              "(default: the Python standard library).")
@click.option("--text-field", default="text", show_default=True, help="JSONL field holding the text.")
@click.option("--encoding-errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True)
@click.option("--steps", type=int, default=300, show_default=True)
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--grad-accum", type=int, default=1, show_default=True)
@click.option("--lr", type=float, default=2e-4, show_default=True, help="Learning rate of the LoRA adapters.")
@click.option("--lr-new", type=float, default=1e-3, show_default=True, help="Learning rate of the new modules.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="AdamW weight decay (decoupled), for every trained group.")
@click.option("--warmup", type=int, default=10, show_default=True)
@click.option("--min-lr", type=float, default=0.1, show_default=True,
              help="After the warmup the cosine schedule decays to this fraction of each peak learning rate (0..1).")
@click.option("--clip", type=float, default=1.0, show_default=True)
@click.option("--target-ratio", type=float, default=DEFAULT_TARGET_RATIO, show_default=True, help="Concepts per token to aim for.")
@click.option("--ratio-control", type=click.Choice(["both", "pi", "loss", "none"]), default="both", show_default=True)
@click.option("--ratio-loss-weight", type=float, default=0.1, show_default=True)
@click.option("--pi-ki", type=float, default=0.05, show_default=True,
              help="Integral gain of the ratio controller (--ratio-control pi / both): the NULL bias moves by "
              "this times the keep log-odds spread per unit of summed ratio error (0: no integral term).")
@click.option("--usage-weight", type=float, default=0.0, show_default=True,
              help="Anti-collapse: weight of KL(mean concept distribution || uniform) in the loss.")
@click.option("--ratio-start", type=float, default=1.0, show_default=True,
              help="Ratio curriculum: the target ratio at step 0 (1 = every token a concept).")
@click.option("--ratio-warmup", type=float, default=0.0, show_default=True,
              help="Anneal the target from --ratio-start to --target-ratio over this fraction of the steps "
              "(linearly in tokens per concept), then hold it; 0 = off.")
@click.option("--ce-weight", type=float, default=1.0, show_default=True,
              help="Weight of the next-token cross entropy (0 with --distill: KL-only distillation).")
@click.option("--distill", type=float, default=0.0, show_default=True,
              help="Weight of KL(teacher || student) on the next-token distributions; the teacher is the frozen "
              "backbone (adapters disabled), one extra no-grad forward per step.")
@click.option("--distill-temperature", type=float, default=1.0, show_default=True,
              help="Softmax temperature T of the distillation (the KL is scaled by T^2).")
@click.option("--mtp", "mtp", type=float, default=1.0, show_default=True,
              help="Weight of the MTP heads' self-distillation (KL to the frozen backbone at t+1..t+k, plus CE); "
              "only for a model with MTP heads (--length-policy mtp). One extra no-grad forward per step.")
@click.option("--mtp-heads", type=int, default=0, show_default=True,
              help="Baselines: K MTP heads on the dense / pruned model's last hidden state, for multi-token "
              "decoding (the streaming model's come with --length-policy mtp).")
@click.option("--mtp-ce", type=float, default=0.5, show_default=True,
              help="Weight of the CE on the real tokens inside the MTP objective, relative to its KL.")
@click.option("--placement", type=float, default=0.0, show_default=True,
              help="Learned placement: weight of a BCE that trains the `null` policy's keep score to emit concepts "
              "where skipping the middle stack costs most (KL of the frozen backbone to this model without its "
              "middle stack); one teacher forward and one shallow+deep forward per step, no gradient.")
@click.option("--task", type=click.Choice(["reconstruct", "continue"]), default=None,
              help="Planner-executor runs: reconstruct (default: the executor rebuilds the row u from the plan "
              "alone) or continue (u = the first --context-len tokens, the executor writes the rest from the plan).")
@click.option("--context-len", type=int, default=0, show_default=True,
              help="Planner-executor, --task continue: tokens of each row the planner reads (u).")
@click.option("--commitment", type=float, default=0.1, show_default=True,
              help="Planner-executor: weight of the commitment term (the soft and hard concept samples agree).")
@click.option("--eos-weight", type=float, default=0.1, show_default=True,
              help="Planner-executor: weight of the <EOS> loss where a type reached its max_len.")
@click.option("--quota-weight", type=float, default=0.1, show_default=True,
              help="Planner-executor: weight of the quota loss (expected plan length against the budget).")
@click.option("--plan-training", type=click.Choice(["gumbel", "hard-em"]), default="gumbel", show_default=True,
              help="Planner-executor: gumbel (a plan sampled with Gumbel-ST in every step) or hard-em (the best of a "
              "beam of plans per example, cached and refreshed every --estep-every steps; docs/planner_executor.md).")
@click.option("--estep-every", type=int, default=50, show_default=True,
              help="Hard-EM: search an example's plan again once its cached plan is this many steps old.")
@click.option("--beam", type=int, default=4, show_default=True, help="Hard-EM: the E-step's beam width k.")
@click.option("--estep-prior", type=float, default=1.0, show_default=True,
              help="Hard-EM: β in the E-step's score S(z) = log p(y|z) + β log p(z|u) (1: the posterior mode; 0: the "
              "beam's plan that best explains y).")
@click.option("--plan-ce", type=float, default=1.0, show_default=True,
              help="Hard-EM: weight of the planner's cross-entropy on the best plan z*.")
@click.option("--plan-mtp", type=float, default=1.0, show_default=True,
              help="Planner-executor built with MTP concepts (--set planner.mtp=K): weight of the MTP heads' CE.")
@click.option("--curriculum", default=None, metavar="START:FRACTION",
              help="Short-to-long: rows grow linearly from START tokens to --seq-len over FRACTION of the steps "
              "(--context-len grows in proportion), e.g. 64:0.5.")
@click.option("--align", type=float, default=0.0, show_default=True,
              help="Weight of the hidden-state alignment to the frozen backbone (see --align-at, --align-loss).")
@click.option("--align-at", type=click.Choice(["deep-input", "final"]), default="deep-input", show_default=True,
              help="deep-input: the deep stack's input at tail tokens vs the backbone's input of that layer; "
              "final: the last layer's output (before the final norm) at every token.")
@click.option("--align-loss", type=click.Choice(["cosine", "mse"]), default="cosine", show_default=True,
              help="cosine: 1 - cos per token; mse: squared error / the teacher states' mean square (dominated "
              "by a few tokens with massive activations on SmolLM2; docs/training.md).")
@click.option("--train-only", type=click.Choice(["all", "new"]), default="all", show_default=True,
              help="new: train only the new modules (the LoRA adapters stay frozen), e.g. a first stage that "
              "fits a tail bridge with --align.")
@click.option("--calibration-batches", type=int, default=16, show_default=True,
              help="At the end, re-estimate the NULL bias for the target ratio on this many training batches (0: off).")
@click.option("--tau-start", type=float, default=1.0, show_default=True, help="Gumbel temperature at step 0.")
@click.option("--tau-end", type=float, default=0.5, show_default=True, help="Gumbel temperature at the last step.")
@click.option("--lora-rank", type=int, default=8, show_default=True)
@click.option("--lora-alpha", type=float, default=16.0, show_default=True)
@click.option("--lora-dropout", type=float, default=0.0, show_default=True,
              help="Dropout on the LoRA adapters' input while training, in [0, 1).")
@click.option("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=int, default=50, show_default=True)
@click.option("--eval-batches", type=int, default=4, show_default=True)
@click.option("--checkpoint-every", type=int, default=50, show_default=True)
@click.option("--log-every", type=int, default=10, show_default=True)
@click.option("--grad-checkpointing", is_flag=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="Compute precision: bf16 autocast (weights and optimizer state stay fp32) with bf16, or with "
                   "auto on CUDA; fp32 otherwise.")
@click.option("--distributed", type=click.Choice(["auto", "ddp", "fsdp2", "none"]), default="auto", show_default=True,
              help="Under torchrun: ddp (auto's choice; gloo on CPU, nccl on GPU) or fsdp2 (parameters sharded). "
              "--batch is per process: the global batch is batch x processes x grad-accum. See docs/distributed.md.")
@click.option("--json", "as_json", is_flag=True, help="Print the final evaluation as JSON.")
@click.pass_context
def train(ctx, source: Path, out, resume, force, as_json, distributed, **options) -> None:
    """Train a built model (or the dense baseline) on text.

    \b
    concept train runs/m1 --steps 300 --seq-len 256 --batch 8 --target-ratio 0.125 --out runs/m1-train
    concept train runs/m1-train --resume --steps 600
    concept train runs/m1 --baseline --out runs/dense
    concept train runs/m1 --baseline pruned --distill 1 --out runs/pruned
    concept train runs/m1 --distill 1 --ratio-warmup 0.3 --out runs/m1-kd
    concept train runs/pe --task continue --context-len 192 --out runs/pe-cont
    """
    from concept.distributed import setup, teardown

    dist = setup(distributed, options["device"])
    if not dist.is_main:  # one voice: rank 0 reports, the other ranks only fail loudly
        quiet_rank()
    try:
        _train(ctx, source, out, resume, force, as_json, dist, options)
    finally:
        teardown(dist)


def _train(ctx, source: Path, out, resume, force, as_json, dist, options) -> None:
    from concept.lora import LoraSettings
    from concept.training import TrainConfig, Trainer

    quiet_progress_bars()
    given = {k for k in options if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if resume and out is not None and Path(out).resolve() != source.resolve():
        raise click.UsageError("--resume continues RUN_DIR in place; drop --out (or start a new run without --resume)")
    if resume:
        overrides = {FIELDS[k]: options[k] for k in given if k in FIELDS}
        overrides.update({f"lora.{LORA[k]}": options[k] for k in given if k in LORA})
        if "baseline" in overrides and overrides["baseline"] is None:
            overrides.pop("baseline")
        Trainer.resumed_config(source, dist.world_size, overrides)  # a conflict is an error even with nothing to train
        done = already_done(source, overrides.get("steps"))
        if done is not None:  # nothing to train: say so and leave the run folder untouched
            step, steps = done
            more = step + max(10, step // 2)
            asked = (f"--steps {steps} is not beyond it" if "steps" in overrides
                     else f"the end of its --steps {steps}")
            message = (f"{source} is already at step {step} ({asked}); nothing to train. To train further, "
                       f"pass a larger --steps, e.g. `concept train {source} --resume --steps {more}`")
            status("nothing to do:", message)
            if as_json:
                print_json({"path": str(source), "step": step, "steps": steps, "trained": False, "message": message})
            return
        status("resuming", f"{source} ...")
        trainer = Trainer.resume(source, dist=dist, **overrides)
        out = source
    else:
        config = TrainConfig(**{FIELDS[k]: v for k, v in options.items() if k in FIELDS},
                             lora=LoraSettings(**{LORA[k]: v for k, v in options.items() if k in LORA}))
        out = out or source.with_name(source.name + (f"-{config.baseline}" if config.baseline else "-train"))
        status("preparing", f"{f'{config.baseline} baseline' if config.baseline else 'concept model'} from {source} -> {out} ...")
        trainer = Trainer.start(source, out, config, force=force, dist=dist)
    cfg = trainer.config
    for note in trainer.notes:
        status("note:", note)
    noted = len(trainer.notes)
    accum = f"x{cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    status("training", f"steps {trainer.step}->{cfg.steps}, {cfg.batch}{accum}x{cfg.seq_len} tokens/step, "
                       f"{trainer.train_data.num_tokens:,} training tokens, device {trainer.device}"
                       f"{f', attention auto -> {trainer.attention}' if trainer.attention else ''}"
                       f"{f', {dist.describe()}, global batch {trainer.global_batch}' if dist.active else ''}")
    replacing = trainer.staging is not None
    try:
        final = run_with_progress(trainer) if dist.is_main else trainer.train()
    except KeyboardInterrupt:
        from concept.checkpoint import read_meta

        if replacing:
            status("interrupted", f"at step {trainer.step}; {out} is unchanged (--force replaces it only once "
                                  f"training finishes) and the new run was discarded")
            raise SystemExit(130)
        meta = read_meta(out)
        saved = f"last checkpoint: step {meta['step']}" if meta else "no checkpoint was written"
        status("interrupted", f"at step {trainer.step}; {saved}. Continue with: concept train {out} --resume")
        raise SystemExit(130)
    for note in trainer.notes[noted:]:  # e.g. a ratio target the policy could not reach
        status("note:", note)
    status("done", f"{out} (metrics.jsonl, curves.png, checkpoint/)")
    if as_json:
        print_json({"path": str(out), "step": trainer.step, "eval": final})
    elif not final:
        status("note:", f"no held-out evaluation; run `concept eval {out} --data HELD_OUT`")
    else:
        t = table("held-out", "value", title=f"{out} at step {trainer.step}")
        for k, v in final.items():
            if not isinstance(v, dict):
                t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
        stdout.print(t)


def already_done(run: Path, steps: int | None) -> tuple[int, int] | None:
    """(step reached, steps asked for) when ``--resume`` has nothing to train: the last checkpoint is
    at or beyond ``steps`` (default: the saved run's). Reads only; anything else (no train.json, no
    checkpoint, an invalid --steps) is left to ``Trainer.resume`` and its errors."""
    from concept.builder import read_train
    from concept.checkpoint import read_meta

    saved = read_train(run) if run.is_dir() else None
    meta = read_meta(run) if saved is not None else None
    if meta is None:
        return None
    steps = saved.get("steps") if steps is None else steps
    if not isinstance(steps, int) or steps < 1 or steps > meta["step"]:
        return None
    return meta["step"], steps


def run_with_progress(trainer) -> dict:
    """Train with a rich progress bar on stderr: step, loss, ratio, tokens/s, ETA."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    cfg = trainer.config
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("train", total=cfg.steps, completed=trainer.step, info="")

        def update(row: dict) -> None:
            info = f"loss {row['loss']:.3f}"
            if "distill_kl" in row:
                info += f"  kd {row['distill_kl']:.3f}"
            if "align" in row:
                info += f"  align {row['align']:.3f}"
            if "mtp" in row:
                info += f"  mtp {row['mtp']:.3f}"
            if "placement" in row:
                info += f"  place {row['placement']:.3f}"
            if "plan_len" in row:
                info += f"  plan {row['plan_len']:.1f}"
            if "ratio" in row:
                info += f"  ratio {row['ratio']:.3f}"
                if row.get("target_ratio") is not None and row["target_ratio"] != cfg.target_ratio:
                    info += f" (target {row['target_ratio']:.3f})"
            info += f"  {row['tokens_per_s']:.0f} tok/s"
            if row.get("eval"):
                info += f"  held-out {row['eval']['nll']:.3f}"
            progress.update(task, completed=row["step"], info=info)

        return trainer.train(progress=update)
