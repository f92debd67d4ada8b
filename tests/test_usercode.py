"""The training child's side of code jobs, run in this process for speed: what the function
returns is checked key by key, a subclassed model and numpy arrays train, the function runs
under the job's policy and seeds, its callbacks run, and a tf.data pipeline
resumed from a checkpoint continues exactly where the uninterrupted run went."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.client.codepack import pack
from service.files import code, codestore
from service.files.storage import open_storage
from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from tests.training_runs import Run
from workers.context import RunContext
from workers.protocol import JobError, Message
from workers.training import train

pytestmark = pytest.mark.keras

COMMON = """
import json
import os

import keras
import numpy as np
import tensorflow as tf


def arrays(n=96, features=4):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return x, y


def classifier():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, activation="softmax", dtype="float32")(h))
"""

KINDS = (
    COMMON
    + """

def wrong_model(args):
    return {"model": "a model", "train": arrays()}


def wrong_train(args):
    return {"model": classifier(), "train": [1, 2, 3]}


def unknown_key(args):
    return {"model": classifier(), "train": arrays(), "epochs": 3}


def scaled_optimizer(args):
    inner = keras.optimizers.Adam()
    return {"model": classifier(), "train": arrays(),
            "optimizer": keras.mixed_precision.LossScaleOptimizer(inner)}


def bad_callbacks(args):
    return {"model": classifier(), "train": arrays(), "callbacks": ["print"]}


def not_a_mapping(args):
    return [classifier()]


class Tiny(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(2, activation="softmax", dtype="float32")

    def call(self, x):
        return self.out(self.hidden(x))


class Seen(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        with open(os.environ["SEEN_FILE"], "a") as f:
            f.write(json.dumps({"epoch": epoch, "loss": float(logs["loss"])}) + "\\n")


def subclassed(args):
    policy = keras.config.dtype_policy().name
    strategy = tf.distribute.get_strategy()
    facts = {
        "policy": policy,
        "replicas": strategy.num_replicas_in_sync,
        "draw": float(np.random.random()),
        "keras_draw": float(keras.random.uniform(()).numpy()),
    }
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps(facts) + "\\n")
    return {"model": Tiny(), "train": arrays(), "validation": arrays(32),
            "callbacks": [Seen()], "metrics": ["accuracy"]}


def pipeline(args):
    x, y = arrays(160)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    return {"model": classifier(), "train": ds.filter(lambda a, b: True)}
"""
)


@dataclass
class Bundle:
    settings: Settings
    digest: str


@pytest.fixture
def bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bundle]:
    root = tmp_path / "src"
    (root / "kinds").mkdir(parents=True)
    (root / "kinds" / "__init__.py").write_text("")
    (root / "kinds" / "jobs.py").write_text(KINDS)
    settings = Settings(home=tmp_path / "home")
    settings.ensure_dirs()
    stored = codestore.upload(
        io.BytesIO(pack(root)),
        open_storage(settings.storage_config()).code,
        settings.resolved_code_dir(),
        code.Limits(10**7, 100, 100),
    )
    # The job changes directory, sets HALFWAY_DATA_DIR and imports the bundle: undo all
    # three for the next test.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HALFWAY_DATA_DIR", str(settings.resolved_data_dir()))
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    saved_path = list(sys.path)
    yield Bundle(settings, stored.digest)
    sys.path[:] = saved_path
    for name in [m for m in sys.modules if m == "kinds" or m.startswith("kinds.")]:
        del sys.modules[name]


def fields(run: Run, kind: str) -> list[dict[str, Any]]:
    return [dict(m) for m in run.of_type(kind)]


def run_code(
    bundle: Bundle,
    function: str,
    tmp_path: Path,
    *,
    job: str = "job",
    stop_after_step: int | None = None,
    resume_step: int | None = None,
    **sections: Any,
) -> Run:
    body = {
        "code": {"bundle": bundle.digest, "entrypoint": f"kinds.jobs:{function}"},
        "training": {"epochs": 2, "batch_size": 16, "steps_per_execution": 2},
        "outputs": {"save_model": False},
        **sections,
    }
    spec = normalize(JobSpec.model_validate(body), bundle.settings).spec.model_dump(mode="json")
    run = Run(status=None, error=None)
    stop = threading.Event()

    def emit(message: Message) -> None:
        run.messages.append(message)
        if (
            stop_after_step is not None
            and message["type"] == "steps"
            and message["records"][-1][0] >= stop_after_step
        ):
            stop.set()

    ctx = RunContext(
        job_id=1,
        spec=spec,
        job_dir=tmp_path / job,
        data_dir=bundle.settings.resolved_data_dir(),
        emit=emit,
        stop=stop,
        flush_seconds=0.0,
        resume_step=resume_step,
        code_dir=bundle.settings.resolved_code_dir(),
    )
    try:
        run.status = train(ctx)
    except JobError as exc:
        run.error = str(exc)
    return run


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("wrong_model", "returned 'model' must be a keras.Model, got str"),
        ("wrong_train", "returned 'train' must be a tf.data.Dataset"),
        ("unknown_key", "unknown keys ['epochs']"),
        ("scaled_optimizer", "already a LossScaleOptimizer"),
        ("bad_callbacks", "'callbacks' must be a list of keras.callbacks.Callback"),
        ("not_a_mapping", "returned list; it must return a mapping"),
    ],
)
def test_a_wrong_return_value_is_a_job_error_naming_the_key(
    bundle: Bundle, tmp_path: Path, function: str, message: str
) -> None:
    run = run_code(bundle, function, tmp_path)
    assert run.status is None and run.error is not None
    assert message in run.error, run.error


def test_a_subclassed_model_trains_under_the_policy_seeds_and_strategy(
    bundle: Bundle, tmp_path: Path
) -> None:
    import json

    first = run_code(
        bundle,
        "subclassed",
        tmp_path,
        precision={"policy": "mixed_bfloat16"},
    )
    assert first.status == "succeeded", first.error
    lines = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    facts, epochs = lines[0], lines[1:]
    assert facts["policy"] == "mixed_bfloat16"
    assert facts["replicas"] == 1  # several: tests/test_code_jobs.py (a fresh child)
    # 96 samples / 16 = 6 steps per epoch, two epochs, one row each.
    assert [r[0] for r in first.records] == list(range(12))
    # The user's callback ran as fit runs it, seeing the epoch's loss.
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[-1]["loss"] > 0
    (val,) = [m for m in fields(first, "metrics") if m["epoch"] == 1]
    assert "val_accuracy" in val["metrics"]
    # Seeds are set before the function: the same draws again on a second run.
    (tmp_path / "seen.jsonl").unlink()
    again = run_code(bundle, "subclassed", tmp_path, job="again")
    facts_again = json.loads((tmp_path / "seen.jsonl").read_text().splitlines()[0])
    assert again.status == "succeeded", again.error
    assert (facts_again["draw"], facts_again["keras_draw"]) == (
        facts["draw"],
        facts["keras_draw"],
    )


def test_a_resumed_tf_data_pipeline_continues_exactly(bundle: Bundle, tmp_path: Path) -> None:
    sections: dict[str, Any] = {
        "training": {
            "epochs": 3,
            "batch_size": 64,  # not the pipeline's: it batches by 16 itself
            "steps_per_execution": 2,
            "checkpoint_every": 4,
        },
        "precision": {"policy": "float32"},
    }
    whole = run_code(bundle, "pipeline", tmp_path, job="whole", **sections)
    assert whole.status == "succeeded", whole.error
    assert [r[0] for r in whole.records] == list(range(30))
    (timing,) = [m["metrics"] for m in fields(whole, "metrics") if m["epoch"] == -1]
    assert timing["examples_per_second"] == pytest.approx(16 / timing["median_step_seconds"])
    cut = run_code(bundle, "pipeline", tmp_path, job="cut", stop_after_step=13, **sections)
    assert cut.status == "cancelled"
    checkpoint: int = max(m["step"] for m in fields(cut, "checkpoint"))
    assert 10 < checkpoint < 30 and checkpoint % 10 != 0  # mid-epoch
    resumed = run_code(bundle, "pipeline", tmp_path, job="cut", resume_step=checkpoint, **sections)
    assert resumed.status == "succeeded", resumed.error
    assert resumed.records[0][0] == checkpoint
    # Unshuffled, so exact: the same losses, step for step, as the run never interrupted.
    assert resumed.records == whole.records[checkpoint:]
    (note,) = [m["message"] for m in fields(resumed, "note") if "resumed" in m["message"]]
    assert f"after {checkpoint % 10} of its batches" in note
