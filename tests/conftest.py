import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef


def tiny_config(backbone="tiny-llama", attention="sdpa", positions="time", split="2,2,2", vocab=32,
                policy=("null", {"max_run": 3}), **extra):
    cfg = BuildConfig(
        backbone=ComponentRef(backbone, {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 97}),
        split=split,
        attention=ComponentRef(attention, {"chunk": 4} if attention == "chunked" else {}),
        position_scheme=ComponentRef(positions),
        vocabulary=ComponentRef("embedding", {"size": vocab}),
        length_policy=ComponentRef(*policy),
        **extra,
    )
    return cfg


def randomize_new_modules(model, seed=0):
    """New modules start near-trivial (zero type embeddings); perturb them so the tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.new_state_dict().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = randomize_new_modules(concept.build(tiny_config(**kw)))
        return cache[key]

    return get
