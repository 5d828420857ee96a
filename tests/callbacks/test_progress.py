"""The progress bar says what it counts."""

from __future__ import annotations

from rlhf_lightning.callbacks.progress import StepProgressBar


def test_train_bar_is_labelled_train_not_epoch_of_minus_two():
    bar = StepProgressBar()
    label = bar._get_train_description(current_epoch=0)
    assert label.strip() == "train" and len(label) == len(bar.validation_description)


def test_the_phase_inside_a_step_shows_in_the_bar_label():
    from rich.progress import Progress

    bar = StepProgressBar()
    bar.progress = Progress(auto_refresh=False)
    bar.train_progress_bar_id = bar.progress.add_task("train", total=10)
    bar.refresh = lambda: None  # no trainer to refresh for
    bar.on_phase(None, None, "update 2/4")
    assert bar.progress.tasks[0].description == "train · update 2/4"
