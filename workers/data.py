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
    loss = training.get("loss", {}).get("name", "sparse_categorical_crossentropy")
    targets = loss != "sparse_categorical_crossentropy"
    if kind == "synthetic":
        x, y, classes = synthetic(data)
        xv = yv = None
    elif kind == "npz":
        x, y, xv, yv = _load_npz(data_dir, data["path"], targets)
        if targets:
            classes = int(y.shape[1]) if y.ndim == 2 else 1
        else:
            classes = int(max(y.max(), yv.max() if yv is not None else 0)) + 1
    elif kind == "image_directory":
        x, y, xv, yv, classes = load_image_directory(data, training, data_dir)
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
    if loss == "categorical_crossentropy" and y.ndim == 1:
        # Class labels for a loss that wants one-hot rows.
        classes = max(classes, int(y.max()) + 1)
        y = np.eye(classes, dtype=np.float32)[y]
        yv = None if yv is None else np.eye(classes, dtype=np.float32)[yv]
    if not targets:
        y = y.astype(np.int32)
        yv = None if yv is None else yv.astype(np.int32)
    else:
        y = y.astype(np.float32)
        yv = None if yv is None else yv.astype(np.float32)
    return Arrays(x, y, xv, yv, classes)


def load_image_directory(
    data: dict[str, Any], training: dict[str, Any], data_dir: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """Read the class sub-folders once into arrays (pixels scaled to [0, 1]), so the job's
    batch order is Halfway's own (seeded per epoch) and a resume is exact."""
    import keras

    root = data_dir.resolve()
    folder = (root / data["path"]).resolve()
    if not folder.is_relative_to(root) or not folder.is_dir():
        raise JobError(f"no such folder in the data directory: {data['path']}")
    split = data.get("validation_split") or 0.0
    common: dict[str, Any] = {
        "labels": "inferred",
        "label_mode": "int",
        "color_mode": data["color_mode"],
        "image_size": tuple(data["image_size"]),
        "batch_size": None,
        "shuffle": False,
        "seed": training.get("seed", 0),
        "verbose": False,
    }
    try:
        if split:
            train_ds, val_ds = keras.utils.image_dataset_from_directory(
                str(folder), validation_split=split, subset="both", **common
            )
        else:
            train_ds = keras.utils.image_dataset_from_directory(str(folder), **common)
            val_ds = None
    except ValueError as exc:
        raise JobError(f"{data['path']}: {exc}") from None
    classes = len(train_ds.class_names)

    def arrays(ds: Any) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for image, label in ds.as_numpy_iterator():
            xs.append(image)
            ys.append(label)
        if not xs:
            return np.zeros((0, *data["image_size"], 1), np.float32), np.zeros((0,), np.int32)
        return (np.stack(xs) / 255.0).astype(np.float32), np.asarray(ys, np.int32)

    x, y = arrays(train_ds)
    xv, yv = arrays(val_ds) if val_ds is not None else (None, None)
    if xv is not None and len(xv) == 0:
        xv = yv = None
    return x, y, xv, yv, classes


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
    data_dir: Path, relative: str, targets: bool = False
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
    check = _targets if targets else _labels
    x, y = arrays["x_train"], check(arrays["y_train"], "y_train")
    xv = arrays.get("x_val")
    yv = check(arrays["y_val"], "y_val") if "y_val" in arrays else None
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


def _targets(y: np.ndarray, name: str) -> np.ndarray:
    """Targets of a loss other than sparse cross-entropy: real numbers, (n,) or (n, k)."""
    if y.ndim not in (1, 2) or not np.issubdtype(y.dtype, np.number) or np.iscomplexobj(y):
        raise JobError(
            f"{name} must be real numbers of shape (n,) or (n, k), got {y.dtype} {y.shape}"
        )
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
