"""The tf backend: tf.distribute's MirroredStrategy (several replicas in one process) or
MultiWorkerMirroredStrategy (one process per worker), driven by a custom loop.
Importing this package does not import tensorflow."""
