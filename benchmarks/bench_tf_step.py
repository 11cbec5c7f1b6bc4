"""Step time of crosstrain's tf backend against a hand-written TensorFlow/Keras loop, in the same run.

    python benchmarks/bench_tf_step.py [--device cpu|gpu] [--precision fp32|bf16] [--steps N]

Both sides train the same MLP (same weights, same batch, Adam) in one process. crosstrain
runs as its workers do: a MirroredStrategy over one device (``--distribution default``
takes TensorFlow's default strategy instead). The native loop is a Keras model, a Keras
Adam and a ``tf.function`` step with a GradientTape. The fair native variant does what
crosstrain does each step: takes the batch from host numpy and reads the loss. Two more
keep the batch in a device tensor, with and without reading the loss, to show where time
goes. Prints milliseconds per step and the ratio crosstrain / native.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np

from _shared import add_size_arguments, make_plan, print_report, timed
from crosstrain.backends.tf.launch import TF_ENVIRONMENT
from crosstrain.backends.tf.strategy import TfStrategy
from crosstrain.core.data.batches import Batch, StepBatch
from crosstrain.core.model.layers import Dense, layer_name
from crosstrain.core.run.job import World
from crosstrain.core.run.loop import initial_weights
from crosstrain.core.spec.plan import Plan

# before TensorFlow is imported (inside main): quiet logs, no oneDNN, Keras config off $HOME
os.environ.update(TF_ENVIRONMENT)
os.environ.setdefault("KERAS_HOME", os.path.join(tempfile.gettempdir(), "crosstrain-bench-keras"))


def configure(device: str) -> Any:
    """Devices and threads, before any TensorFlow op; returns the tensorflow module."""
    import tensorflow as tf

    if device == "gpu":
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    else:  # one thread, as the torch benchmark; and no GPU for either side
        tf.config.set_visible_devices([], "GPU")
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def native_model(plan: Plan, weights: dict[str, np.ndarray]) -> Any:
    """The plan's MLP written directly in Keras, holding the same initial weights."""
    import keras

    dtype = "mixed_bfloat16" if plan.train.precision == "bf16" else "float32"
    layers: list[Any] = [keras.Input(shape=plan.model.input_shape)]
    for index, layer in enumerate(plan.model.layers):
        name = layer_name(layer, index)
        if isinstance(layer, Dense):
            layers.append(keras.layers.Dense(layer.units, name=name, dtype=dtype))
        else:
            layers.append(keras.layers.ReLU(name=name, dtype=dtype))
    model = keras.Sequential(layers)
    for index, layer in enumerate(plan.model.layers):
        name = layer_name(layer, index)
        if isinstance(layer, Dense):
            model.get_layer(name).set_weights([weights[f"{name}.kernel"], weights[f"{name}.bias"]])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, choices=("cpu", "gpu"), help="default: gpu if visible")
    parser.add_argument("--distribution", default="mirrored", choices=("mirrored", "default"))
    add_size_arguments(parser)
    args = parser.parse_args()
    import tensorflow as tf

    device = args.device or ("gpu" if tf.config.list_physical_devices("GPU") else "cpu")
    tf = configure(device)
    import keras

    plan = make_plan(args.width, args.depth, args.batch, args.precision)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch)
    weight = np.ones(args.batch, np.float32)

    def sync() -> None:
        if device == "gpu":
            tf.test.experimental.sync_devices()

    distribution = (
        tf.distribute.MirroredStrategy(devices=[f"/{device}:0"]) if args.distribution == "mirrored" else None
    )
    strategy = TfStrategy(World(device=device), distribution=distribution)
    state = strategy.build(plan, initial_weights(plan))
    step_batch = StepBatch((Batch(x, y, weight),), global_real_rows=args.batch)
    crosstrain_ms = timed(lambda: strategy.train_step(state, step_batch, 1e-3), args.steps, sync)

    model = native_model(plan, initial_weights(plan))
    spec = plan.optimizer
    optimizer = keras.optimizers.Adam(
        learning_rate=spec.lr, beta_1=spec.beta1, beta_2=spec.beta2, epsilon=spec.eps
    )
    optimizer.build(model.trainable_variables)
    with tf.device(f"/{device}:0"):
        xt, yt = tf.constant(x), tf.constant(y)

    def native_step_body(inputs: Any, targets: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = tf.cast(model(inputs, training=True), tf.float32)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    native_train = tf.function(native_step_body)

    def native_step(read_loss: bool, from_host: bool = False) -> None:
        loss = native_train(x, y) if from_host else native_train(xt, yt)
        if read_loss:
            float(loss)

    native_host_ms = timed(lambda: native_step(True, from_host=True), args.steps, sync)
    native_ms = timed(lambda: native_step(True), args.steps, sync)
    native_nosync_ms = timed(lambda: native_step(False), args.steps, sync)
    gpus = tf.config.list_physical_devices("GPU")
    name = (
        tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")
        if device == "gpu" and gpus
        else "cpu (1 thread)"
    )
    header = (
        f"device {name}  precision {args.precision}  MLP {args.depth}x{args.width}  batch {args.batch}"
        f"  distribution {args.distribution}  tensorflow {tf.__version__}"
    )
    print_report(header, crosstrain_ms, native_host_ms, native_ms, native_nosync_ms)


if __name__ == "__main__":
    main()
