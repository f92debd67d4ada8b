"""What every input model shares: strict JSON types, integral numbers as integers, names
for people, and the legacy variable older guides set."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)

LEGACY_AMP_ENV = "TF_ENABLE_AUTO_MIXED_PRECISION"
LEGACY_AMP_EXPLANATION = (
    "TF_ENABLE_AUTO_MIXED_PRECISION does nothing in TensorFlow 2.x. For Keras mixed precision "
    "set precision.policy (e.g. 'mixed_float16', which is what Halfway runs by default, with "
    "dynamic loss scaling). For TensorFlow's graph rewrite, the TF 2 equivalent of that "
    "variable (grappler's 'auto_mixed_precision'), set precision.graph_rewrite: true with "
    "precision.policy 'float32'."
)

MAX_INT32 = 2**31 - 1

# Names are labels for people: no control characters (PostgreSQL text cannot even hold NUL).
NAME_PATTERN = r"^[^\x00-\x1f\x7f]*$"


def _int_kind(annotation: Any) -> Literal["int", "list"] | None:
    """Whether a field takes an integer, or a list of integers."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _int_kind(get_args(annotation)[0])
    if annotation is int:
        return "int"
    if origin is list:
        return "list" if _int_kind(get_args(annotation)[0]) == "int" else None
    if origin in (Union, types.UnionType):
        kinds = {_int_kind(a) for a in get_args(annotation)}
        return "int" if "int" in kinds else "list" if "list" in kinds else None
    return None


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


class StrictModel(BaseModel):
    """Input models: unknown fields and NaN/Infinity are refused, and types are JSON's own.
    Pydantic's lax mode reads ``false`` as 0, ``"5"`` as 5 and ``1`` as true; in a JSON body
    each of those is a client's mistake, so it is a 422 naming the field (strict mode; a
    nested object may still be given as a JSON object). JSON has one number type, and JSON
    Schema calls 29.0 an integer, so an integer field takes 29.0 (as 29), never 29.5."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, field in cls.model_fields.items():
            if name not in data:
                continue
            kind = _int_kind(field.annotation)
            if kind == "int":
                fixed[name] = _integral(data[name])
            elif kind == "list" and isinstance(data[name], list):
                fixed[name] = [_integral(v) for v in data[name]]
        return fixed
