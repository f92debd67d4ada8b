"""A code job says what it trained with: the training child reports the optimizer's class and
learning rate (or schedule), the loss and the examples per step in its "started" message, as
the bundle's function returned them, or the spec's where the function returned none. That is
what ``halfway show`` prints for a code job (tests/test_client_cli.py)."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.client.codepack import pack
from service.files import code, codestore
from service.files.storage import open_storage
from service.settings import Settings
from tests.test_usercode import Bundle, run_code

pytestmark = pytest.mark.keras

JOBS = """
import keras
import numpy as np
import tensorflow as tf


def arrays(n=64):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def classifier():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, activation="softmax", dtype="float32")(inputs))


def own_everything(args):
    schedule = keras.optimizers.schedules.ExponentialDecay(
        initial_learning_rate=0.05, decay_steps=10, decay_rate=0.5
    )
    x, y = arrays()
    return {
        "model": classifier(),
        "train": tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
        "optimizer": keras.optimizers.SGD(learning_rate=schedule, momentum=0.9),
        "loss": keras.losses.SparseCategoricalCrossentropy(name="own_ce"),
    }


def nothing_but_the_model(args):
    return {"model": classifier(), "train": arrays()}
"""


@pytest.fixture
def bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bundle]:
    root = tmp_path / "src"
    (root / "kinds").mkdir(parents=True)
    (root / "kinds" / "__init__.py").write_text("")
    (root / "kinds" / "jobs.py").write_text(JOBS)
    settings = Settings(home=tmp_path / "home")
    settings.ensure_dirs()
    stored = codestore.upload(
        io.BytesIO(pack(root)),
        open_storage(settings.storage_config()).code,
        settings.resolved_code_dir(),
        code.Limits(10**7, 100, 100),
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HALFWAY_DATA_DIR", str(settings.resolved_data_dir()))
    saved_path = list(sys.path)
    yield Bundle(settings, stored.digest)
    sys.path[:] = saved_path
    for name in [m for m in sys.modules if m == "kinds" or m.startswith("kinds.")]:
        del sys.modules[name]


def test_the_started_report_says_the_bundles_optimizer_schedule_loss_and_batch(
    bundle: Bundle, tmp_path: Path
) -> None:
    run = run_code(bundle, "own_everything", tmp_path)
    assert run.status == "succeeded", run.error
    device = run.started["device"]
    assert device["optimizer"] == {
        "class": "SGD",
        "schedule": {
            "class": "ExponentialDecay",
            "initial_learning_rate": 0.05,
            "decay_steps": 10,
            "decay_rate": 0.5,
            "staircase": False,
        },
    }
    assert device["loss"] == "own_ce"
    assert device["batch_size"] == 8  # the pipeline's, not training.batch_size (16)


def test_without_an_optimizer_from_the_bundle_the_report_says_the_specs(
    bundle: Bundle, tmp_path: Path
) -> None:
    run = run_code(
        bundle,
        "nothing_but_the_model",
        tmp_path,
        optimizer={"name": "rmsprop", "learning_rate": 0.002},
    )
    assert run.status == "succeeded", run.error
    device = run.started["device"]
    assert device["optimizer"]["class"] == "RMSprop"
    assert device["optimizer"]["learning_rate"] == pytest.approx(0.002)
    assert device["loss"] == "sparse_categorical_crossentropy"
    assert device["batch_size"] == 16
