"""Extra Lightning callbacks from the config (``callbacks.<name>``, ``conf/callbacks/``): added
by a group option or by ``+callbacks.<name>._target_``, dropped with ``~callbacks.<name>``,
instantiated after the run's own, and every bad entry refused at start-up with its field."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor

from rlhf_lightning.callbacks.configured import configured_callbacks
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config

CALLS: list[str] = []


class Recorder(L.Callback):
    """A user's callback: records the training batches it saw."""

    def __init__(self, tag: str = "x") -> None:
        self.tag = tag

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        CALLS.append(f"{self.tag}:{trainer.global_step}")


def test_none_by_default_and_group_options_compose():
    assert configured_callbacks(compose_config().callbacks) == []
    one = configured_callbacks(compose_config(["callbacks=lr_monitor"]).callbacks)
    assert [type(c) for c in one] == [LearningRateMonitor] and one[0].logging_interval == "step"
    both = compose_config(["callbacks=[lr_monitor,early_stopping]"]).callbacks
    made = configured_callbacks(both)
    assert [type(c) for c in made] == [LearningRateMonitor, EarlyStopping]
    assert made[1].monitor == "eval/accuracy_greedy" and made[1].patience == 3


def test_added_by_target_and_dropped_by_name():
    cfg = compose_config(
        ["callbacks=lr_monitor", f"+callbacks.rec._target_={__name__}.Recorder", "+callbacks.rec.tag=mine"]
    )
    made = configured_callbacks(cfg.callbacks)
    assert [type(c).__name__ for c in made] == ["LearningRateMonitor", "Recorder"] and made[1].tag == "mine"
    dropped = compose_config(["callbacks=lr_monitor", "~callbacks.lr_monitor"]).callbacks
    assert configured_callbacks(dropped) == []


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("+callbacks.bad._target_=no_such_pkg.Callback", "callbacks.bad._target_"),
        ("+callbacks.bad._target_=collections.OrderedDict", "callbacks.bad._target_"),  # not a Callback
        ("+callbacks.bad=3", "callbacks.bad"),
    ],
)
def test_bad_entries_are_refused_at_start_up_with_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override]))
    assert str(err.value).startswith(f"invalid config: {field}=")


def test_bad_arguments_name_the_entry():
    cfg = compose_config([f"+callbacks.rec._target_={__name__}.Recorder", "+callbacks.rec.colour=red"])
    validate(cfg)  # the class is fine; its arguments are checked when it is made
    with pytest.raises(ConfigError, match=r"callbacks\.rec="):
        configured_callbacks(cfg.callbacks)


@pytest.mark.slow
def test_a_run_calls_the_configured_callback_after_its_own(tmp_path):
    from rlhf_lightning.run import run

    CALLS.clear()
    cfg = compose_config(
        [*FAST, f"+callbacks.rec._target_={__name__}.Recorder", "callbacks=lr_monitor", "logger=csv"],
        output_dir=tmp_path / "run",
    )
    result = run(cfg)
    assert CALLS == ["x:1", "x:2"]
    names = [type(c).__name__ for c in result.trainer.callbacks]
    assert names.index("Recorder") > names.index("RolloutEngineCallback")
    assert "LearningRateMonitor" in names
