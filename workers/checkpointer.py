"""A job's checkpoints in the training child: the model's and optimizer's variables, the loss
scaler's state and the run's progress in one .npz per step. Only numpy is needed to write and
read the format (the variables are TensorFlow's, but this module never imports it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.checkpoints import checkpoint_path
from workers.protocol import JobError

if TYPE_CHECKING:
    from workers.recording import HalfwayTrainer


class Checkpointer:
    """The model's variables, optimizer state (the loss scaler's included) at a global step,
    one .npz per step (``checkpoint-<step>.npz``), each written atomically. The data position
    follows from the step, since every epoch has the same number of steps and its batch order
    is a function of (seed, epoch).

    The model's ``variables``, not just its ``weights``: they include the dropout layers'
    seed-generator states, without which a resumed job would replay the masks of step 0
    instead of continuing as the uninterrupted run does.

    One file per step because the child may checkpoint ahead of the history the supervisor
    has committed; a job resumes from the checkpoint the supervisor acknowledged (it commits
    that step together with the history before it), never from a newer one whose rows may
    have died with a killed supervisor. The child only writes the file into its scratch
    folder: its host (``workers.staging``) commits it to the store and deletes superseded
    ones."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, step: int) -> Path:
        return checkpoint_path(self.directory, step)

    def save(self, trainer: HalfwayTrainer, step: int, progress: Progress | None = None) -> None:
        arrays: dict[str, np.ndarray] = {}
        for i, w in enumerate(trainer.inner.variables):
            arrays[f"w{i}"] = np.asarray(w.numpy())
        for i, v in enumerate(trainer.optimizer.variables):
            arrays[f"o{i}"] = np.asarray(v.numpy())
        if progress is not None:
            arrays["progress"] = np.asarray(json.dumps(progress.counters))
            arrays["guard_window"] = np.asarray(progress.guard_window, dtype=bool)
        target = self.path(step)
        tmp = target.with_name(target.name + ".part")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def restore(self, trainer: HalfwayTrainer, step: int) -> Progress | None:
        """Load the checkpoint into the trainer; its progress (None in an older one)."""
        with np.load(self.path(step), allow_pickle=False) as f:
            model_vars, opt_vars = trainer.inner.variables, trainer.optimizer.variables
            if sum(k.startswith("w") for k in f.files) != len(model_vars) or sum(
                k.startswith("o") for k in f.files
            ) != len(opt_vars):
                raise JobError("the checkpoint does not match this job's model and optimizer")
            for i, w in enumerate(model_vars):
                w.assign(f[f"w{i}"])
            for i, v in enumerate(opt_vars):
                v.assign(f[f"o{i}"])
            if "progress" not in f.files:
                return None
            return Progress(json.loads(str(f["progress"])), f["guard_window"].tolist())


@dataclass
class Progress:
    """What a resumed attempt must continue rather than start again, besides the weights:
    the guards' runs, the target-loss window, the step and time the target was reached, and
    when the first attempt started training (so time to target spans attempts)."""

    counters: dict[str, Any]
    guard_window: list[bool]
