"""What Halfway makes of a valid spec: the normalized form that runs, its warnings and notes,
and the checks that need the server's settings (limits, the data directory)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, Literal

from service.errors import FieldErrors, NotFound, SpecError
from service.files import code, codestore, datasets
from service.files.storage import StorageError, Store, check_key, open_storage
from service.settings import Settings
from service.specs.policies import AUTO, AUTO_CANDIDATES, POLICIES, loss_scale_mode_for
from service.specs.schemas import (
    KERAS_DATASET_SHAPES,
    REGRESSION_LOSSES,
    CNNModel,
    ImageDirectoryData,
    JobSpec,
    KerasData,
    KerasModel,
    MLPModel,
    NpzData,
    SubmitResult,
    SyntheticData,
    TransformerModel,
)

KERAS_TRAIN_SIZES = {"mnist": 60_000, "fashion_mnist": 60_000, "cifar10": 50_000}


def normalize(spec: JobSpec, settings: Settings) -> SubmitResult:
    """Resolve defaults that depend on other fields, check limits, and explain mappings."""
    warnings: list[str] = []
    notes: list[str] = []
    if spec.code is not None:
        check_code(spec, settings)
    spec = spec.model_copy(deep=True)
    ls = spec.loss_scale
    if ls.dynamic is not None:
        mode: Literal["dynamic", "fixed"] = "dynamic" if ls.dynamic else "fixed"
        notes.append(
            f"loss_scale.dynamic={str(ls.dynamic).lower()} (the TF 2.3 experimental "
            f"LossScaleOptimizer argument) maps to loss_scale.mode '{mode}'."
            + (
                " Keras 3 has no dynamic=False; Halfway's fixed mode keeps the scale constant "
                "and still skips non-finite updates."
                if not ls.dynamic
                else ""
            )
        )
        ls.mode = mode
        ls.dynamic = None
    if spec.precision.policy == AUTO:
        notes.append(_auto_note(spec))
    else:
        _precision_warnings(spec, warnings, notes)
    if spec.precision.graph_rewrite:
        notes.append(
            "precision.graph_rewrite turns on TensorFlow's grappler rewrite for this job "
            "('auto_mixed_precision' on GPU, 'auto_mixed_precision_onednn_bfloat16' on CPU): "
            "the TF 2 equivalent of TF_ENABLE_AUTO_MIXED_PRECISION=1. It has no loss scaling "
            "of its own; Halfway's scaler applies if loss_scale.mode asks for it."
        )

    if spec.code is None:
        _check_loss(spec)
        _check_model_and_data(spec, settings, notes)
    else:
        notes.append(
            f"code job: {spec.code.entrypoint} from bundle {spec.code.bundle[:19]}... runs in "
            "the training child under this job's policy; its model trains with Halfway's "
            "loss scaler and every step recorded."
        )
    steps_per_epoch = planned_steps_per_epoch(spec)
    if steps_per_epoch is not None:
        total = steps_per_epoch * spec.training.epochs
        if total > settings.max_total_steps:
            raise SpecError(
                "training.epochs",
                "limit",
                f"{spec.training.epochs} epochs of {steps_per_epoch} steps is {total} steps; "
                f"the server's limit is {settings.max_total_steps} (HALFWAY_MAX_TOTAL_STEPS)",
            )
        late = [s for s in spec.faults.nonfinite_at_steps if s >= total]
        if late:
            warnings.append(
                f"faults.nonfinite_at_steps {late[:5]} lie beyond the run's {total} steps "
                "and will never fire."
            )
    if spec.name is None:
        kind = spec.code.entrypoint.rpartition(":")[2] if spec.code else spec.model.kind
        spec.name = f"{kind}-{spec.precision.policy}"
    return SubmitResult(spec=spec, warnings=warnings, notes=notes)


def _precision_warnings(spec: JobSpec, warnings: list[str], notes: list[str]) -> None:
    """Resolve loss_scale.mode 'auto' for a concrete policy, and warn about the dtype facts
    that make a combination risky or pointless."""
    policy = spec.precision.policy
    facts = POLICIES[policy]
    ls = spec.loss_scale
    if ls.mode == "auto":
        ls.mode = loss_scale_mode_for(ls.mode, facts.compute_dtype)
        notes.append(f"loss_scale.mode 'auto' is '{ls.mode}' for {facts.compute_dtype} compute.")
    if facts.compute_dtype == "float16" and ls.mode == "none":
        warnings.append(
            "float16 compute without loss scaling: gradients smaller than about 6e-8 "
            "underflow to zero and large ones overflow to inf. Use loss_scale.mode 'dynamic' "
            "unless you are rehearsing exactly this."
        )
    if facts.compute_dtype != "float16" and ls.mode in ("dynamic", "fixed"):
        warnings.append(
            f"loss scaling with {facts.compute_dtype} compute is allowed but not needed: "
            f"{facts.compute_dtype} has float32's exponent range."
        )
    if policy in ("float16", "bfloat16"):
        warnings.append(
            f"policy '{policy}' keeps the variables in {facts.variable_dtype} too, so small "
            f"updates round away; 'mixed_{policy}' keeps float32 variables."
        )


def _auto_note(spec: JobSpec) -> str:
    """What policy 'auto' will do; the policy and loss_scale.mode stay 'auto' in the spec,
    since only the probes, in the training child, can resolve them."""
    probe = spec.precision.probe
    mode = spec.loss_scale.mode
    scaling = (
        "loss_scale.mode 'auto' then becomes 'dynamic' if mixed_float16 is chosen and 'none' "
        "otherwise."
        if mode == "auto"
        else f"Every candidate, and the training, uses loss_scale.mode '{mode}'."
    )
    return (
        f"policy 'auto': before training, the job probes {', '.join(AUTO_CANDIDATES)} for "
        f"{probe.warmup} + {probe.steps} steps each (precision.probe.warmup + steps) from the "
        "same initial weights on the same batches, and trains with the fastest candidate whose "
        f"mean loss differs from float32's by at most {probe.loss_tolerance:g} of it "
        f"(loss_tolerance) and whose lost_share stays at most {probe.max_lost_share:g} "
        f"(max_lost_share); a mixed policy must also be {probe.min_speedup:g}x as fast as "
        "float32 (min_speedup). The probes are not part of the step history; the choice and "
        "the probe table are recorded as the job's precision_decision. " + scaling
    )


def planned_steps_per_epoch(spec: JobSpec) -> int | None:
    """Steps per epoch when the data size is known before training (None for npz)."""
    if spec.training.steps_per_epoch is not None:
        return spec.training.steps_per_epoch
    if spec.code is not None:
        return None  # the function's pipeline is known only in the child
    data = spec.data
    if isinstance(data, SyntheticData):
        samples = data.samples
    elif isinstance(data, KerasData):
        samples = min(KERAS_TRAIN_SIZES[data.name], data.max_samples or 10**12)
    else:
        return None
    train = samples - int(samples * spec.training.validation_split)
    return max(1, math.ceil(train / spec.training.batch_size))


def _check_model_and_data(spec: JobSpec, settings: Settings, notes: list[str]) -> None:
    model, data = spec.model, spec.data
    if isinstance(data, SyntheticData):
        elements = data.samples * data.features
        if elements > settings.max_dataset_elements:
            raise SpecError(
                "data.samples",
                "limit",
                f"{data.samples} samples x {data.features} features is {elements} values; "
                f"the limit is {settings.max_dataset_elements} (HALFWAY_MAX_DATASET_ELEMENTS)",
            )
        train = data.samples - int(data.samples * spec.training.validation_split)
        if train < 1:
            raise SpecError("training.validation_split", "too_large", "leaves no training samples")
        features, classes = data.features, data.classes
    elif isinstance(data, KerasData):
        shape, classes = KERAS_DATASET_SHAPES[data.name]
        features = math.prod(shape)
    elif isinstance(data, ImageDirectoryData):
        classes = len(_image_classes(data, settings))
        features = data.image_size[0] * data.image_size[1] * data.channels
    else:
        _check_data_path(data, settings)
        features = classes = -1  # known only when the child opens the file
    if spec.training.loss.name in (*REGRESSION_LOSSES, "binary_crossentropy"):
        classes = -1  # targets (or labels per output), not classes: the width is the model's

    if isinstance(model, KerasModel):
        return  # its shapes and size are known once Keras builds it, in the child
    needed, field = _model_input(model)
    if features >= 0 and needed != features:
        raise SpecError(
            f"model.{field}",
            "shape_mismatch",
            f"the model takes {needed} values per sample but the data has {features}",
        )
    if classes >= 0 and model.num_classes != classes:
        raise SpecError(
            "model.num_classes",
            "shape_mismatch",
            f"{model.num_classes} does not match the data's {classes} classes",
        )
    params = model.parameter_count()
    if params > settings.max_parameters:
        raise SpecError(
            "model",
            "limit",
            f"the model has {params} parameters; the server's limit is "
            f"{settings.max_parameters} (HALFWAY_MAX_PARAMETERS)",
        )
    if isinstance(data, KerasData) and isinstance(model, MLPModel):
        notes.append(f"{data.name} images are flattened to {features} features for mlp.")
    if isinstance(data, SyntheticData) and not isinstance(model, MLPModel):
        notes.append(
            f"synthetic samples ({features} features) are reshaped to the model's input "
            f"{_shape_text(model)}."
        )


def check_code(spec: JobSpec, settings: Settings) -> None:
    """A code job: no model or data section, and the bundle holds the entry point (parsed,
    never imported)."""
    assert spec.code is not None
    present = [f for f in ("model", "data") if f in spec.model_fields_set]
    if present:
        raise FieldErrors(
            [
                {
                    "field": f,
                    "rule": "not_with_code",
                    "message": f"{f} must be absent in a code job: the function in "
                    "code.entrypoint returns the model and the data",
                }
                for f in present
            ]
        )
    store = open_storage(settings.storage_config()).code
    try:
        root = codestore.local_tree(store, settings.resolved_code_dir(), spec.code.bundle)
    except NotFound as exc:
        raise SpecError("code.bundle", "not_found", exc.message) from None
    except codestore.BundleCorrupt as exc:
        raise SpecError("code.bundle", "corrupt", exc.message) from None
    code.check_entrypoint(root, spec.code.entrypoint)


def _check_loss(spec: JobSpec) -> None:
    loss = spec.training.loss.name
    model = spec.model
    if isinstance(model, KerasModel):
        return
    if loss not in (*REGRESSION_LOSSES, "binary_crossentropy") and model.num_classes < 2:
        raise SpecError(
            "model.num_classes",
            "too_small",
            f"{loss} needs at least 2 classes; num_classes 1 is for regression losses "
            f"({', '.join(REGRESSION_LOSSES)})",
        )


def _image_classes(data: ImageDirectoryData, settings: Settings) -> list[str]:
    """The class sub-folders of an image_directory (listed, nothing read)."""
    root = settings.resolved_data_dir()
    if "\x00" in data.path:
        raise SpecError("data.path", "path", "contains a NUL byte")
    folder = (root / data.path).resolve()
    if not folder.is_relative_to(root):
        raise SpecError(
            "data.path", "outside_data_dir", "must name a folder inside the data directory"
        )
    if not folder.is_dir():
        raise SpecError(
            "data.path", "not_found", f"no such folder in the data directory: {data.path}"
        )
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise SpecError(
            "data.path",
            "classes",
            f"{data.path} needs a sub-folder per class (at least 2); it has {len(classes)}",
        )
    return classes


def _model_input(model: MLPModel | CNNModel | TransformerModel) -> tuple[int, str]:
    """Values per sample the model takes, and the field that sets it."""
    if isinstance(model, MLPModel):
        return model.input_size, "input_size"
    if isinstance(model, CNNModel):
        return math.prod(model.input_shape), "input_shape"
    return model.sequence_length * model.features, "sequence_length"


def _shape_text(model: CNNModel | TransformerModel) -> str:
    if isinstance(model, CNNModel):
        return "x".join(str(d) for d in model.input_shape)
    return f"{model.sequence_length}x{model.features}"


def _check_data_path(data: NpzData, settings: Settings) -> None:
    store = open_storage(settings.storage_config()).data
    root = store.local_root()
    path = resolve_data_path(data.path, root) if root is not None else _object(data.path, store)
    try:
        # Only the .npy headers are read, nothing is unpickled: a file that is no archive of
        # plain arrays (a renamed pickle, object arrays) never reaches a worker. Whether the
        # arrays fit together is the worker's check, on the file it actually opens.
        datasets.read_headers(path)
    except SpecError as exc:
        raise SpecError("data.path", exc.rule, f"{data.path}: {exc.detail}") from None


def _object(relative: str, store: Store) -> IO[bytes]:
    """The object a spec names in a remote data store, as a reader of its headers."""
    try:
        key = check_key(relative)
    except StorageError:
        raise SpecError(
            "data.path", "outside_data_dir", "must name a file inside the data directory"
        ) from None
    if not key.endswith(".npz"):
        raise SpecError("data.path", "npz", "must name an .npz file")
    if not store.exists(key):
        raise SpecError("data.path", "not_found", f"no such file in the data store: {relative}")
    return store.open_reader(key)


def resolve_data_path(relative: str, data_dir: Path) -> Path:
    """The file a spec names, refusing anything that resolves outside the data directory
    (``..``, absolute paths, symlinks pointing out)."""
    if "\x00" in relative:
        raise SpecError("data.path", "path", "contains a NUL byte")
    root = data_dir.resolve()
    candidate = (root / relative).resolve()
    if not candidate.is_relative_to(root):
        raise SpecError(
            "data.path", "outside_data_dir", "must name a file inside the data directory"
        )
    if candidate.suffix != ".npz":
        raise SpecError("data.path", "npz", "must name an .npz file")
    if not candidate.is_file():
        raise SpecError("data.path", "not_found", f"no such file in the data directory: {relative}")
    return candidate
