"""Extensions from installed packages: the entry point groups are read when a name is not registered yet."""

from importlib.metadata import EntryPoint

import pytest

import sparsegen.plugins
from sparsegen.contextual.runtime import CONTEXTUAL_METHODS, contextual_method
from sparsegen.contextual.teal import Teal
from sparsegen.kv import POLICIES, make_policy
from sparsegen.kv.policies.window import Window
from sparsegen.models import FAMILIES, Family
from sparsegen.models.families import family
from sparsegen.pruning.methods import PRUNING_METHODS, Magnitude, pruning_method


class InstalledPolicy(Window):  # what a package would offer: not registered until it is asked for by name
    name = "installed-window"


class InstalledPruning(Magnitude):
    name = "installed-magnitude"


class InstalledContextual(Teal):
    name = "installed-teal"


INSTALLED_FAMILY = Family("installed-llama", separate_heads=True)


def test_entry_points_register_a_policy_a_pruning_method_a_contextual_method_and_a_family(monkeypatch):
    points = {group: [EntryPoint(name, f"tests.test_plugins:{target}", group)] for group, name, target in (
        ("sparsegen.policies", "installed-window", "InstalledPolicy"),
        ("sparsegen.pruning_methods", "installed-magnitude", "InstalledPruning"),
        ("sparsegen.contextual_methods", "installed-teal", "InstalledContextual"),
        ("sparsegen.families", "installed-llama", "INSTALLED_FAMILY"))}
    monkeypatch.setattr(sparsegen.plugins, "entry_points", lambda group: points.get(group, []))
    for registry, name in ((POLICIES, "installed-window"), (PRUNING_METHODS, "installed-magnitude"),
                           (CONTEXTUAL_METHODS, "installed-teal"), (FAMILIES, "installed-llama")):
        assert name not in registry
        monkeypatch.setitem(registry, name, None)  # (taken out again after the test: the registries are global)
        registry.pop(name)
    assert make_policy("installed-window", 8).budget == 8 and POLICIES["installed-window"] is InstalledPolicy
    assert isinstance(pruning_method("installed-magnitude"), InstalledPruning)
    assert isinstance(contextual_method("installed-teal"), InstalledContextual)
    assert family("installed-llama") is INSTALLED_FAMILY
    with pytest.raises(ValueError, match="unknown contextual method 'nowhere'; choose one of dejavu, teal"):
        contextual_method("nowhere")
    with pytest.raises(ValueError, match="unknown policy 'nowhere'"):
        make_policy("nowhere", 8)
