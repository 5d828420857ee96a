"""Nothing in ``population/`` writes into the module: a population's state lives in its own
schedule (the ``Member`` records the module learns with, the adapters' copies), so the module's
attributes change only in the module."""

from __future__ import annotations

import ast

from tests.conftest import ROOT


def writes_into_a_module(tree: ast.AST) -> list[str]:
    """``x.module.attr = ...``, ``module.attr = ...``, ``pl_module.attr = ...`` (also augmented),
    and ``setattr(<module>, ...)``."""
    found = []

    def is_module(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("module", "pl_module")) or (
            isinstance(node, ast.Attribute) and node.attr == "module"
        )

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and is_module(t.value):
                found.append(f"line {t.lineno}: {ast.unparse(t)} = ...")
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
        if call and node.args and is_module(node.args[0]):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_population_never_assigns_a_module_attribute():
    bad = {}
    for path in sorted((ROOT / "rlhf_lightning" / "population").glob("*.py")):
        found = writes_into_a_module(ast.parse(path.read_text()))
        if found:
            bad[path.name] = found
    assert not bad, bad


def test_the_check_sees_each_form():
    code = "self.module.hp = 1\nmodule.sampling = 2\nsetattr(self.module, 'x', 3)\npl_module.n += 1\n"
    assert len(writes_into_a_module(ast.parse(code))) == 4
