"""The dense baseline equals the Hugging Face forward; LoRA starts as the identity and only adapters train."""
import torch

import concept
from concept.dense import DenseModel
from concept.lora import LoraSettings, add_lora, lora_state_dict
from tests.conftest import tiny_config


def test_dense_model_equals_hf_forward_with_padding_and_documents():
    model = concept.build(tiny_config())
    dense = DenseModel(model.backbone)
    ids = torch.randint(0, 97, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, 10:] = 0
    with torch.no_grad():
        ours = dense(ids, attention_mask=mask).logits
        hf = model.backbone(ids, attention_mask=mask).logits
        torch.testing.assert_close(ours[mask.bool()], hf[mask.bool()], atol=1e-5, rtol=0)
        # two packed documents equal two separate calls
        doc = torch.tensor([[0] * 6 + [1] * 8])
        packed = dense(ids[:1], document_ids=doc).logits
        torch.testing.assert_close(packed[:, :6], model.backbone(ids[:1, :6]).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[:, 6:], model.backbone(ids[:1, 6:]).logits, atol=1e-5, rtol=0)


def test_lora_starts_as_identity_and_only_adapters_train():
    model = concept.build(tiny_config())
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
    add_lora(model.backbone, LoraSettings(rank=4, targets="q_proj,v_proj,down_proj"))
    with torch.no_grad():
        after = model(ids).logits  # LoRA B is zero-initialised: the model is unchanged
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    trainable = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(lora_state_dict(model.backbone)) == 6 * 3 * 2  # layers x targets x (A, B)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = concept.build(tiny_config(attention="chunked"))
    add_lora(model.backbone, LoraSettings(rank=2))
    model.train()
    ids = torch.randint(0, 97, (2, 16))

    def grads(checkpointing):
        model.gradient_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # same Gumbel noise
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert plain and set(plain) == set(recomputed)
    for name in plain:
        torch.testing.assert_close(plain[name], recomputed[name], msg=name)
