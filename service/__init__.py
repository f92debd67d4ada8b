"""Halfway's API service: FastAPI app, schemas, ORM models, job state machine, history, CLI.
Never imports TensorFlow or Keras."""
