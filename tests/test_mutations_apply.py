"""The mutation suite (``tests/mutate.py``) can only catch what it can still apply: each mutation's text must
occur exactly once in its file, or the mutation silently stops testing anything once the code moves."""
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("concept_mutations", Path(__file__).resolve().parent / "mutate.py")
mutate = sys.modules["concept_mutations"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up)
_spec.loader.exec_module(mutate)


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name[:60])
def test_each_mutation_still_applies(mutation):
    source = (mutate.REPO / mutation.file).read_text()
    assert source.count(mutation.old) == 1, (
        f"{mutation.name}: its text occurs {source.count(mutation.old)} times in {mutation.file}; "
        f"update tests/mutate.py to the code as it is now")


def test_a_moved_text_is_caught():  # negative control: a text that is not in the file
    source = (mutate.REPO / "concept/training.py").read_text()
    assert source.count("        store_frozen_base(model, self.dtype)  # bf16: cast once here\n") == 0
