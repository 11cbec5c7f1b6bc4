"""Plans that read data a test writes, and their writers: a multi-label MLP on the digits,
an MLP on a table of text and numbers (CSV and Parquet), token files for the GPT plans, uint8
images in arrays and in a folder of class folders (PNG and JPEG), and an array with a NaN row.
Shared by the suites of every backend, as :mod:`crosstrain.testing.plans`.
"""

from typing import Any

#: a multi-label MLP: four yes/no facts about each handwritten digit (written by
#: :func:`write_multilabel_data`), one sigmoid output each
MULTILABEL_PLAN = """
name = "multilabel_mlp"
seed = 7
metrics = ["loss"]
[model]
input_shape = [64]
layers = [
  { type = "dense", units = 32, activation = "relu" },
  { type = "dense", units = 4 },
]
[data]
source = "npz"
path = "multilabel.npz"
[loss]
name = "binary_cross_entropy"
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 0.01
decay = "kernels"
[train]
global_batch_size = 32
"""


def write_multilabel_data(path: str) -> None:
    """MULTILABEL_PLAN's data: the 1,797 digits, each with four float labels: even, above 4,
    a closed loop in the glyph (0, 6, 8, 9), a prime (2, 3, 5, 7)."""
    import numpy as np

    from crosstrain.core.run.loading import load_digits_arrays

    x, digits = load_digits_arrays()
    facts = [digits % 2 == 0, digits > 4, np.isin(digits, (0, 6, 8, 9)), np.isin(digits, (2, 3, 5, 7))]
    np.savez(path, x=x, y=np.stack(facts, axis=1).astype(np.float32))


TABLE_PLAN = """
name = "churn_table"
seed = 3
[model]
input_shape = [5]
layers = [
  { type = "dense", units = 16, activation = "relu" },
  { type = "dense", units = 2 },
]
[data]
source = "table"
path = "churn.csv"
features = ["age", "plan", "monthly", "city", "tenure"]
categorical = ["plan", "city"]
label = "churned"
standardize = true
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
[train]
global_batch_size = 32
"""

#: the churn table's categories (a later table may hold only some of them)
CHURN_PLANS = ("basic", "pro", "premium")
CHURN_CITIES = ("Lyon", "Paris", "Nantes", "Lille")


def churn_columns(rows: int, seed: int, plans: tuple[str, ...] = CHURN_PLANS) -> dict[str, list[Any]]:
    """A synthetic customer table: numeric and text columns, a text label that depends on
    both (so a model can learn something)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    age = rng.integers(18, 80, rows)
    plan = rng.choice(plans, rows)
    monthly = np.round(rng.gamma(4.0, 15.0, rows), 2)
    city = rng.choice(CHURN_CITIES, rows)
    tenure = rng.integers(0, 120, rows)
    score = 0.03 * monthly - 0.02 * tenure + np.where(plan == "basic", 0.8, 0.0) + rng.normal(0, 0.5, rows)
    return {
        "age": age.tolist(),
        "plan": plan.tolist(),
        "monthly": monthly.tolist(),
        "city": city.tolist(),
        "tenure": tenure.tolist(),
        "churned": np.where(score > 0.5, "yes", "no").tolist(),
    }


def write_churn_tables(directory: str) -> None:
    """TABLE_PLAN's ``churn.csv`` (600 rows) and ``churn_2026.parquet``, a later table of
    another distribution (200 rows, no "basic" customers), for evaluate."""
    import pyarrow
    import pyarrow.csv
    import pyarrow.parquet

    pyarrow.csv.write_csv(pyarrow.table(churn_columns(600, seed=0)), f"{directory}/churn.csv")
    later = churn_columns(200, seed=1, plans=("pro", "premium"))
    pyarrow.parquet.write_table(pyarrow.table(later), f"{directory}/churn_2026.parquet")


def write_tokens(path: str, count: int = 4000, vocabulary: int = 32, seed: int = 0) -> None:
    """A token file for GPT_PLAN: a noisy repeating pattern, so a model can learn something."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pattern = np.arange(count) % 7 * 4 % vocabulary
    noise = rng.integers(0, vocabulary, size=count)
    tokens = np.where(rng.random(count) < 0.2, noise, pattern).astype(np.uint16)
    np.save(path, tokens)


SCALED_IMAGES_PLAN = """
name = "scaled_images"
seed = 4
[model]
input_shape = [8, 8, 3]
layers = [
  { type = "conv2d", filters = 4, kernel_size = 3, padding = "same" },
  { type = "relu" },
  { type = "flatten" },
  { type = "dense", units = 10 },
]
[data]
source = "npy"
x_path = "images.npy"
y_path = "labels.npy"
scale = 0.00392156862745098  # 1 / 255: raw uint8 pixels, scaled where the model runs
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
[optimizer]
name = "sgd"
lr = 0.01
momentum = 0.9
[train]
global_batch_size = 16
epochs = 1
"""


def write_images(directory: str, rows: int = 320, seed: int = 0) -> None:
    """uint8 images and labels for SCALED_IMAGES_PLAN (``images.npy``, ``labels.npy``)."""
    import os

    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=rows)
    # brighter images for larger labels, so there is something to learn
    images = rng.integers(0, 128, size=(rows, 8, 8, 3)) + labels[:, None, None, None] * 12
    np.save(os.path.join(directory, "images.npy"), images.astype(np.uint8))
    np.save(os.path.join(directory, "labels.npy"), labels)


IMAGE_FOLDER_PLAN = """
name = "image_folder"
seed = 4
[model]
input_shape = [16, 16, 3]
layers = [
  { type = "conv2d", filters = 4, kernel_size = 3, padding = "same" },
  { type = "relu" },
  { type = "flatten" },
  { type = "dense", units = 10 },
]
[data]
source = "images"
path = "digits_images"
image_size = [16, 16]
eval_fraction = 0.1
scale = 0.00392156862745098  # 1 / 255: uint8 pixels, scaled where the model runs
mean = [0.5]
std = [0.25]
[data.augment]
crop_scale = [0.35, 1.0]
flip = true
pad_crop = 2
color_jitter = [0.4, 0.4, 0.4, 0.1]  # brightness, contrast, saturation, hue
mixup = 0.4    # each row mixed with a partner: mixup or cutmix, one of the two a row
cutmix = 1.0
[optimizer]
name = "sgd"
lr = 0.02
momentum = 0.9
[train]
global_batch_size = 16
epochs = 2
"""


def write_image_folder(directory: str, rows: int = 360) -> None:
    """A folder of class folders for IMAGE_FOLDER_PLAN (``digits_images/<digit>/``): the
    first ``rows`` scikit-learn digits, 8x8 upscaled to 16x16 RGB, PNG and JPEG in turn."""
    import os

    import numpy as np
    from PIL import Image

    from crosstrain.core.run.loading import load_digits_arrays

    pixels, labels = load_digits_arrays()
    for row in range(rows):
        gray = np.kron((pixels[row].reshape(8, 8) * 240).astype(np.uint8), np.ones((2, 2), np.uint8))
        rgb = np.stack([gray, gray[::-1], 255 - gray], axis=-1)
        folder = os.path.join(directory, "digits_images", str(labels[row]))
        os.makedirs(folder, exist_ok=True)
        name = os.path.join(folder, f"{row:04d}." + ("png" if row % 2 else "jpg"))
        Image.fromarray(rgb).save(name, quality=90)


def damaged_png(data: bytes) -> bytes:
    """A PNG file's bytes with its compressed pixels scrambled: its header and its end are
    whole, so the check before launch passes it, but it does not decode (Pillow: "broken
    data stream"), so the step that reads it fails."""
    chunk = data.index(b"IDAT")
    length = int.from_bytes(data[chunk - 4 : chunk], "big")
    first, last = chunk + 4 + 2, chunk + 4 + length  # past zlib's own two-byte header
    return data[:first] + bytes(byte ^ 0x55 for byte in data[first:last]) + data[last:]


NAN_ROW_PLAN = """
name = "nan_row_mlp"
seed = 4
[model]
input_shape = [64]
layers = [{ type = "dense", units = 32 }, { type = "relu" }, { type = "dense", units = 10 }]
[data]
source = "npz"
path = "nan_row.npz"
eval_fraction = 0.0
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[train]
global_batch_size = 32
epochs = 1
[output]
log_every_steps = 4
checkpoint_every_steps = 5
"""


def write_nan_row_data(path: str, row: int = 300) -> None:
    """NAN_ROW_PLAN's data: the 1,797 digits, one row of them a corrupt record that passes
    the load check (finite, as NaN would be refused there) but overflows float32 in the first
    layer, so the loss of the step that holds it is not finite on every backend."""
    import numpy as np

    from crosstrain.core.run.loading import load_digits_arrays

    x, y = load_digits_arrays()
    x[row] = 3e38
    np.savez(path, x=x, y=y)
