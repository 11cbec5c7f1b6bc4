"""The plan's ``[data]`` section (:class:`DataSpec`): where the rows come from, how they are
read and scaled, and ``[data.augment]``; each source's fields checked as the plan loads."""

from __future__ import annotations

from typing import Literal

import attrs

from crosstrain.core.data.augment import Augmentation
from crosstrain.core.data.scaling import InputScaling
from crosstrain.core.spec.validators import ge0, gt0, lt1, positive_sizes

DataSource = Literal["digits", "npz", "npy", "tokens", "python-stdlib", "images", "table", "text"]
Placement = Literal["auto", "device", "host"]
#: the sources read as windows of a token sequence
TOKEN_SOURCES = ("tokens", "python-stdlib", "text")


@attrs.frozen
class DataSpec:
    """``source``: "digits" (scikit-learn's 8x8 handwritten digits, shipped, no download),
    "npz" (``path`` with arrays ``x_key``/``y_key``; ``eval_x_key``/``eval_y_key``: the eval
    set's arrays in the same file, as Keras's mnist.npz holds x_test/y_test), "npy"
    (``x_path``/``y_path``, and optionally ``eval_x_path``/``eval_y_path``: arrays
    memory-mapped and read by row index, never loaded whole), "tokens" (``path``: a 1-D
    integer .npy, memory-mapped, cut into windows of ``sequence_length``: x = t[i*L : i*L+L], y the same
    shifted by one) or "python-stdlib" (the bytes of this Python's standard library, as
    tokens) or "images" (``path``: a folder of class folders or a .csv/.parquet index,
    decoded to ``image_size``, augmented as ``augment`` says: docs/data.md). The eval set
    is ``eval_path`` if given (its arrays ``eval_x_key``/``eval_y_key``,
    else ``x_key``/``y_key``), else the eval keys' arrays of ``path``, else a seeded
    ``eval_fraction`` of the rows (for tokens: the last windows). ``limit`` keeps the first
    rows. "table" (``path``: a .csv or .parquet file; ``features``, ``label``,
    ``categorical``, ``standardize``: :mod:`crosstrain.core.data.sources.table`) and "text"
    (``path``: a file, folder or glob; ``tokenizer``: :mod:`crosstrain.core.data.sources.text`)
    are documented in docs/data.md."""

    source: DataSource = "digits"
    path: str | None = None
    sequence_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    x_key: str = "x"
    y_key: str = "y"
    eval_x_key: str | None = None
    eval_y_key: str | None = None
    eval_fraction: float = attrs.field(default=0.2, validator=[ge0, lt1])
    eval_path: str | None = None
    x_path: str | None = None
    y_path: str | None = None
    eval_x_path: str | None = None
    eval_y_path: str | None = None
    limit: int | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    shuffle: bool = True
    #: where the backend keeps the arrays: "device" (once, gathering each step's rows there),
    #: "host" (gathering on the host and copying each step), or "auto" (the device when the
    #: data fits in a share of its free memory, and the device is an accelerator)
    placement: Placement = "auto"
    #: inputs as the model sees them: (float32(x) * scale - mean) / std, mean and std one
    #: value or one per channel (the last axis); raw uint8 stays uint8 until then
    scale: float = attrs.field(default=1.0, validator=gt0)
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = attrs.field(default=(), validator=attrs.validators.deep_iterable(gt0))
    #: table: the feature columns, in the model's input order, and the label column
    features: tuple[str, ...] = ()
    label: str | None = None
    #: table: the feature columns whose values are categories (each coded 0..n-1 in sorted order)
    categorical: tuple[str, ...] = ()
    #: table: numeric features to mean 0, std 1 by the training rows' statistics (kept in the
    #: run folder's statistics.json, reused by evaluate, predict and a resumed run)
    standardize: bool = False
    #: text and python-stdlib: a Hugging Face ``tokenizers`` JSON file; none: bytes (vocabulary 256)
    tokenizer: str | None = None
    #: images: each decoded and resized to [height, width] (model.input_shape [h, w, 3])
    image_size: tuple[int, int] | None = attrs.field(default=None, validator=positive_sizes)
    #: images: resized by Pillow's antialiased bilinear filter (true), or by OpenCV's
    #: bit-exact bilinear interpolation without antialiasing (false: about twice as fast)
    antialias: bool = True
    #: images: a folder holding the files' decoded pixels (``crosstrain data cache PLAN``
    #: writes it); rows are then read from it, not decoded
    cache: str | None = None
    #: ``[data.augment]``: what training rows get (images: evaluation gets the centre box;
    #: token windows: ``window_offset``)
    augment: Augmentation = attrs.field(factory=Augmentation)

    @property
    def scaling(self) -> InputScaling:
        return InputScaling(self.scale, self.mean, self.std)

    def __attrs_post_init__(self) -> None:
        if self.source in ("npz", "tokens", "table", "text") and self.path is None:
            raise ValueError(f"source {self.source!r} needs data.path")
        _check_augmentation(self)
        if self.source == "images":
            _check_images(self)
        if self.source in TOKEN_SOURCES and self.sequence_length is None:
            raise ValueError(f"source {self.source!r} needs data.sequence_length")
        if self.source == "npy" and (self.x_path is None or self.y_path is None):
            raise ValueError("source 'npy' needs data.x_path and data.y_path")
        self._check_table_fields()
        if not self.antialias and self.source != "images":
            raise ValueError(
                f"data.antialias is how images are resized (source 'images'), not source {self.source!r}"
            )
        if self.cache is not None and self.source != "images":
            raise ValueError(f"data.cache holds decoded images (source 'images'), not source {self.source!r}")
        if self.tokenizer is not None and self.source not in ("text", "python-stdlib"):
            raise ValueError(
                f"tokenizer reads text (source 'text' or 'python-stdlib'), not source {self.source!r}"
            )
        if (self.eval_x_path is None) != (self.eval_y_path is None):
            raise ValueError("data.eval_x_path and data.eval_y_path come together")
        if (self.eval_x_key is None) != (self.eval_y_key is None):
            raise ValueError("eval_x_key and eval_y_key come together")
        if self.eval_x_key is not None and self.source != "npz" and self.eval_path is None:
            raise ValueError(
                f"eval_x_key and eval_y_key name arrays of an .npz file (source 'npz', or an "
                f"eval_path), not of source {self.source!r}"
            )

    def _check_table_fields(self) -> None:
        given = [name for name in ("features", "label", "categorical", "standardize") if getattr(self, name)]
        if self.source != "table":
            if given:
                raise ValueError(f"data.{given[0]} describes a table's columns (source 'table')")
            return
        if not self.features or self.label is None:
            raise ValueError("source 'table' needs data.features (the input columns) and data.label")
        outside = [name for name in self.categorical if name not in self.features]
        if outside:
            raise ValueError(f"data.categorical names {outside[0]!r}, which is not one of data.features")
        if self.standardize and (self.mean or self.std):
            raise ValueError(
                "data.standardize computes the mean and std of the features; leave data.mean/std out"
            )


def _check_augmentation(spec: DataSpec) -> None:
    """``[data.augment]`` asks only what the source's rows can take."""
    augment = spec.augment
    if augment.transforms_images and spec.source != "images":
        raise ValueError(
            "data.augment transforms images (crop_scale, flip, pad_crop, color_jitter, mixup, "
            "cutmix): it needs source 'images'"
        )
    if augment.window_offset and spec.source not in TOKEN_SOURCES:
        raise ValueError(
            "data.augment.window_offset moves token windows: it needs source "
            + " or ".join(map(repr, TOKEN_SOURCES))
        )


def _check_images(spec: DataSpec) -> None:
    """An image source names its files and its size, and keeps its rows on the host."""
    if spec.path is None:
        raise ValueError(
            "source 'images' needs data.path (a folder of class folders, or a .csv/.parquet index)"
        )
    if spec.image_size is None:
        raise ValueError("source 'images' needs data.image_size = [height, width]")
    if spec.placement == "device":
        raise ValueError(
            "data.placement 'device' keeps the whole data set on the device; image files are "
            "decoded each step on the host: use 'host' (or 'auto')"
        )
