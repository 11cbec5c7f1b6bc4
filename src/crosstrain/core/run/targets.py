"""A data set's rows and targets fitted to the plan's model: inputs reshaped to
``model.input_shape``, class labels or regression targets to the output's shape; a misfit is
one line naming the plan field at fault (the model's last layer, a dense layer reading an
image, the labels' file)."""

from __future__ import annotations

import math

import numpy as np

from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import dense_on_image
from crosstrain.core.spec.plan import CLASS_LOSSES, Plan, output_shape


def fit_to_input(x: np.ndarray, plan: Plan, field: str) -> np.ndarray:
    """Reshape each row to ``model.input_shape`` (channels-last) when the sizes agree."""
    shape = plan.model.input_shape
    rows = x.shape[0]
    if math.prod(x.shape[1:]) != math.prod(shape):
        raise PlanError(
            f"rows have shape {list(x.shape[1:])}, which does not fit model.input_shape {list(shape)}",
            field=field,
            source=plan.source,
        )
    if plan.model.input_dtype == "int32" and not np.issubdtype(x.dtype, np.integer):
        raise PlanError("model.input_dtype 'int32' needs integer inputs", field=field, source=plan.source)
    dtype = np.int32 if plan.model.input_dtype == "int32" else np.float32
    return np.ascontiguousarray(x.reshape(rows, *shape), dtype=dtype)


def plan_targets(y: np.ndarray, plan: Plan) -> np.ndarray:
    """``y`` fitted to the plan's output (:func:`fit_targets`); a misfit is a PlanError."""
    try:
        return fit_targets(y, plan)
    except TargetMisfit as misfit:
        raise PlanError(str(misfit), field=misfit.field, source=plan.source) from None


class TargetMisfit(ValueError):
    """Targets that do not fit the model's output; ``field`` is the plan field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def fit_targets(y: np.ndarray, plan: Plan) -> np.ndarray:
    """Class ids of the logits' shape without the class axis, or regression targets of the
    output's shape; else :class:`TargetMisfit`."""
    shape = output_shape(plan)
    rows = y.shape[0]
    if plan.loss.name in CLASS_LOSSES:
        if not np.issubdtype(y.dtype, np.integer) and not np.all(np.mod(y, 1) == 0):
            raise TargetMisfit("cross_entropy needs integer class labels", "data.y_key")
        target_shape = y.shape[1:] if shape is None else shape[:-1]
        if math.prod(y.shape[1:]) != math.prod(target_shape):
            raise _output_misfit(
                plan,
                f"labels have shape {list(y.shape[1:])} per row but the model's logits need "
                f"{list(target_shape)}",
                "data.y_key",
            )
        labels = y.astype(np.int64).reshape(rows, *target_shape)
        classes = None if shape is None else shape[-1]
        if labels.min(initial=0) < 0 or (classes is not None and labels.max(initial=0) >= classes):
            raise TargetMisfit(
                f"labels span 0..{int(labels.max())} but the model's last layer has {classes} units",
                "model.layers",
            )
        return labels
    target_shape = (-1,) if shape is None else shape
    if shape is not None and math.prod(y.shape[1:]) != math.prod(shape):
        raise _output_misfit(
            plan,
            f"targets have {math.prod(y.shape[1:])} values per row but the model's output has "
            f"shape {list(shape)}",
            "model.layers",
        )
    targets = y.astype(np.float32).reshape(rows, *target_shape)
    if (
        plan.loss.name == "binary_cross_entropy"
        and targets.size
        and not (targets.min() >= 0.0 and targets.max() <= 1.0)
    ):
        raise TargetMisfit(
            f"binary_cross_entropy needs targets in [0, 1] (1: the label applies), got values in "
            f"[{targets.min():g}, {targets.max():g}]",
            "data.y_key",
        )
    return targets


def _output_misfit(plan: Plan, message: str, field: str) -> TargetMisfit:
    """The misfit, naming the dense layer that reads an image where that is the cause: a
    dense layer acts on the last axis only, so after a convolution or pooling without a
    flatten the output keeps the image's height and width (Keras's Dense does the same)."""
    reader = None if plan.model.native is not None else dense_on_image(plan.model.graph(plan.source))
    if reader is None:
        return TargetMisfit(message, field)
    hint = (
        f": this dense layer reads an image {list(reader.input_shape)} and acts on its last axis "
        'only; add { type = "flatten" } before it'
    )
    return TargetMisfit(message + hint, reader.field)
