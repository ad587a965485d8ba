"""The language-modelling loss every model of the library is trained and evaluated with."""
from __future__ import annotations

import torch.nn.functional as F

from .components import upcast


def next_token_loss(logits, labels, valid, document_ids=None, reduction="mean"):
    """CE of predicting labels[t+1] from position t, over pairs of real tokens of the same
    document (labels equal to -100 are ignored)."""
    pair = valid[:, 1:] & valid[:, :-1]
    if document_ids is not None:
        pair = pair & (document_ids[:, 1:] == document_ids[:, :-1])
    target = labels[:, 1:].masked_fill(~pair, -100)
    loss = F.cross_entropy(upcast(logits[:, :-1].flatten(0, 1)), target.flatten(), ignore_index=-100,
                           reduction=reduction)
    return loss if reduction == "mean" else loss.view(target.shape)
