"""The shape of the module a rollout run trains: a few dozen methods through the package's
bases (the learner, the family and the member schedule hold the rest), no member branches, and
no population code among its bases."""

from __future__ import annotations

import ast
import inspect

import pytest

from rlhf_lightning.algorithms import ALGORITHMS, RolloutModule
from tests.conftest import ROOT

MAX_METHODS = 40


def package_methods(cls: type) -> set[str]:
    """Methods and properties defined by the package's classes in ``cls``'s MRO (Lightning's
    own are not counted; a name overridden down the line counts once)."""
    names = set()
    for c in cls.__mro__:
        if not c.__module__.startswith("rlhf_lightning"):
            continue
        for name, v in vars(c).items():
            if isinstance(v, property | staticmethod | classmethod) or inspect.isfunction(v):
                names.add(name)
    return names


@pytest.mark.parametrize(
    "name", sorted(n for n, s in ALGORITHMS.items() if issubclass(s.module_cls, RolloutModule))
)
def test_a_rollout_module_has_at_most_40_methods_through_its_package_bases(name):
    cls = ALGORITHMS[name].module_cls
    found = package_methods(cls)
    assert len(found) <= MAX_METHODS, sorted(found)
    bases = [c.__module__ for c in cls.__mro__]
    assert not any(m.startswith("rlhf_lightning.population") for m in bases), bases


def test_the_count_sees_methods_properties_and_overrides():
    class Base:
        def a(self): ...

        @property
        def b(self): ...

    class Child(Base):
        def a(self): ...

        @staticmethod
        def c(): ...

    Base.__module__ = Child.__module__ = "rlhf_lightning.fake"
    assert package_methods(Child) == {"a", "b", "c"}


def member_branches(tree: ast.AST) -> list[str]:
    """Every read of ``self.members`` (the population's bank on the module, as it was)."""
    return [
        f"line {n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "members"
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]


def test_no_module_of_an_algorithm_branches_on_members():
    bad = {}
    for path in sorted((ROOT / "rlhf_lightning" / "algorithms").glob("*.py")):
        found = member_branches(ast.parse(path.read_text()))
        if found:
            bad[path.name] = found
    assert not bad, bad
    assert member_branches(ast.parse("if self.members is not None:\n    pass\n")) == ["line 1"]
