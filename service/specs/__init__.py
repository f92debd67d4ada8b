"""What users write and what Halfway makes of it: ``schemas`` (the job and sweep specs,
pydantic), ``normalization.normalize`` (the form that runs, its warnings, the server-side
checks), ``modelconfig`` (a Keras config checked before anyone deserializes it) and ``policies``
(dtype policies' static facts)."""
