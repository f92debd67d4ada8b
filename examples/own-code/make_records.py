"""Write the example's data: TFRecord shards of a noisy linear regression. On the worker, with
the Python that has Halfway's ``train`` extra (TensorFlow), from the folder ``halfway serve``
runs in::

    .venv/bin/python examples/own-code/make_records.py .halfway/data/own-code

``.halfway/data`` is the worker's data directory when neither HALFWAY_DATA_DIR nor
HALFWAY_HOME is set (else HALFWAY_DATA_DIR, or HALFWAY_HOME/data); the job's args name the
files relative to it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def write_records(
    folder: Path, samples: int = 512, features: int = 8, shards: int = 2, seed: int = 0
) -> list[Path]:
    try:
        import tensorflow as tf
    except ImportError:
        raise SystemExit(
            "make_records.py needs TensorFlow: run it with the Python of the environment "
            "Halfway is installed in with its train extra (pip install -e '.[train]'), "
            "e.g. .venv/bin/python examples/own-code/make_records.py .halfway/data/own-code"
        ) from None

    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(features,)).astype(np.float32)
    x = rng.normal(size=(samples, features)).astype(np.float32)
    y = x @ weights + 0.1 * rng.normal(size=(samples,)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = folder / f"train-{shard:02d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for i in range(shard, samples, shards):
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                            "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y[i]])),
                        }
                    )
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_records(Path(sys.argv[1] if len(sys.argv) > 1 else "own-code")):
        print(written)
