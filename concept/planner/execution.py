"""The executor of the planner-executor: the text y written from the plan alone, the plan (a
``concept.planner.model.Plan``) read as a block ``[<SEP_1>, C_1, ..., <SEP_n>, C_n]`` before y. A mixin of
:class:`concept.planner.model.PlannerExecutorModel`, which holds the modules it reads."""
from __future__ import annotations

import torch

from ..attention import CausalPattern


class Execution:
    def plan_block(self, plan, embeds: torch.Tensor | None = None):
        """The executor's plan block ``[<SEP_1>, C_1, ..., <SEP_n>, C_n]`` of each row, right-aligned:
        (x [B, S, d], valid [B, S], positions [B, S]). A step's concept keeps its embedding (``embeds``,
        default the plan's own, else the hard ones); an <EOS_t> becomes <SEP_t+1>; the last <EOS> is dropped."""
        B, S = plan.classes.shape
        dev = plan.classes.device
        if embeds is None:
            embeds = plan.embeds if plan.embeds is not None else self.step_embedding(plan.classes, plan.types,
                                                                                     rank=plan.rank)[0]
        types = plan.types.clamp(min=0)
        sep_type = torch.where(plan.is_eos, types + 1, types).clamp(max=self.num_types - 1)
        sep = self.positions.add_types(self.specials.sep(sep_type), sep_type + 1).to(embeds.dtype)
        step_x = torch.where(plan.is_eos[..., None], sep, embeds)  # (a step's own embedding carries its type)
        first = self.positions.add_types(self.specials.sep(torch.zeros(B, 1, dtype=torch.long, device=dev)),
                                         torch.ones(B, 1, dtype=torch.long, device=dev)).to(embeds.dtype)
        x = torch.cat([first, step_x[:, :-1]], dim=1)  # slot j holds step j-1
        pos = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), plan.rank[:, :-1]], dim=1)
        lengths = plan.active.sum(1)  # slots per row: <SEP_1> + every step but the last <EOS>
        shift = S - lengths  # right-align: slot j of the row goes to column j + shift
        col = torch.arange(S, device=dev)[None, :] - shift[:, None]
        valid = col >= 0
        src = col.clamp(min=0)
        x = x.gather(1, src[..., None].expand(-1, -1, x.shape[-1]))
        pos = pos.gather(1, src).masked_fill(~valid, 0)
        return x, valid, pos

    def executor(self, plan, y_ids, y_valid, embeds=None, cache=None, logits_to_keep: int = 0):
        """Text logits [B, Ty, V] of ``y`` given the plan alone (logits[:, k] predicts y_k)."""
        return self.text_logits(self.executor_states(plan, y_ids, y_valid, embeds, cache, logits_to_keep))

    def executor_states(self, plan, y_ids, y_valid, embeds=None, cache=None, logits_to_keep: int = 0):
        """The executor's last-layer states [B, Ty, d] whose LM-head logits are :meth:`executor`'s."""
        bx, bvalid, bpos = self.plan_block(plan, embeds)
        x = torch.cat([bx, self.embed_text(y_ids)], dim=1)  # (joined in ``run``: the stream's dtype)
        valid = torch.cat([bvalid, y_valid], dim=1)
        ypos = torch.cumsum(y_valid.long(), 1) * y_valid  # y_k at k + 1 (padding: 0)
        pos = torch.cat([bpos, ypos], dim=1)
        h = self.run(x, pos, CausalPattern(valid, causal=False), cache)  # (the mask built without looking: no sync)
        S = bx.shape[1]
        return h[:, S - 1: -1] if logits_to_keep == 0 else h[:, -logits_to_keep:]
