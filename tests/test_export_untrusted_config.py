"""A run directory is data that may come from anyone: exporting it resolves no interpolation that
reads outside it (``${oc.env:NAME}``), so no variable of this environment reaches the export."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_lightning.export import main as export_main
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config

pytestmark = pytest.mark.slow

SECRET = "s3cr3t-token-h1-8c41"
TEMPLATE = "{# " + SECRET + " #}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("untrusted") / "run"
    overrides = [*FAST, "trainer.max_steps=1", "eval.before_training=false", "eval.at_end=false"]
    assert run(compose_config(overrides, output_dir=out)).exit_code == 0
    return out


def with_model_fields(run_dir: Path, dest: Path, **fields: str) -> Path:
    """A copy of ``run_dir``'s config.yaml (and its checkpoints, linked) with ``model.<field>``
    set to the raw strings ``fields`` (interpolations as a hostile config.yaml would hold them)."""
    dest.mkdir()
    (dest / "checkpoints").symlink_to(run_dir / "checkpoints")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    for key, value in fields.items():
        if "." in key:
            OmegaConf.update(cfg, key, value, force_add=True)
        else:
            cfg.model[key] = value
    (dest / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return dest


def everything_under(path: Path) -> str:
    if not path.exists():
        return ""
    return "".join(p.read_bytes().decode("latin-1") for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": "${oc.env:H1_EXPORT_SECRET}"},
        # through a reference to another field that reads the environment
        {"chat_template": "${logger.project}", "logger.project": "${oc.env:H1_EXPORT_SECRET}"},
    ],
    ids=["direct", "through_a_reference"],
)
def test_an_environment_variable_never_reaches_the_export(trained, tmp_path, monkeypatch, fields):
    monkeypatch.setenv("H1_EXPORT_SECRET", TEMPLATE)
    src = with_model_fields(trained, tmp_path / "src", **fields)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refused:
        export_main([str(src), "--out", str(out)])
    message = str(refused.value)
    assert f"{src / 'config.yaml'} sets model.chat_template through an interpolation" in message
    assert SECRET not in message
    assert SECRET not in everything_under(tmp_path)


def test_the_projects_own_resolvers_and_references_still_resolve(trained, tmp_path):
    src = with_model_fields(trained, tmp_path / "src", chat_template="${model.name}: {{ messages }}")
    assert "${asset:" in (src / "config.yaml").read_text()  # the embedded model's path
    out = tmp_path / "out"
    export_main([str(src), "--out", str(out)])
    name = OmegaConf.load(trained / "config.yaml").model.name
    assert (out / "chat_template.jinja").read_text() == f"{name}: {{{{ messages }}}}"
