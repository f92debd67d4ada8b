"""The Python client's DataFrames that are built from the server's answers (a sweep's
comparison and a job's per-epoch metrics from JSON, a job's gradient samples from Parquet),
and the one check that pandas is there (``halfway[client]``). pandas is imported only when a
frame is asked for: the CLI never needs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.client.errors import ServerError
from service.vocabulary import GRADIENT_FIGURES, GRADIENT_MODEL_ROW

if TYPE_CHECKING:
    import pandas


# A sweep's columns that are not numbers, and the numbers that are counts.
SWEEP_TEXT = ("name", "status", "error", "policy", "loss_scale_mode")
SWEEP_COUNTS = ("job_id", "overflow_count", "skipped_steps")

GRADIENT_COLUMNS = ("step", "variable", "loss_scale", "shadow", "finite", *GRADIENT_FIGURES)
MODEL_ROW = GRADIENT_MODEL_ROW


def sweep_frame(table: Mapping[str, Any]) -> pandas.DataFrame:
    """A sweep's JSON as a DataFrame: a row per variant, indexed by the variant's own name
    (its job is named "<sweep>/<variant>"); a column per comparison field, each of the last
    epoch's metrics as ``final_<name>`` (``final_val_loss``; NaN where a variant has none);
    every number a float64 (NaN where the server had none) but the counts (int64).
    ``attrs``: the sweep's ``sweep_id``, ``name``, ``target_loss`` and ``done``."""
    require_pandas("Client.sweep()")
    import pandas as pd

    prefix = f"{table['name']}/"
    rows = []
    for variant in table["variants"]:
        row = {k: v for k, v in variant.items() if k != "final_metrics"}
        row["variant"] = variant["name"].removeprefix(prefix)
        for key, value in (variant.get("final_metrics") or {}).items():
            row.setdefault(f"final_{key}", value)
        rows.append(row)
    frame = pd.DataFrame(rows).set_index("variant")
    frame = frame.astype(
        {
            column: "int64" if column in SWEEP_COUNTS else "float64"
            for column in frame.columns
            if column not in SWEEP_TEXT
        }
    )
    frame.attrs.update(
        sweep_id=table["id"],
        name=table["name"],
        target_loss=table.get("target_loss"),
        done=bool(table["done"]),
    )
    return frame


def gradients_frame(parquet: bytes) -> pandas.DataFrame:
    """The server's long table of gradient samples (Parquet) as a DataFrame: one row per
    sampled step and variable, the whole model's as ``variable == "(model)"``; columns
    ``GRADIENT_COLUMNS``, step as int64, the flags as bool, the scale and every figure as
    float64 (NaN where undefined, as on steps without the float32 shadow)."""
    require_pandas("Client.gradients()")
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pq.read_table(pa.BufferReader(parquet)).to_pandas()
    missing = [column for column in GRADIENT_COLUMNS if column not in frame.columns]
    if missing:
        raise ServerError(f"the server's gradient table lacks the columns {', '.join(missing)}")
    typed: pd.DataFrame = frame[list(GRADIENT_COLUMNS)].astype(
        {
            "step": "int64",
            "variable": "object",
            "loss_scale": "float64",
            "shadow": "bool",
            "finite": "bool",
            **dict.fromkeys(GRADIENT_FIGURES, "float64"),
        }
    )
    return typed


def metrics_frame(page: Mapping[str, Any]) -> pandas.DataFrame:
    """The server's per-epoch metrics (JSON) as a DataFrame: a row per epoch, indexed by the
    0-based ``epoch``, a float64 column per metric in the order they first appear (NaN where
    an epoch lacks one, or the server had null)."""
    require_pandas("Client.metrics()")
    import pandas as pd

    epochs = [int(e["epoch"]) for e in page["epochs"]]
    rows = [e["metrics"] for e in page["epochs"]]
    frame = pd.DataFrame(rows, index=pd.Index(epochs, name="epoch", dtype="int64"))
    return frame.astype("float64")


def require_pandas(method: str) -> None:
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{method} returns a pandas DataFrame; install pandas with: "
            "pip install 'halfway[client]'"
        ) from None
