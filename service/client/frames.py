"""The Python client's DataFrames that are built from JSON (a sweep's comparison), and the
one check that pandas is there (``halfway[client]``). pandas is imported only when a frame is
asked for: the CLI never needs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas


# A sweep's columns that are not numbers, and the numbers that are counts.
SWEEP_TEXT = ("name", "status", "error", "policy", "loss_scale_mode")
SWEEP_COUNTS = ("job_id", "overflow_count", "skipped_steps")


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


def require_pandas(method: str) -> None:
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{method} returns a pandas DataFrame; install pandas with: "
            "pip install 'halfway[client]'"
        ) from None
