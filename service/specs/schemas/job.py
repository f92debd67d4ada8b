"""The job spec as a whole, the normalized submission, and the sweep spec (one base spec,
several precision variants)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.specs.policies import (
    PolicyName,
)
from service.specs.schemas.base import (
    LEGACY_AMP_ENV,
    LEGACY_AMP_EXPLANATION,
    NAME_PATTERN,
    StrictModel,
)
from service.specs.schemas.model import CodeSpec, DataSpec, MLPModel, ModelSpec, SyntheticData
from service.specs.schemas.precision import LossScaleSpec, PrecisionSpec
from service.specs.schemas.training import (
    FaultsSpec,
    ForensicsSpec,
    GradientsSpec,
    GuardsSpec,
    OptimizerSpec,
    TrainingSpec,
)


class ResourcesSpec(StrictModel):
    gpus: int | Literal["auto"] = Field(
        default="auto",
        json_schema_extra={
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 64},
                {"type": "string", "enum": ["auto"]},
            ]
        },
        description="GPUs the job needs. 'auto': one when the worker has GPUs, else the CPU. "
        "0: CPU only.",
    )

    cpu_replicas: int = Field(
        default=1,
        ge=1,
        le=8,
        description="On a CPU worker, split the CPU into this many logical devices and train "
        "under MirroredStrategy: rehearse a multi-GPU job's data-parallel path without GPUs.",
    )

    @field_validator("gpus")
    @classmethod
    def _gpu_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 0 <= value <= 64:
            raise PydanticCustomError("gpu_range", "gpus must be between 0 and 64, or 'auto'")
        return value


class OutputsSpec(StrictModel):
    save_model: bool = Field(default=True, description="Save the trained model as .keras.")
    tensorboard: bool = Field(
        default=False, description="Also write per-step scalars for TensorBoard."
    )


class JobSpec(StrictModel):
    name: str | None = Field(default=None, min_length=1, max_length=200, pattern=NAME_PATTERN)
    priority: int = Field(default=50, ge=0, le=100, description="Higher runs first.")
    max_attempts: int = Field(default=3, ge=1, le=20)
    preemptible: bool = Field(
        default=True,
        description="A waiting job of higher priority, or of a user far below their share, "
        "may stop this one at a checkpoint; it resumes later exactly (docs/scheduling.md).",
    )
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec)
    model: ModelSpec = Field(default_factory=MLPModel)
    data: DataSpec = Field(default_factory=SyntheticData)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    guards: GuardsSpec = Field(default_factory=GuardsSpec)
    faults: FaultsSpec = Field(default_factory=FaultsSpec)
    forensics: ForensicsSpec = Field(default_factory=ForensicsSpec)
    gradients: GradientsSpec = Field(default_factory=GradientsSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    outputs: OutputsSpec = Field(default_factory=OutputsSpec)
    code: CodeSpec | None = Field(
        default=None,
        description="Your own training code (a bundle's function); model and data must then "
        "be absent.",
    )

    @model_serializer(mode="wrap")
    def _code_replaces_model_and_data(
        self, handler: SerializerFunctionWrapHandler
    ) -> dict[str, Any]:
        # A code job has no model or data section (its function returns them), and a spec
        # without code stores exactly what it stored before code jobs existed.
        out: dict[str, Any] = handler(self)
        if self.code is None:
            out.pop("code", None)
        else:
            out.pop("model", None)
            out.pop("data", None)
        return out

    @model_validator(mode="before")
    @classmethod
    def _legacy_env(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = set(data)
            for env_key in ("env", "environment"):
                env = data.get(env_key)
                if isinstance(env, dict):
                    keys |= set(env)
            if any(str(k).upper() == LEGACY_AMP_ENV for k in keys):
                raise PydanticCustomError("legacy_env_var", LEGACY_AMP_EXPLANATION)
        return data


class SubmitResult(BaseModel):
    """The normalized spec and what Halfway made of it (``dry_run`` returns only this)."""

    spec: JobSpec
    warnings: list[str]
    notes: list[str]


# --------------------------------------------------------------------------------------------
# Sweeps: one base spec, several precision variants, compared side by side


class VariantSpec(StrictModel):
    """What a variant changes in the base spec: its precision and/or loss scaling."""

    name: str | None = Field(default=None, min_length=1, max_length=100, pattern=NAME_PATTERN)
    # Merged into the base's sections, then validated with it; the OpenAPI document gives
    # them the sections' schemas (service/api/openapi.py).
    precision: dict[str, Any] | None = None
    loss_scale: dict[str, Any] | None = None


class SweepSpec(StrictModel):
    # JSON Schema can say "at least one variant, from either list": so it does.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["variants"],
                    "properties": {"variants": {"type": "array", "minItems": 1}},
                },
                {
                    "required": ["policies"],
                    "properties": {"policies": {"type": "array", "minItems": 1}},
                },
            ]
        }
    )

    # Each job is named '<sweep>/<variant>' (variant names are up to 100 characters) and a job
    # name holds at most 200.
    name: str | None = Field(default=None, min_length=1, max_length=99, pattern=NAME_PATTERN)
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="A job spec; every variant uses its model, data, seed and training.",
    )
    variants: list[VariantSpec] = Field(default_factory=list, max_length=20)
    policies: list[PolicyName] | None = Field(
        default=None,
        max_length=10,
        description="Shorthand: one variant per policy name.",
    )
    target_loss: float | None = Field(
        default=None, gt=0, le=1e6, description="Measure each variant's time to this loss."
    )

    @model_validator(mode="after")
    def _some_variants(self) -> SweepSpec:
        if self.policies:
            self.variants = [
                *self.variants,
                *(VariantSpec(name=p, precision={"policy": p}) for p in self.policies),
            ]
            self.policies = None
        if len(self.variants) < 1:
            raise PydanticCustomError(
                "no_variants", "give at least one variant (variants or policies)"
            )
        if len(self.variants) > 20:
            raise PydanticCustomError("too_many_variants", "at most 20 variants")
        return self
