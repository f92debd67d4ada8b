"""Halfway's loss scaler: a Keras 3 ``LossScaleOptimizer`` with the knobs users know from
PyTorch's GradScaler and DeepSpeed/Megatron.

Rules, per training step (``scale`` is the value that multiplied this step's loss):

- all gradients finite: apply the update with gradients divided by ``scale``; count the step;
  after ``growth_steps`` such steps in a row, ``scale = min(scale * growth_factor, max_scale)``,
  the counter goes back to 0 and the hysteresis budget is refilled.
- any gradient non-finite: skip the update; the counter goes back to 0 and one unit of
  hysteresis is spent; once none is left, ``scale = max(scale * backoff_factor, min_scale)``
  (and every further overflow backs off until a growth refills the budget, as in Megatron).
- ``dynamic=False`` (mode ``fixed``): the scale never changes; non-finite updates are still
  skipped.

With the default knobs (x2 after 2000 steps, x0.5, hysteresis 1) this is stock Keras 3's
``LossScaleOptimizer`` step for step (``tests/test_scaler.py`` compares the two); the bounds
only matter where stock Keras would reach 0 or inf. The state (scale, good-step counter,
hysteresis left) is in ``variables``, so checkpoints carry it.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer


class HalfwayLossScaleOptimizer(LossScaleOptimizer):  # type: ignore[misc]
    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        growth_steps: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool = True,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=growth_steps,
            name=name,
            **kwargs,
        )
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and hysteresis >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, hysteresis >= 1")
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError("need min_scale <= initial_scale <= max_scale")
        self.growth_steps = growth_steps
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self.dynamic = dynamic

    def build(self, var_list: list[Any]) -> None:
        super().build(var_list)
        self.hysteresis_left = self.add_variable(
            shape=(),
            dtype="int",
            initializer=keras.initializers.Constant(self.hysteresis),
            aggregation="none",
            name="hysteresis_left",
        )

    @property
    def scale(self) -> Any:
        """The scale variable (``dynamic_scale`` in stock Keras)."""
        return self.dynamic_scale

    # The two handlers run inside ``ops.cond`` on the finite flag; stock Keras decides which
    # to call (and how, under a distribution strategy), we decide what each does.

    def _stateful_handle_finite_grads(self, grads: list[Any], trainable_variables: Any) -> None:
        scale = self.dynamic_scale
        tvs = trainable_variables or self._trainable_variables
        # Divide rather than multiply by 1/scale: that is what stock Keras does, so the
        # weights match it bit for bit.
        unscaled = [
            g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
            for g, v in zip(grads, tvs, strict=False)
        ]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        if not self.dynamic:
            return

        def grow() -> None:
            self.step_counter.assign(0)
            self.hysteresis_left.assign(self.hysteresis)
            self.dynamic_scale.assign(
                ops.minimum(ops.multiply(self.dynamic_scale, self.growth_factor), self.max_scale)
            )

        def count() -> None:
            self.step_counter.assign_add(1)

        ops.cond(ops.equal(self.step_counter, self.growth_steps - 1), grow, count)

    def _stateful_handle_non_finite_grads(self) -> None:
        if not self.dynamic:
            return
        self.step_counter.assign(0)
        self.hysteresis_left.assign_sub(1)

        def back_off() -> None:
            self.dynamic_scale.assign(
                ops.maximum(ops.multiply(self.dynamic_scale, self.backoff_factor), self.min_scale)
            )

        def tolerate() -> None:
            pass

        ops.cond(ops.less_equal(self.hysteresis_left, 0), back_off, tolerate)

    def apply_and_check(
        self, grads: list[Any], trainable_variables: list[Any], finite: Any = None
    ) -> Any:
        """Apply (or skip) the update and return the finite flag it was decided on, so the
        step recorder reuses it instead of checking every gradient a second time. A caller
        that already checked (``finite``) saves the check on one device; across replicas each
        replica's flag is recomputed inside the cross-replica decision."""
        if not self.built:  # type: ignore[has-type]
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            if finite is None:
                finite = self.check_finite(grads)
            ops.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(grads, trainable_variables),
                self._stateful_handle_non_finite_grads,
            )
            return finite

        def cross_replica(distribution: Any, grads: Any, tvs: Any) -> Any:
            per_replica = distribution.extended.call_for_each_replica(
                self.check_finite, args=(grads,)
            )
            # Every replica must be finite (stock Keras looks at the first replica only).
            finite = tf.reduce_all(tf.stack(distribution.experimental_local_results(per_replica)))

            def apply() -> None:
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, tvs)
                )

            ops.cond(finite, apply, self._stateful_handle_non_finite_grads)
            return finite

        return tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(grads, trainable_variables)
        )

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        self.apply_and_check(grads, trainable_variables or self._trainable_variables)

    def stateless_apply(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Halfway's scaler runs on the TensorFlow backend only")

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.pop("dynamic_growth_steps", None)
        config.update(
            growth_steps=self.growth_steps,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
            dynamic=self.dynamic,
        )
        return config


def make_scaler(
    inner: keras.optimizers.Optimizer, loss_scale: dict[str, Any]
) -> HalfwayLossScaleOptimizer | None:
    """The scaler a spec's ``loss_scale`` section asks for (mode already resolved), or None."""
    mode = loss_scale["mode"]
    if mode == "none":
        return None
    return HalfwayLossScaleOptimizer(
        inner,
        initial_scale=loss_scale["initial_scale"],
        growth_steps=loss_scale["growth_steps"],
        growth_factor=loss_scale["growth_factor"],
        backoff_factor=loss_scale["backoff_factor"],
        min_scale=loss_scale["min_scale"],
        max_scale=loss_scale["max_scale"],
        hysteresis=loss_scale["hysteresis"],
        dynamic=mode == "dynamic",
        name="halfway_loss_scale_optimizer",
    )
