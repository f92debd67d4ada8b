"""Workers: the supervisor (no TensorFlow) and the training child (the only TensorFlow code)."""
