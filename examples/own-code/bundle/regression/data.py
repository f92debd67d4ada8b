"""The input pipeline: TFRecord files of tf.train.Example {x: float[features], y: float}."""

from __future__ import annotations

import glob
from typing import Any

import tensorflow as tf


def pipeline(pattern: str, features: int, batch_size: int) -> Any:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no TFRecord files match {pattern!r}")
    spec = {
        "x": tf.io.FixedLenFeature([features], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.float32),
    }

    def parse(record: Any) -> Any:
        example = tf.io.parse_single_example(record, spec)
        return example["x"], example["y"]

    return (
        tf.data.TFRecordDataset(files)
        .map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(batch_size)
        .prefetch(tf.data.AUTOTUNE)
    )
