"""Code jobs end to end: a team's own bundle (a custom layer, a Functional model, a tf.data
pipeline over TFRecord files) trained by a real worker under mixed_float16 with Halfway's
scaler and per-step record, submitted through the real ``halfway`` CLI; the same bundle as a
precision sweep; a SIGKILLed worker resuming it; a bundle that proves only the training child
imports it; and the user's exceptions failing the job once, naming the bundle's line."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import signal
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.client import codepack
from service.database.db import Database
from service.settings import Settings
from tests.live import Live, halfway
from tests.reference import expected_scales
from workers.supervisor import Supervisor

pytestmark = pytest.mark.keras

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own-code"


def write_records(folder: Path, samples: int = 512) -> None:
    """The example's own data script, run here (it is not part of the bundle)."""
    spec = importlib.util.spec_from_file_location("make_records", EXAMPLE / "make_records.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_records(folder, samples=samples)


def push(live: Live, directory: Path) -> str:
    r = httpx.post(
        f"{live.url}/v1/code",
        files={"file": ("b.tar.gz", codepack.pack(directory))},
        headers={"Authorization": f"Bearer {live.team.admin}"},
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text
    digest: str = r.json()["digest"]
    return digest


def example_spec(digest: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec["code"]["bundle"] = digest
    return spec


def job_log(live: Live, job_id: int) -> str:
    return httpx.get(
        f"{live.url}/v1/jobs/{job_id}/logs",
        headers={"Authorization": f"Bearer {live.team.admin}"},
    ).text


def history(live: Live, job_id: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    after = -1
    while True:
        page = live.api("GET", f"/v1/jobs/{job_id}/history?after_step={after}&limit=10000")
        rows += page["items"]
        after = page["next_after_step"]
        if not page["has_more"]:
            return rows


def wait_for(live: Live, job_id: int, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = live.api("GET", f"/v1/jobs/{job_id}")
        if job["status"] not in ("queued", "running") or time.monotonic() > deadline:
            return job
        time.sleep(0.3)


def test_own_code_example_through_the_cli_trains_under_halfways_scaler_and_record(
    live: Live, worker: Supervisor, settings: Settings
) -> None:
    write_records(settings.resolved_data_dir() / "own-code")
    result = halfway(
        live,
        "submit",
        str(EXAMPLE / "job.yaml"),
        "--code",
        str(EXAMPLE / "bundle"),
        "--watch",
        env={"HALFWAY_TOKEN": live.team.admin},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "code bundle sha256:" in result.stdout
    (job,) = live.api("GET", "/v1/jobs")["items"]
    assert job["status"] == "succeeded", job["error"]
    assert job["attempt"] == 1
    assert job["spec"]["code"]["bundle"] in result.stdout
    rows = history(live, job["id"])
    # 512 samples / 32 = 16 batches (tf.data cannot tell; Halfway counted) x 4 epochs.
    assert job["progress"]["total_steps"] == 64
    assert [r["step"] for r in rows] == list(range(64))
    assert [r["step"] for r in rows if not r["finite"]] == [12, 40]
    assert [r["loss_scale"] for r in rows] == expected_scales(
        [r["finite"] for r in rows], growth_steps=20
    )
    assert job["summary"]["growth_count"] >= 1 and job["summary"]["backoff_count"] == 2
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8, losses
    # The forensics name the custom layer's own variables, and only them.
    assert [f["step"] for f in job["forensics"]] == [12, 40]
    for report in job["forensics"]:
        assert report["nonfinite_variables"] == ["gated/kernel", "gated/bias", "gated/gate"]
    layers = {p["layer"]: p for p in job["precision_report"]}
    assert layers["gated"]["class"] == "GatedDense"
    assert layers["gated"]["compute_dtype"] == "float16"
    assert layers["gated"]["variable_dtype"] == "float32"
    assert layers["y"]["compute_dtype"] == "float32"
    assert any("counted it by iterating it once: 16 batches" in n for n in job["notes"])
    assert any("model.weights.h5" in n for n in job["notes"])
    assert job["summary"]["metrics"]["last_epoch"]["mae"] > 0
    job_dir = settings.resolved_artifact_dir() / str(job["id"])
    assert (job_dir / "model.keras").is_file() and (job_dir / "model.weights.h5").is_file()
    listed = {a["name"] for a in live.api("GET", f"/v1/jobs/{job['id']}/artifacts")}
    assert {"model.keras", "model.weights.h5", "train.log"} <= listed
    shown = halfway(live, "show", str(job["id"]))
    assert shown.returncode == 0, shown.stderr
    assert f"regression.train:build from {job['spec']['code']['bundle']}" in shown.stdout
    assert "mlp" not in shown.stdout


def test_the_bundle_as_a_three_variant_sweep_measures_every_comparison_field(
    live: Live, worker: Supervisor, settings: Settings
) -> None:
    write_records(settings.resolved_data_dir() / "own-code")
    result = halfway(
        live,
        "sweep",
        str(EXAMPLE / "sweep.yaml"),
        "--code",
        str(EXAMPLE / "bundle"),
        env={"HALFWAY_TOKEN": live.team.admin, "COLUMNS": "250"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "code bundle sha256:" in result.stdout
    # The table's title names the sweep; each row names its variant.
    assert re.search(r"sweep \d+: own-code-precision", result.stdout), result.stdout
    rows = [line.split("│")[1].strip() for line in result.stdout.splitlines() if "│" in line]
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        assert policy in rows, result.stdout
    found = re.search(r"^sweep (\d+): 3 jobs", result.stdout, re.MULTILINE)
    assert found is not None, result.stdout
    sweep_id = int(found.group(1))
    sweep = live.api("GET", f"/v1/sweeps/{sweep_id}")
    assert sweep["done"]
    variants = {v["policy"]: v for v in sweep["variants"]}
    assert set(variants) == {"float32", "mixed_float16", "mixed_bfloat16"}
    for policy, v in variants.items():
        assert v["status"] == "succeeded", (policy, v["error"])
        for field in (
            "examples_per_second",
            "median_step_seconds",
            "speedup_vs_float32",
            "time_to_target_seconds",
            "step_to_target",
            "final_loss",
            "final_loss_scale",
            "min_loss_scale",
        ):
            assert v[field] is not None, (policy, field)
        assert v["final_metrics"]["mae"] > 0
        assert v["overflow_count"] == v["skipped_steps"]
    assert variants["float32"]["speedup_vs_float32"] == 1.0
    assert variants["mixed_float16"]["loss_scale_mode"] == "dynamic"
    assert variants["mixed_bfloat16"]["loss_scale_mode"] == "none"


# --------------------------------------------------------------------------------------------
# Only the training child imports the bundle


MARKER_BUNDLE = {
    "probe/__init__.py": "",
    "probe/model.py": (
        "import os\n"
        "# Where the server's environment is (the API, the supervisor), this leaves a mark;\n"
        "# the training child's environment holds no such variable, so it only says so.\n"
        "marker = os.environ.get('HALFWAY_TEST_MARKER')\n"
        "if marker:\n"
        "    with open(marker, 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "print('probe: imported', flush=True)\n"
        "\n"
        "import keras\n"
        "import numpy as np\n"
        "\n"
        "\n"
        "def build(args):\n"
        "    import json, tensorflow as tf\n"
        "    from keras.src.trainers.data_adapters import array_slicing\n"
        "    from keras.src.visualization import plot_image_gallery\n"
        "    import matplotlib.pyplot, pandas  # the user's own code may use them\n"
        "    facts = {'policy': keras.config.dtype_policy().name,\n"
        "             'replicas': tf.distribute.get_strategy().num_replicas_in_sync,\n"
        "             'keras_loaded': [array_slicing.pandas is not None,\n"
        "                              plot_image_gallery.plt is not None],\n"
        "             'user_loaded': [pandas.__name__, matplotlib.pyplot.__name__]}\n"
        "    print('probe: facts ' + json.dumps(facts), flush=True)\n"
        "    rng = np.random.default_rng(0)\n"
        "    x = rng.normal(size=(64, 4)).astype('float32')\n"
        "    y = (x.sum(axis=1) > 0).astype('int32')\n"
        "    dense = keras.layers.Dense(2, activation='softmax')\n"
        "    model = keras.Sequential([keras.Input((4,)), dense])\n"
        "    return {'model': model, 'train': (x, y)}\n"
    ),
}


def bundle_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "bundle"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def run_until_done(live: Live, db: Database, settings: Settings, job_id: int) -> dict[str, Any]:
    """A worker of this test's own (``settings`` as the test set them) runs until the job
    ends; the job as the API then shows it."""
    supervisor = Supervisor(db, settings)
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    try:
        return wait_for(live, job_id)
    finally:
        supervisor.stop()
        thread.join(timeout=60)


def test_only_the_training_child_imports_the_bundle(
    live: Live, db: Database, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported-by"
    monkeypatch.setenv("HALFWAY_TEST_MARKER", str(marker))
    digest = push(live, bundle_dir(tmp_path, MARKER_BUNDLE))
    spec = {
        "code": {"bundle": digest, "entrypoint": "probe.model:build"},
        "training": {"epochs": 2},
        # The function runs under the job's policy and inside the strategy's scope.
        "precision": {"policy": "mixed_bfloat16"},
        "resources": {"cpu_replicas": 2},
    }
    live.api("POST", "/v1/jobs?dry_run=true", live.team.admin, json=spec)
    job_id = live.api("POST", "/v1/jobs", live.team.admin, json=spec)["id"]
    assert not marker.exists(), "the API imported the bundle"
    job = run_until_done(live, db, settings, job_id)
    assert job["status"] == "succeeded", job["error"]
    # Imported once, by the training child (which says so in its log), and never by this
    # process, which ran the API and the supervisor with the marker variable set.
    assert not marker.exists(), "the API or the supervisor imported the bundle"
    log = job_log(live, job_id)
    assert log.count("probe: imported") == 1, log
    rows = history(live, job_id)
    assert [r["step"] for r in rows] == list(range(4))  # 64 samples / 32, two epochs
    facts = json.loads(log.split("probe: facts ", 1)[1].splitlines()[0])
    # Keras loaded without pandas and matplotlib (a shorter start for every child), and the
    # user's code imported both afterwards.
    assert facts == {
        "policy": "mixed_bfloat16",
        "replicas": 2,
        "keras_loaded": [False, False],
        "user_loaded": ["pandas", "matplotlib.pyplot"],
    }
    assert job["device"]["replicas"] == 2
    assert "probe" not in {m.split(".")[0] for m in __import__("sys").modules}


SLOW_TO_TRACE = {
    "slow/__init__.py": "",
    "slow/model.py": (
        "import time\n"
        "\n"
        "import keras\n"
        "import numpy as np\n"
        "\n"
        "\n"
        "class SlowToTrace(keras.layers.Layer):\n"
        "    # call() runs when TensorFlow traces a step, not at every step: its sleep stands\n"
        "    # for the trace and compile of a big model.\n"
        "    def call(self, x):\n"
        "        time.sleep(2)\n"
        "        return x\n"
        "\n"
        "\n"
        "def build(args):\n"
        "    rng = np.random.default_rng(0)\n"
        "    x = rng.normal(size=(64, 4)).astype('float32')\n"
        "    y = (x.sum(axis=1) > 0).astype('int32')\n"
        "    dense = keras.layers.Dense(2, activation='softmax')\n"
        "    layers = [keras.Input((4,)), SlowToTrace(), dense]\n"
        "    return {'model': keras.Sequential(layers), 'train': (x, y)}\n"
    ),
}


def test_compiling_a_step_function_counts_as_starting_not_as_a_hang(
    live: Live, db: Database, settings: Settings, tmp_path: Path
) -> None:
    """Training's limit is shorter than the first execution's trace here (the step's forward
    pass and the meter's float32 shadow each call the layer once while tracing, 4 s in all);
    the child says it is compiling, so the start-up limit, at its default, covers it."""
    settings.hang_timeout_seconds = 3
    digest = push(live, bundle_dir(tmp_path, SLOW_TO_TRACE))
    spec = {
        "code": {"bundle": digest, "entrypoint": "slow.model:build"},
        "training": {"epochs": 2},
        "outputs": {"save_model": False},
    }
    job_id = live.api("POST", "/v1/jobs", live.team.admin, json=spec)["id"]
    job = run_until_done(live, db, settings, job_id)
    assert job["status"] == "succeeded", job["error"]
    assert [r["step"] for r in history(live, job_id)] == list(range(4))


FAILING = {
    "bad/__init__.py": "",
    "bad/train.py": (
        "import keras\n"
        "import numpy as np\n"
        "\n"
        "\n"
        "def helper(n):\n"
        "    raise ValueError(f'no data for {n} classes')\n"
        "\n"
        "\n"
        "def build(args):\n"
        "    return helper(args.get('classes', 3))\n"
        "\n"
        "\n"
        "def no_train(args):\n"
        "    return {'model': keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])}\n"
        "\n"
        "\n"
        "class Exploding(keras.layers.Layer):\n"
        "    def call(self, x, training=False):\n"
        "        if training:\n"
        "            raise RuntimeError('the layer exploded')\n"
        "        return x\n"
        "\n"
        "\n"
        "def explodes_in_training(args):\n"
        "    x = np.zeros((8, 2), 'float32')\n"
        "    y = np.zeros((8,), 'int32')\n"
        "    inputs = keras.Input((2,))\n"
        "    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))\n"
        "    wrapped = keras.Sequential([model, Exploding()])\n"
        "    return {'model': wrapped, 'train': (x, y)}\n"
    ),
}


def test_an_exception_in_user_code_fails_once_naming_the_bundle_line(
    live: Live, worker: Supervisor, tmp_path: Path
) -> None:
    digest = push(live, bundle_dir(tmp_path, FAILING))
    cases = {
        "bad.train:build": ["ValueError: no data for 3 classes", "bad/train.py:6"],
        "bad.train:no_train": ["lacks 'train'"],
        "bad.train:explodes_in_training": [
            "RuntimeError:",
            "the layer exploded",
            "during training at bad/train.py:20",
        ],
    }
    ids = {
        entry: live.api(
            "POST",
            "/v1/jobs",
            live.team.admin,
            json={"code": {"bundle": digest, "entrypoint": entry}, "max_attempts": 3},
        )["id"]
        for entry in cases
    }
    for entry, expected in cases.items():
        job = wait_for(live, ids[entry])
        assert job["status"] == "failed", (entry, job)
        assert job["attempt"] == 1, (entry, job["attempt_errors"])
        for text in expected:
            assert text in job["error"], (entry, job["error"])
    log = job_log(live, ids["bad.train:build"])
    assert "Traceback (most recent call last)" in log
    assert 'bad/train.py", line 10, in build' in log and "line 6, in helper" in log


# --------------------------------------------------------------------------------------------
# A SIGKILLed worker


def test_sigkilled_worker_resumes_a_code_job_with_no_gap_and_no_duplicate(
    live: Live, settings: Settings, tmp_path: Path
) -> None:
    from tests.test_crash_recovery import (
        alive,
        check_gradients_across_resume,
        children,
        rows_past_the_checkpoint,
        start_worker,
        wait_until,
    )

    write_records(settings.resolved_data_dir() / "own-code", samples=3200)
    spec = example_spec(push(live, EXAMPLE / "bundle"))
    spec["training"] = {"epochs": 12, "steps_per_execution": 10, "checkpoint_every": 150}
    spec["code"]["args"]["decay_steps"] = 1200
    # The first attempt stops at step 605, past the checkpoint awaited below, so the SIGKILL
    # lands while it still runs however fast the machine is; the resumed attempt goes on.
    spec["faults"] = {"nonfinite_at_steps": [30, 700], "hang_at_step": 605, "crash_attempts": [1]}
    spec["gradients"] = {"every": 50, "shadow_every": 150}
    job_id = live.api("POST", "/v1/jobs", live.team.admin, json=spec)["id"]
    total = 12 * 100
    log = tmp_path / "workers.log"

    def checkpoint() -> int:
        step: int | None = live.api("GET", f"/v1/jobs/{job_id}")["summary"]["checkpoint_step"]
        return step or 0

    first = start_worker(settings, log)
    try:
        wait_until(lambda: checkpoint() >= 300, 240, "a checkpoint")
        trainers = children(first.pid)
        assert trainers
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in trainers), 30, "the orphan to die")
    finally:
        if first.poll() is None:
            first.kill()
    killed = live.api("GET", f"/v1/jobs/{job_id}")
    assert killed["status"] == "running" and killed["summary"]["last_step"] < total - 1
    cut = rows_past_the_checkpoint(settings, job_id)
    second = start_worker(settings, log)
    try:
        job = wait_for(live, job_id, timeout=400)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    assert job["status"] == "succeeded", str(job["error"]) + log.read_text()[-3000:]
    assert job["attempt"] == 2
    rows = history(live, job_id)
    assert [r["step"] for r in rows] == list(range(total))
    assert {30, 700} <= {r["step"] for r in rows if not r["finite"]}
    assert [r["loss_scale"] for r in rows] == expected_scales(
        [r["finite"] for r in rows], growth_steps=20
    )
    assert any("resumed at epoch" in n and "skipped" in n for n in job["notes"]), job["notes"]
    check_gradients_across_resume(
        lambda path: live.api("GET", path), job_id, total, every=50, shadow_every=150, cut=cut
    )


def test_pack_of_the_example_holds_only_its_sources() -> None:
    archive = codepack.pack(EXAMPLE / "bundle")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = sorted(tar.getnames())
    assert names == [
        "regression/__init__.py",
        "regression/data.py",
        "regression/layers.py",
        "regression/train.py",
    ]
