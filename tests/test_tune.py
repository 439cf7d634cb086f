"""Ray Tune around the course's Trainer (course_utils.tuning): real Ray, real trials, one Ray for the module.

What notebook 08 claims, checked on searches small enough for 2 cores: ASHA stops trials early
and spends fewer epochs than the same search run to the end; the configuration it finds beats a
deliberately bad one on images no trial saw; a search stopped half-way and restored keeps the
trials that had finished.
"""

import pytest

from course_utils.config import TrainConfig

tuning = pytest.importorskip("course_utils.tuning")
pytest.importorskip("ray.tune", reason="ray[tune] is not installed: make setup installs it")

BASE = TrainConfig(epochs=3, n_train=256, n_val=128, batch_size=32, workers=0)
SAMPLES = 8


@pytest.fixture(scope="module")
def ray_here(tmp_path_factory):
    import ray

    resources = tuning.start_ray(num_cpus=2)
    yield tmp_path_factory.mktemp("tune")
    ray.shutdown()
    assert resources["CPU"] == 2


@pytest.fixture(scope="module")
def asha_and_fifo(ray_here):
    """The same eight draws of the search space, under ASHA and run to the end."""
    out = {}
    for scheduler in ("asha", "fifo"):
        grid = tuning.run_search(BASE, tuning.space("hparams"), name=scheduler, num_samples=SAMPLES,
                                 scheduler=scheduler, storage=ray_here, fresh=True)
        out[scheduler] = (grid, tuning.trials(grid, BASE.epochs))
    return out


def test_asha_stops_trials_early_and_spends_fewer_epochs(asha_and_fifo):
    (_, asha), (_, fifo) = asha_and_fifo["asha"], asha_and_fifo["fifo"]
    a, f = tuning.summary(asha), tuning.summary(fifo)
    assert a["trials"] == f["trials"] == SAMPLES and a["errored"] == f["errored"] == 0, (a, f)
    assert sorted(map(str, (r["config"] for r in asha))) == sorted(map(str, (r["config"] for r in fifo))), \
        "the same seed should draw the same configurations"
    assert f["epochs"] == SAMPLES * BASE.epochs and f["stopped_early"] == 0, f
    assert a["stopped_early"] >= 1 and a["epochs"] < f["epochs"], tuning.table(asha)
    # a trial stopped early trained fewer epochs than the search's limit, and one trial ran to the end
    assert all(r["epochs"] < BASE.epochs for r in asha if r["status"] == "stopped early")
    assert any(r["status"] == "completed" for r in asha), tuning.table(asha)


def test_the_best_configuration_beats_a_bad_one_on_held_out_images(asha_and_fifo, ray_here):
    grid, _ = asha_and_fifo["fifo"]
    best = grid.get_best_result(metric=tuning.METRIC, mode=tuning.MODE, scope="all")
    bad_grid = tuning.run_search(BASE, {"lr": 1e-5, "batch_size": 32, "width": 16}, name="bad", num_samples=1,
                                 scheduler="fifo", storage=ray_here, fresh=True)
    (bad,) = list(bad_grid)
    best_loss, best_acc = tuning.held_out_score(best, 500)
    bad_loss, bad_acc = tuning.held_out_score(bad, 500)
    assert best_loss < bad_loss and best_acc > bad_acc + 0.05, (best.config, best_acc, bad_acc)


def test_a_search_stopped_half_way_and_restored_keeps_its_finished_trials(ray_here):
    base = TrainConfig(epochs=2, n_train=128, n_val=64, batch_size=32, workers=0)
    space = {"lr": tuning.space("hparams")["lr"], "width": 16}
    stopped = tuning.run_search(base, space, name="restore", num_samples=6, scheduler="fifo", storage=ray_here,
                                fresh=True, callbacks=[tuning.interrupt_after(2)])
    before = {r["trial"]: r for r in tuning.trials(stopped, base.epochs)}
    finished = {t: r for t, r in before.items() if r["status"] == "completed"}  # as Tune recorded them
    assert 2 <= len(finished) < 6, "the search should have stopped with some trials still to run"
    resumed = tuning.run_search(base, space, name="restore", num_samples=6, scheduler="fifo", storage=ray_here)
    after = {r["trial"]: r for r in tuning.trials(resumed, base.epochs)}
    rows = list(after.values())
    assert len(rows) == 6 and all(r["status"] == "completed" for r in rows), tuning.table(rows)
    for trial, row in finished.items():
        # not trained again: the same epochs, reported at the same moments
        assert after[trial]["end"] == row["end"] and after[trial]["val_loss"] == row["val_loss"], trial
