"""What users write: the job spec and the sweep spec (pydantic, ``extra="forbid"``, JSON's
types strictly), and the normalized submission. The API's answers are in service/api/responses.py.

The spec speaks the language of TensorFlow's mixed-precision guide (policies, loss scaling)
and accepts the forms older guides teach, mapping each to what Keras 3 does; every mapping
is reported back in the response's ``notes``.

Grouped by what a user writes, each module a part of the spec:

- ``base``: what every input model shares (strict JSON types, names);
- ``precision``: the policy, explicit dtypes, ``auto`` and its probes, and the loss scaling;
- ``model``: the preset models, a Keras config, the team's own code, and the data;
- ``training``: the optimizer and schedule, the loss and metrics, the epochs, and what a job
  watches (faults, guards, forensics, gradients);
- ``job``: the job spec as a whole, the normalized submission and the sweep spec.
"""

from service.specs.schemas.base import (
    LEGACY_AMP_ENV,
    LEGACY_AMP_EXPLANATION,
    MAX_INT32,
    NAME_PATTERN,
    StrictModel,
)
from service.specs.schemas.job import (
    JobSpec,
    OutputsSpec,
    ResourcesSpec,
    SubmitResult,
    SweepSpec,
    VariantSpec,
)
from service.specs.schemas.model import (
    ENTRYPOINT,
    KERAS_DATASET_SHAPES,
    MAX_CODE_ARGS_BYTES,
    Activation,
    CNNModel,
    CodeSpec,
    DataSpec,
    ImageDirectoryData,
    KerasData,
    KerasModel,
    MLPModel,
    ModelSpec,
    NpzData,
    SyntheticData,
    TransformerModel,
)
from service.specs.schemas.precision import (
    DtypePair,
    LossScaleSpec,
    PolicyField,
    PrecisionSpec,
    ProbeSpec,
)
from service.specs.schemas.training import (
    LOSS_ALIASES,
    LOSS_ARGUMENTS,
    REGRESSION_LOSSES,
    FaultsSpec,
    ForensicsSpec,
    GradientsSpec,
    GuardsSpec,
    LossName,
    LossSpec,
    MetricName,
    OptimizerSpec,
    ScheduleSpec,
    TrainingSpec,
)

__all__ = [
    "ENTRYPOINT",
    "KERAS_DATASET_SHAPES",
    "LEGACY_AMP_ENV",
    "LEGACY_AMP_EXPLANATION",
    "LOSS_ALIASES",
    "LOSS_ARGUMENTS",
    "MAX_CODE_ARGS_BYTES",
    "MAX_INT32",
    "NAME_PATTERN",
    "REGRESSION_LOSSES",
    "Activation",
    "CNNModel",
    "CodeSpec",
    "DataSpec",
    "DtypePair",
    "FaultsSpec",
    "ForensicsSpec",
    "GradientsSpec",
    "GuardsSpec",
    "ImageDirectoryData",
    "JobSpec",
    "KerasData",
    "KerasModel",
    "LossName",
    "LossScaleSpec",
    "LossSpec",
    "MLPModel",
    "MetricName",
    "ModelSpec",
    "NpzData",
    "OptimizerSpec",
    "OutputsSpec",
    "PolicyField",
    "PrecisionSpec",
    "ProbeSpec",
    "ResourcesSpec",
    "ScheduleSpec",
    "StrictModel",
    "SubmitResult",
    "SweepSpec",
    "SyntheticData",
    "TrainingSpec",
    "TransformerModel",
    "VariantSpec",
]
