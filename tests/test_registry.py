"""Registry: lazy listing, loud lookups, conflicts and import failures (with fake entry points)."""
import sys
from importlib.metadata import EntryPoint

import pytest

from concept import registry as reg_mod
from concept.errors import PluginConflictError, PluginImportError, UnknownComponentError


def test_listing_imports_nothing(monkeypatch):
    for mod in [m for m in sys.modules if m.startswith("concept_plugins.")]:
        monkeypatch.delitem(sys.modules, mod)  # put back afterwards: later tests in this process keep one copy
    r = reg_mod.Registry("attention")
    assert {"sdpa", "chunked"} <= set(r.names())
    assert not [m for m in sys.modules if m.startswith("concept_plugins.attention.")]
    assert r.provider("sdpa").label == "builtin"


def test_unknown_name_suggests():
    with pytest.raises(UnknownComponentError) as info:
        reg_mod.Registry("length_policy").get("nul")
    assert "Did you mean 'null'" in str(info.value) and "Available: " in str(info.value)


class FakeDist:
    def __init__(self, name, version):
        self.metadata = {"Name": name}
        self.version = version


def fake_eps(monkeypatch, eps):
    monkeypatch.setattr(reg_mod, "entry_points", lambda group: [e for e in eps if e.group == group])


def ep(name, value, dist):
    e = EntryPoint(name=name, value=value, group="concept.samplers")
    return e._for(dist) if hasattr(e, "_for") else e


def test_conflict_names_both_distributions(monkeypatch):
    fake_eps(monkeypatch, [ep("argmax", "a.b:C", FakeDist("pkg-one", "1.0")), ep("argmax", "x.y:Z", FakeDist("pkg-two", "2.0"))])
    with pytest.raises(PluginConflictError) as info:
        reg_mod.Registry("sampler").get("argmax")
    assert "pkg-one==1.0" in str(info.value) and "pkg-two==2.0" in str(info.value)


def test_import_failure_names_plugin_dist_version(monkeypatch):
    fake_eps(monkeypatch, [ep("ghost", "no_such_module_xyz:Thing", FakeDist("ghost-plugin", "0.3"))])
    r = reg_mod.Registry("sampler")
    with pytest.raises(PluginImportError) as info:
        r.get("ghost")
    msg = str(info.value)
    assert "'ghost'" in msg and "ghost-plugin==0.3" in msg and "ModuleNotFoundError" in msg


def test_check_all_reports_builtins_ok():
    results = reg_mod.check_all()
    assert results and all(r.status == "ok" for r in results if r.provider == "builtin")
