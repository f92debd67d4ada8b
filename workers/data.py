"""Loading a job's data into arrays, and the per-epoch batch order.

The batch order is a pure function of (seed, epoch), so a resumed job can skip exactly the
batches it already trained on.
"""

from __future__ import annotations

import gzip
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.protocol import JobError


@dataclass
class Arrays:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray | None
    y_val: np.ndarray | None
    num_classes: int

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_arrays(data: dict[str, Any], training: dict[str, Any], data_dir: Path) -> Arrays:
    kind = data["kind"]
    if kind == "synthetic":
        x, y, classes = synthetic(data)
        xv = yv = None
    elif kind == "npz":
        x, y, xv, yv = _load_npz(data_dir, data["path"])
        classes = int(max(y.max(), yv.max() if yv is not None else 0)) + 1
    elif kind == "keras":
        x, y = load_keras_dataset(data["name"])
        xv = yv = None
        classes = 10
    else:
        raise JobError(f"unknown data kind {kind!r}")
    limit = data.get("max_samples")
    if limit:
        x, y = x[:limit], y[:limit]
    x = _as_float(x)
    if xv is not None:
        xv = _as_float(xv)
    split = training.get("validation_split", 0.0)
    if xv is None and split > 0:
        n_val = int(len(x) * split)
        if n_val > 0:
            # Like Keras' validation_split: the last fraction, before any shuffling.
            x, xv = x[:-n_val], x[-n_val:]
            y, yv = y[:-n_val], y[-n_val:]
    if len(x) == 0:
        raise JobError("the training set is empty")
    return Arrays(x, y.astype(np.int32), xv, None if yv is None else yv.astype(np.int32), classes)


def synthetic(data: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """Gaussian clusters: one random centre per class plus unit noise. The centres are scaled
    so that two of them lie about ``separation`` noise deviations apart whatever the number of
    features: learnable, so accuracy rises, without being trivially separable."""
    rng = np.random.default_rng(data["seed"])
    classes, features, samples = data["classes"], data["features"], data["samples"]
    spread = data["separation"] / np.sqrt(2.0 * features)
    centres = (rng.standard_normal((classes, features)) * spread).astype(np.float32)
    y = rng.integers(0, classes, samples).astype(np.int32)
    x = centres[y] + rng.standard_normal((samples, features), dtype=np.float32)
    return x, y, classes


def _as_float(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.uint8:
        return (x.astype(np.float32) / 255.0).astype(np.float32)
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise JobError(f"features must be real numbers, got dtype {x.dtype}")
    return x.astype(np.float32, copy=False)


def _load_npz(
    data_dir: Path, relative: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    root = data_dir.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise JobError("data.path escapes the data directory")
    try:
        # allow_pickle stays off: an .npz holding object arrays is refused, never unpickled.
        with np.load(path, allow_pickle=False) as f:
            names = set(f.files)
            missing = {"x_train", "y_train"} - names
            if missing:
                raise JobError(f"{relative} lacks {sorted(missing)}; it has {sorted(names)}")
            arrays = {k: f[k] for k in ("x_train", "y_train", "x_val", "y_val") if k in names}
    except JobError:
        raise
    except FileNotFoundError:
        raise JobError(f"no such file in the data directory: {relative}") from None
    except ValueError as exc:
        raise JobError(f"{relative} is not a plain-array .npz ({exc})") from None
    except Exception as exc:  # zipfile.BadZipFile, OSError, ...
        raise JobError(f"{relative} is not a readable .npz file: {exc}") from None
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise JobError(f"{relative}: x_val and y_val come together")
    x, y = arrays["x_train"], _labels(arrays["y_train"], "y_train")
    xv = arrays.get("x_val")
    yv = _labels(arrays["y_val"], "y_val") if "y_val" in arrays else None
    _check_pair(x, y, "train")
    if xv is not None and yv is not None:
        _check_pair(xv, yv, "val")
        if xv.shape[1:] != x.shape[1:]:
            raise JobError(f"x_val samples are {xv.shape[1:]}, x_train samples {x.shape[1:]}")
    return x, y, xv, yv


def _labels(y: np.ndarray, name: str) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise JobError(
            f"{name} must be integer class labels of shape (n,), got {y.dtype} {y.shape}"
        )
    if len(y) and y.min() < 0:
        raise JobError(f"{name} has negative class labels")
    return y


def _check_pair(x: np.ndarray, y: np.ndarray, split: str) -> None:
    if x.ndim < 2:
        raise JobError(f"x_{split} must have a sample axis and features, got shape {x.shape}")
    if len(x) != len(y):
        raise JobError(f"x_{split} has {len(x)} samples but y_{split} has {len(y)}")


# --------------------------------------------------------------------------------------------
# keras.datasets, from the local Keras cache

_FASHION_FILES = (
    "train-labels-idx1-ubyte.gz",
    "train-images-idx3-ubyte.gz",
)


def keras_cache_dir() -> Path:
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return Path(home) / "datasets"


def load_keras_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Training split of a keras.datasets set. Read straight from the Keras cache when it is
    there (no network, no hash check); otherwise Keras' own loader downloads it, and when that
    fails (offline) the job fails saying where the file was expected."""
    cache = keras_cache_dir()
    if name == "mnist" and (cache / "mnist.npz").is_file():
        with np.load(cache / "mnist.npz", allow_pickle=False) as f:
            return f["x_train"], f["y_train"]
    if name == "fashion_mnist" and all(
        (cache / "fashion-mnist" / n).is_file() for n in _FASHION_FILES
    ):
        folder = cache / "fashion-mnist"
        with gzip.open(folder / _FASHION_FILES[0], "rb") as f:
            y = np.frombuffer(f.read(), np.uint8, offset=8)
        with gzip.open(folder / _FASHION_FILES[1], "rb") as f:
            x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(len(y), 28, 28)
        return x, y
    try:
        import keras

        loader = getattr(keras.datasets, name)
        (x, y), _ = loader.load_data()
    except Exception as exc:
        raise JobError(
            f"dataset {name!r} is not in the Keras cache ({cache}) and could not be "
            f"downloaded: {exc}. Put the file in the cache (or set KERAS_HOME) on the worker, "
            "or upload the data as an .npz."
        ) from None
    return np.asarray(x), np.asarray(y).reshape(-1)


# --------------------------------------------------------------------------------------------
# Batch order


def steps_per_epoch(n_train: int, batch_size: int, fixed: int | None) -> int:
    return fixed if fixed is not None else max(1, math.ceil(n_train / batch_size))


def epoch_indices(n: int, batch_size: int, steps: int | None, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch: a fresh permutation per (seed, epoch). With a fixed
    ``steps`` per epoch the epoch takes exactly ``steps`` full batches, cycling through more
    permutations when it needs more samples than the set holds; without, it is every sample
    once and the last batch may be short, as in Keras."""
    need = n if steps is None else steps * batch_size
    rng = np.random.default_rng([seed, epoch])
    parts = []
    have = 0
    while have < need:
        parts.append(rng.permutation(n))
        have += n
    return np.concatenate(parts)[:need].astype(np.int64)
