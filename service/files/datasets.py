"""Uploaded datasets: ``.npz`` files checked from their array headers alone (shapes and
dtypes, no data loaded and nothing unpickled), then stored under the data directory where
specs name them."""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from service.errors import Conflict, SpecError
from service.files.storage import AlreadyExists, StorageError, Store, check_key

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
REQUIRED = ("x_train", "y_train")
OPTIONAL = ("x_val", "y_val")


@dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: str


def read_headers(path: Path | IO[bytes]) -> dict[str, ArrayInfo]:
    """Shape and dtype of every array in an .npz, read from the .npy headers (a path, or a
    seekable reader of an object in the store)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise SpecError(
            "file", "not_npz", "is not an .npz archive (a zip of .npy arrays)"
        ) from None
    infos: dict[str, ArrayInfo] = {}
    with archive:
        members = archive.infolist()
        if len(members) > len(REQUIRED) + len(OPTIONAL):
            raise SpecError(
                "file",
                "arrays",
                f"holds {len(members)} files; at most x_train, y_train, x_val, y_val",
            )
        for member in members:
            if not member.filename.endswith(".npy"):
                raise SpecError("file", "not_npz", f"holds {member.filename!r}, not an array")
            try:
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    reader = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _fortran, dtype = reader(f)
            except ValueError as exc:
                raise SpecError("file", "not_npz", f"{member.filename}: {exc}") from None
            # A corrupt local header (BadZipFile), an encrypted member (RuntimeError), a
            # compression zipfile lacks (NotImplementedError), a truncated stream (EOFError).
            except (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError, OSError):
                raise SpecError(
                    "file", "not_npz", f"{member.filename} cannot be read as a plain zip member"
                ) from None
            infos[member.filename.removesuffix(".npy")] = ArrayInfo(tuple(shape), str(dtype))
            if dtype.hasobject:
                raise SpecError(
                    "file",
                    "pickle",
                    f"{member.filename} holds Python objects; only numeric arrays are "
                    "accepted (nothing is ever unpickled)",
                )
    return infos


def validate(infos: dict[str, ArrayInfo]) -> None:
    missing = [k for k in REQUIRED if k not in infos]
    if missing:
        raise SpecError("file", "arrays", f"lacks {missing}; has {sorted(infos)}")
    extra = sorted(set(infos) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise SpecError("file", "arrays", f"unexpected arrays {extra}")
    if ("x_val" in infos) != ("y_val" in infos):
        raise SpecError("file", "arrays", "x_val and y_val come together")
    for split in ("train", "val"):
        x, y = infos.get(f"x_{split}"), infos.get(f"y_{split}")
        if x is None or y is None:
            continue
        if len(x.shape) < 2:
            raise SpecError(
                "file", "shape", f"x_{split} needs a sample axis and features, got {x.shape}"
            )
        if not np.issubdtype(np.dtype(x.dtype), np.number) or np.dtype(x.dtype).kind == "c":
            raise SpecError("file", "dtype", f"x_{split} must be real numbers, got {x.dtype}")
        if len(y.shape) not in (1, 2):
            raise SpecError(
                "file",
                "shape",
                f"y_{split} must be labels or targets of shape (n,) or (n, k), got {y.shape}",
            )
        # Integer class labels, or real targets for a regression or multi-label loss; which
        # one a job needs is checked when it trains (its loss says).
        y_dtype = np.dtype(y.dtype)
        if not np.issubdtype(y_dtype, np.number) or y_dtype.kind == "c":
            raise SpecError("file", "dtype", f"y_{split} must be real numbers, got {y.dtype}")
        if x.shape[0] != y.shape[0]:
            raise SpecError(
                "file",
                "shape",
                f"x_{split} has {x.shape[0]} samples but y_{split} has {y.shape[0]}",
            )
    if "x_val" in infos and infos["x_val"].shape[1:] != infos["x_train"].shape[1:]:
        raise SpecError("file", "shape", "x_val samples differ in shape from x_train samples")


def store(
    upload: IO[bytes], *, name: str, owner: str, data: Store, max_bytes: int
) -> tuple[str, dict[str, ArrayInfo], int]:
    """Copy the upload to a temporary file (refusing it past ``max_bytes``), check it, and
    put it in the data store, never over an existing dataset. Returns its key, which specs
    name as ``data.path``."""
    if not NAME.match(name):
        raise SpecError(
            "name", "pattern", "letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    filename = name if name.endswith(".npz") else f"{name}.npz"
    try:
        key = check_key(f"uploads/{owner}/{filename}")
    except StorageError:
        raise SpecError("name", "path", "escapes the data directory") from None
    if data.exists(key):
        raise Conflict(f"dataset {filename} already exists; upload under another name", "name")
    local = data.local_path(key)
    # On a local store the spool sits beside its target, so it is linked into place, not
    # copied; for a remote one it is a local temporary file that is uploaded.
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=local.parent if local else None, suffix=".part")
    tmp = Path(tmp_name)
    try:
        size = 0
        with os.fdopen(fd, "wb") as out:
            while chunk := upload.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise SpecError(
                        "file",
                        "too_large",
                        f"larger than the limit of {max_bytes} bytes (HALFWAY_MAX_UPLOAD_BYTES)",
                    )
                out.write(chunk)
        infos = read_headers(tmp)
        validate(infos)
        if local is not None:
            os.link(tmp, local)  # fails if another upload took the name meanwhile
        else:
            with open(tmp, "rb") as f:
                data.put_stream(key, f, if_absent=True)
    except (FileExistsError, AlreadyExists):
        raise Conflict(
            f"dataset {filename} already exists; upload under another name", "name"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return key, infos, size


def listing(data: Store) -> list[dict[str, Any]]:
    return [{"path": e.key, "bytes": e.size} for e in data.list() if e.key.endswith(".npz")]
