"""The epoch feed: one tf.data pipeline, built once, whose sample order each epoch writes into a
variable the pipeline reads."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf


class EpochFeed:
    """The batches of an epoch, gathered from the in-memory arrays (as Keras' own array
    adapter does) in the epoch's sample order.

    The pipeline is built once per job: an epoch only writes its order into a variable that
    the pipeline reads. Building it per epoch (and re-capturing the arrays) cost several
    milliseconds per fit(), a few percent of a short epoch of a small model."""

    def __init__(self, x: Any, y: Any, batch: int, samples_per_epoch: int) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.samples = samples_per_epoch
        self.steps = math.ceil(samples_per_epoch / batch)
        self.order = tf.Variable(tf.zeros((samples_per_epoch,), tf.int64), trainable=False)
        self.whole = self._pipeline(first=0)

    def _pipeline(self, first: int) -> Any:
        order, batch, samples = self.order, self.batch, self.samples

        def pick(i: Any, xy: Any) -> Any:
            start = i * batch
            idx = order[start : tf.minimum(start + batch, samples)]
            return tf.gather(xy[0], idx), tf.gather(xy[1], idx)

        # tf.data's default static optimizations rerun each time an iterator is opened, and
        # Keras opens two per fit(), i.e. per epoch here; this pipeline is already parallel
        # and prefetched, and iterates no slower without them.
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        arrays = tf.data.Dataset.from_tensors((self.x, self.y)).repeat()
        return (
            tf.data.Dataset.zip((tf.data.Dataset.range(first, self.steps), arrays))
            .map(pick, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
            .with_options(options)
        )

    def epoch(self, order: np.ndarray, skip: int = 0) -> Any:
        """The dataset of one epoch, skipping the batches a resumed job already trained on."""
        self.order.assign(order)
        return self.whole if skip == 0 else self._pipeline(first=skip)


def epoch_dataset(x: Any, y: Any, order: np.ndarray, batch: int, skip: int) -> Any:
    """One epoch's batches, for callers that want a single epoch (tests, benchmarks)."""
    return EpochFeed(x, y, batch, len(order)).epoch(order, skip)
