"""The configuration reference page: every field of every schema with its default, the comments
read from the source, the options of every config group, and the committed page up to date."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

from rlhf_lightning.config import algo as algo_config_module
from rlhf_lightning.config import distill as distill_config_module
from rlhf_lightning.config import schemas as config_module
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "gen_config_reference", ROOT / "scripts" / "gen_config_reference.py"
)
gen = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gen  # its dataclasses look their module up
spec.loader.exec_module(gen)

CELL_SPLIT = re.compile(r"(?<!\\)\|")


def schema_classes() -> dict[str, type]:
    """Every dataclass defined in rlhf_lightning/config/schemas.py, config/algo.py and
    config/distill.py, found by introspection."""
    modules = (config_module, algo_config_module, distill_config_module)
    return {
        name: obj
        for module in modules
        for name, obj in inspect.getmembers(module, inspect.isclass)
        if dataclasses.is_dataclass(obj) and obj.__module__ in {m.__name__ for m in modules}
    }


def unescape(cell: str) -> str:
    """A description cell back to plain text (the page escapes pipes, emphasis marks and HTML)."""
    return html.unescape(re.sub(r"\\([\\|*_])", r"\1", cell.strip()))


def tables(page: str) -> dict[str, dict[str, list[str]]]:
    """``## Class`` heading -> {field: [type, default, description]} from the page's tables."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in page.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            out[section] = {}
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in CELL_SPLIT.split(line.strip())[1:-1]]
            assert len(cells) == 4, f"a row of {section} does not have 4 cells: {line}"
            out[section][cells[0].strip("`")] = cells[1:]
    return out


def owner(cls: type, name: str) -> str:
    """The most derived class of ``cls``'s MRO whose body declares the field (adds or overrides it)."""
    return next(c.__name__ for c in cls.__mro__ if name in inspect.get_annotations(c))


@pytest.fixture(scope="module")
def page() -> str:
    return gen.render()


def test_every_field_of_every_schema_is_on_the_page_with_its_default(page):
    found = tables(page)
    classes = schema_classes()
    # The families the task names, the top level and the nested group schemas are all there.
    for name in (
        "Config",
        "GRPOConfig",
        "PPOConfig",
        "SFTConfig",
        "DPOConfig",
        "ModelConfig",
        "LoraSettings",
    ):
        assert name in classes and name in found, name
    assert set(found) == set(classes)
    for cls_name, cls in classes.items():
        for f in dataclasses.fields(cls):
            section = found[owner(cls, f.name)]
            assert f.name in section, f"{cls_name}.{f.name} missing from ## {owner(cls, f.name)}"
            default_cell = section[f.name][1]
            if f.default is not dataclasses.MISSING:
                expected = f.default
            else:
                expected = f.default_factory()  # type: ignore[misc]
            if dataclasses.is_dataclass(expected):
                assert f"(#{type(expected).__name__.lower()})" in default_cell, (cls_name, f.name)
            elif expected == "???":  # omegaconf.MISSING: required
                assert default_cell == "`???`", (cls_name, f.name, default_cell)
            else:
                assert json.loads(unescape(default_cell.strip("`"))) == expected, (cls_name, f.name)


def test_field_comments_are_read_from_the_source(page):
    found = tables(page)
    source = [
        line
        for name in ("config/schemas.py", "config/algo.py")
        for line in (ROOT / "rlhf_lightning" / name).read_text().splitlines()
    ]
    # A trailing comment: the text after '#' on the kl_mode line, read here independently.
    kl_line = next(line for line in source if line.strip().startswith("kl_mode:"))
    assert unescape(found["RolloutAlgoConfig"]["kl_mode"][2]) == kl_line.split("#", 1)[1].strip()
    assert "loss | reward" in unescape(found["RolloutAlgoConfig"]["kl_mode"][2])
    # Comment lines directly above a field, then its trailing comment.
    row = next(i for i, line in enumerate(source) if line.strip().startswith("micro_batch_size:"))
    above = source[row - 1].strip().lstrip("#").strip()
    assert unescape(found["OptimConfig"]["micro_batch_size"][2]) == above
    row = next(i for i, line in enumerate(source) if line.strip().startswith("quantization:"))
    expected = source[row - 1].strip().lstrip("#").strip() + " " + source[row].split("#", 1)[1].strip()
    assert unescape(found["ModelConfig"]["quantization"][2]) == expected
    # A comment inside a parenthesised default that spans lines.
    assert "a Jinja template or a .jinja file's path" in unescape(found["ModelConfig"]["chat_template"][2])
    # A field without any comment has an empty description.
    assert found["LoraSettings"]["r"][2] == ""


def test_class_docstrings_introduce_their_tables(page):
    for cls in (config_module.GRPOConfig, config_module.PPOConfig, config_module.StrategyConfig):
        first = " ".join(inspect.getdoc(cls).split("\n\n")[0].split())
        section = page.split(f"\n## {cls.__name__}\n", 1)[1].split("\n## ", 1)[0]
        assert first in " ".join(section.split()), cls.__name__


def test_every_option_of_every_schema_group_is_listed(page):
    groups = ("algo", "model", "env", "rollout", "reward", "strategy", "logger", "trainer")
    for group in groups:
        for path in (ROOT / "conf" / group).glob("*.yaml"):
            assert f"`{group}={path.stem}`" in page, f"{group}={path.stem}"
    grpo = page.split("\n## GRPOConfig\n", 1)[1].split("\n## ", 1)[0]
    assert "`algo=cispo`" in grpo and "`algo=ppo`" not in grpo  # cispo.yaml -> grpo.yaml -> the schema


def test_a_pipe_in_a_comment_stays_inside_its_cell():
    source = (
        "from dataclasses import dataclass\n\n@dataclass\nclass X:\n"
        '    """Doc."""\n\n    # above one\n    # above two\n    a: str = "x"  # p | q\n\n'
        "    b: int = 1\n"
    )
    (x,) = gen.parse_source(source)
    assert x.docstring == "Doc."
    assert [(f.name, f.comment) for f in x.fields] == [("a", "above one above two p | q"), ("b", "")]
    assert gen._escape("p | q <k> a_b *") == "p \\| q &lt;k&gt; a\\_b \\*"
    assert gen.render_type("str | None", set()) == "`str` \\| `None`"


def test_the_committed_page_is_the_generators_output(page):
    committed = ROOT / "docs" / "reference" / "config.md"
    assert committed.read_text() == page, (
        "docs/reference/config.md is stale: run `python scripts/gen_config_reference.py` (make docs does)"
    )


def test_the_page_is_written_atomically(tmp_path: Path):
    out = tmp_path / "reference" / "config.md"
    gen.write_atomic(out, "# x\n")
    gen.write_atomic(out, "# y\n")
    assert out.read_text() == "# y\n"
    assert [p.name for p in out.parent.iterdir()] == ["config.md"]  # no temporary file left
