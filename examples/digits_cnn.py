"""A small CNN on the digits, written as a Python plan (the same vocabulary as a .toml plan).

crosstrain run examples/digits_cnn.py --backend torch --nproc 2
crosstrain run examples/digits_cnn.py --backend tf    --nproc 2
"""

from crosstrain import (
    Conv2D,
    DataSpec,
    Dense,
    Flatten,
    MaxPool2D,
    ModelSpec,
    OptimizerSpec,
    Plan,
    ReLU,
    ScheduleSpec,
    TrainSpec,
)

plan = Plan(
    name="digits_cnn",
    seed=0,
    model=ModelSpec(
        input_shape=(8, 8, 1),  # channels-last: the 64 pixels of each digit as an 8x8 image
        layers=(
            Conv2D(filters=16, kernel_size=3, padding="same"),
            ReLU(),
            MaxPool2D(pool_size=2),
            Conv2D(filters=32, kernel_size=3),
            ReLU(),
            Flatten(),  # NHWC order on every backend
            Dense(units=64),
            ReLU(),
            Dense(units=10),
        ),
    ),
    data=DataSpec(source="digits", eval_fraction=0.2),
    optimizer=OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, nesterov=True),
    schedule=ScheduleSpec(name="cosine", warmup_steps=20),
    train=TrainSpec(global_batch_size=64, epochs=15, clip_grad_norm=5.0),
)
