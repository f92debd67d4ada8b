"""A team's own regression model: a custom layer, a Functional model, a tf.data pipeline
over TFRecord files. Plain Keras and TensorFlow: nothing here knows about Halfway."""
