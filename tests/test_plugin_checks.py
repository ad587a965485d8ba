"""Entry points that are not components (issue 43): an int, a module, a class of the wrong kind, a package
whose import calls ``sys.exit``. ``plugins list --check`` reports each as broken (it said "ok", then ``build``
raised ``TypeError``; a ``sys.exit(3)`` made both exit 3 silently), with the problem and the fix, and the
commands that do not use them keep working. The distribution is laid out on ``sys.path`` as pip leaves one."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from concept_cli.main import cli

PACKAGE = '''
import torch

NUMBER = 3


class NotAModule:
    pass


class Policy(torch.nn.Module):
    pass


class HalfAFamily:
    name = "half"

    def build(self, plan, loaded):
        return None


from concept.contracts import LengthPolicy


class NoStep(LengthPolicy, torch.nn.Module):  # derives from its base, and lacks a member it requires
    def decide(self, h, head_logits, valid, reset=None):
        return valid

    def init_state(self, batch_size, device):
        return None
'''
ENTRY_POINTS = """[concept.length_policies]
an-int = odd_plugin:NUMBER
a-module = odd_plugin
not-a-module = odd_plugin:NotAModule
plain-module = odd_plugin:Policy
no-step = odd_plugin:NoStep
exits = odd_plugin_exit:Policy

[concept.families]
half = odd_plugin:HalfAFamily
"""


@pytest.fixture()
def odd_plugins(tmp_path, monkeypatch):
    (tmp_path / "odd_plugin.py").write_text(PACKAGE)
    (tmp_path / "odd_plugin_exit.py").write_text("import sys\nsys.exit(3)\n")
    info = tmp_path / "odd_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: odd-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from concept import families, registry

    monkeypatch.setattr(registry, "_REGISTRIES", {})
    monkeypatch.setattr(families, "_INSTANCES", {})
    yield tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


def test_check_reports_every_entry_point_that_is_not_a_component(odd_plugins):
    r = invoke("plugins", "list", "--check", "--json")
    assert r.exit_code == 1 and not isinstance(r.exception, (TypeError, AttributeError)), r.output
    rows = {(row["kind"], row["name"]): row for row in json.loads(r.stdout)}
    expected = {("length_policy", "an-int"): "is int 3, not a class",
                ("length_policy", "a-module"): "is the module odd_plugin, not a class",
                ("length_policy", "not-a-module"): "is the class NotAModule, not a torch.nn.Module",
                ("length_policy", "exits"): "failed to import: SystemExit: 3",
                ("length_policy", "plain-module"): "does not derive from concept.contracts.LengthPolicy (every "
                                                   "length policy does: from concept.contracts import LengthPolicy; "
                                                   "class Policy(LengthPolicy, torch.nn.Module))",
                ("length_policy", "no-step"): "does not define step (required by concept.contracts.LengthPolicy)",
                ("family", "half"): "does not derive from concept.contracts.Family"}
    for key, problem in expected.items():
        row = rows[key]
        assert row["status"] == "error" and problem in row["detail"], row
        assert "odd-plugin" in row["detail"] and "\n" not in row["detail"], row  # the package to fix, one line
    assert all(row["status"] == "ok" for key, row in rows.items() if key not in expected)
    assert "7 of" in r.stderr and "broken" in r.stderr


@pytest.mark.parametrize("policy, problem", [("an-int", "not a class"), ("a-module", "not a class"),
                                             ("not-a-module", "not a torch.nn.Module"),
                                             ("exits", "SystemExit: 3")])
def test_build_names_the_broken_plugin_and_other_builds_still_work(odd_plugins, tmp_path, policy, problem):
    tiny = ["--backbone", "tiny-llama", "--split", "1,2,1", "--set", "backbone.layers=4", "--set",
            "backbone.hidden=32", "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--no-calibrate"]
    r = invoke("build", *tiny, "--length-policy", policy, "-o", tmp_path / "b")
    assert r.exit_code == 1 and problem in r.stderr and "odd-plugin" in r.stderr, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit) and r.exception.code == 1
    assert not (tmp_path / "b").exists()
    r = invoke("build", *tiny, "-o", tmp_path / "fine")  # the broken entry points break nothing else
    assert r.exit_code == 0, r.output


def test_the_kind_check_accepts_the_classes_of_the_kind_only():
    from concept import registry

    assert registry.kind_problem("length_policy", 3) == "is int 3, not a class"
    assert registry.kind_problem("length_policy", registry.Registry) is not None  # a class, not a module
    import torch

    assert "does not derive from concept.contracts.LengthPolicy" in registry.kind_problem("length_policy",
                                                                                           torch.nn.Linear)
    from concept.contracts import Backbone, Family
    from concept_plugins.length_policies.null import NullPolicy

    assert registry.kind_problem("length_policy", NullPolicy) is None
    assert registry.kind_problem("backbone", registry.Registry) is not None  # backbones derive from Backbone

    class Described(Backbone):
        @classmethod
        def describe(cls, config):
            return None

    assert registry.kind_problem("backbone", Described) == ("is the class test_the_kind_check_accepts_the_classes_of_"
                                                            "the_kind_only.<locals>.Described, which does not define "
                                                            "load (required by concept.contracts.Backbone)")

    class Minimal(Family):
        name = "minimal"

        def build(self, plan, loaded):
            return None

    assert registry.kind_problem("family", Minimal) is None
    assert "does not define build" in registry.kind_problem("family", type("Unbuilt", (Family,), {"name": "u"}))
