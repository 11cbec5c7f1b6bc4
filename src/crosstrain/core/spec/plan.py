"""The plan: a framework-neutral description of one training job.

Every default lives here, explicitly, so both frameworks see the same numbers.
A plan is loaded (:mod:`crosstrain.core.spec.planfile`) from ``.toml`` (tomllib) or from a
``.py`` file that defines a module-level ``plan``; ``--set section.field=value``
overrides any field. All of it is validated before any process starts; the first problem raises a
:class:`PlanError` that names the file and the field.
"""

from __future__ import annotations

import functools
import typing
from typing import Literal

import attrs

from crosstrain.core.errors import PlanError
from crosstrain.core.model.graph import Graph, build_graph
from crosstrain.core.model.layers import DType, Layer, Shape
from crosstrain.core.model.optimizers import DecayName, OptimizerName
from crosstrain.core.model.width import output_layer_field, scale_layers
from crosstrain.core.spec.data_spec import DataSpec
from crosstrain.core.spec.validators import ge0, gt0, lt1

# The closed sets a plan names; every backend maps each name to its own builder (its tables).
Precision = Literal["fp32", "bf16", "fp16", "fp64"]
LossName = Literal["cross_entropy", "mse", "binary_cross_entropy"]
#: what an evaluation reports: ``loss`` always; ``accuracy`` and ``top_k_accuracy`` (the
#: target among the ``top_k`` largest logits) count hits in each backend's eval step;
#: ``perplexity`` is exp of the eval cross-entropy
MetricName = Literal["loss", "accuracy", "top_k_accuracy", "perplexity"]
#: what a step whose loss is NaN or infinite does: end the run there, or skip its update
OnNonFinite = Literal["stop", "skip"]
#: a checkpoint's metric that ``output.keep_best`` may monitor
KeepBest = Literal["eval.loss", "eval.accuracy"]
#: what each replica holds (``train.shard``): "none", everything (replicated, as DDP and
#: tf.distribute's Mirrored); "optimizer", every parameter and gradient but 1/N of the
#: optimizer's state (ZeRO-1); "full", 1/N of the parameters, gradients and optimizer state
#: (FSDP, ZeRO-3). A backend declares the modes it has (its Vocabulary's ``shard``); the
#: others are refused before launch (docs/sharding.md)
ShardMode = Literal["none", "optimizer", "full"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
SHARD_MODES: tuple[str, ...] = typing.get_args(ShardMode)
LOSSES: tuple[str, ...] = typing.get_args(LossName)
#: the metrics a backend counts in its eval step (its vocabulary's); core derives the others
#: from the loss
COUNTED_METRICS: tuple[str, ...] = ("accuracy", "top_k_accuracy")
#: the losses whose targets are class ids (integers), one per position of the logits
CLASS_LOSSES: tuple[str, ...] = ("cross_entropy",)
#: precision -> the dtype of the weights, the optimizer slots, the checkpoints and what the
#: spec computes at full precision whatever the precision (batch norm, softmax, the loss):
#: float32 masters under fp32, bf16 and fp16; float64 under fp64, where every value of the
#: step is float64. Every backend reads this one table, so a checkpoint's dtype is the same
#: whichever backend wrote it.
WEIGHT_DTYPES: dict[str, Literal["float32", "float64"]] = {
    "fp32": "float32",
    "bf16": "float32",
    "fp16": "float32",
    "fp64": "float64",
}


@attrs.frozen(init=False)
class NativeModel:
    """The native escape hatch: a model factory per framework, ``"package.module:function"``.

    The factory is called with the plan and returns the framework's model, which takes
    neutral (channels-last) inputs and returns logits. Weights are the framework's own,
    so parity across frameworks is not promised; distribution still is.
    """

    factories: tuple[tuple[str, str], ...]

    def __init__(self, **factories: str) -> None:
        self.__attrs_init__(factories=tuple(sorted(factories.items())))

    def factory_for(self, backend: str) -> str | None:
        return dict(self.factories).get(backend)


@attrs.frozen
class BlockSpec:
    """``[model.blocks.NAME]``: a sub-graph that a ``block`` layer runs, each repeat with its
    own weights; ``"input"`` in its layers' ``inputs`` is the block's input."""

    layers: tuple[Layer, ...] = attrs.field()

    @layers.validator
    def _check_layers(self, attribute: attrs.Attribute[tuple[Layer, ...]], value: tuple[Layer, ...]) -> None:
        if not value:
            raise ValueError("a block needs layers")


@attrs.frozen
class ModelSpec:
    """``input_shape``: one row, channels-last; ``input_dtype``: "float32" or "int32" (token
    ids); ``layers`` run in order unless a layer names its ``inputs``; ``blocks``: sub-graphs;
    ``init``: the weights a new run starts from (a .safetensors file under neutral names, a
    run folder or a checkpoint; relative to the plan file), as ``--init-from`` gives them.
    ``width``: every stated size but the output layer's scaled by it
    (:mod:`crosstrain.core.model.width`)."""

    input_shape: tuple[int, ...] = attrs.field()
    input_dtype: DType = "float32"
    layers: tuple[Layer, ...] = ()
    blocks: dict[str, BlockSpec] = attrs.field(factory=dict)
    native: NativeModel | None = None
    init: str | None = None
    width: float = attrs.field(default=1.0, validator=gt0)

    def __attrs_post_init__(self) -> None:
        if self.native is not None and self.width != 1.0:
            raise ValueError("width scales a plan's layers; a native model is the framework's own")

    @input_shape.validator
    def _check_input_shape(self, attribute: attrs.Attribute[Shape], value: Shape) -> None:
        if not value or any(size <= 0 for size in value):
            raise ValueError(f"input_shape must be positive sizes, got {list(value)}")

    def graph(self, source: str | None = None) -> Graph:
        """The layers as a flat graph (names, inputs and blocks resolved, shapes checked), built
        once per spec; a misfit names ``source``, the plan's file."""
        try:
            return self._graph
        except PlanError as error:
            raise PlanError(error.message, field=error.field, source=source) from None

    @functools.cached_property
    def _graph(self) -> Graph:
        """Kept beside the fields, not among them: equality, pickling and plan.json see only
        the fields, and each spec (``attrs.evolve`` makes a new one) builds its own."""
        blocks = {name: spec.layers for name, spec in self.blocks.items()}
        written = build_graph(self.input_shape, self.layers, blocks, self.input_dtype)
        if self.width == 1.0:
            return written
        kept = output_layer_field(written)
        layers, scaled_blocks = scale_layers(self.layers, blocks, self.width, kept)
        try:
            return build_graph(self.input_shape, layers, scaled_blocks, self.input_dtype)
        except PlanError as error:  # it fits as written: say what made it misfit
            raise PlanError(f"{error.message} (at model.width = {self.width:g})", field=error.field) from None


@attrs.frozen
class LossSpec:
    """cross_entropy: logits with classes on the last axis, targets of the logits' shape
    without it, averaged over every real target position; ``label_smoothing`` e: the
    target distribution (1 - e) on the label plus e / classes on every class (torch's and
    Keras's meaning). mse: averaged over outputs. binary_cross_entropy (multi-label): logits
    and float targets in [0, 1] of the same shape, each output its own sigmoid, averaged over
    each row's outputs (torch's BCEWithLogitsLoss, Keras's from_logits=True)."""

    name: LossName = "cross_entropy"
    label_smoothing: float = attrs.field(default=0.0, validator=[ge0, lt1])

    def __attrs_post_init__(self) -> None:
        if self.label_smoothing and self.name != "cross_entropy":
            raise ValueError(f"label_smoothing smooths cross_entropy's labels, not {self.name}'s targets")


@attrs.frozen
class OptimizerSpec:
    """sgd and adam apply ``weight_decay`` as L2 on the gradient; adamw decouples it.
    SGD momentum keeps the learning rate outside the buffer (torch semantics)."""

    name: OptimizerName = "sgd"
    lr: float = attrs.field(default=0.01, validator=gt0)
    momentum: float = attrs.field(default=0.0, validator=[ge0, lt1])
    nesterov: bool = False
    beta1: float = attrs.field(default=0.9, validator=[ge0, lt1])
    beta2: float = attrs.field(default=0.999, validator=[ge0, lt1])
    eps: float = attrs.field(default=1e-8, validator=gt0)
    weight_decay: float = attrs.field(default=0.0, validator=ge0)
    #: which weights ``weight_decay`` applies to: "all", or "kernels" (no decay on biases,
    #: norms and embedding tables, as GPT-2 trains): crosstrain.core.model.optimizers.DECAY
    decay: DecayName = "all"

    def __attrs_post_init__(self) -> None:
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov needs momentum > 0")


@attrs.frozen
class ScheduleSpec:
    """Learning rate per optimizer step: linear warmup from 0 over ``warmup_steps``,
    then constant, step (times ``gamma`` every ``step_size`` steps), exponential (times
    ``gamma`` every step: ``crosstrain tune --lr``'s range test) or cosine to ``min_lr``."""

    name: Literal["constant", "step", "exponential", "cosine"] = "constant"
    warmup_steps: int = attrs.field(default=0, validator=ge0)
    step_size: int = attrs.field(default=100, validator=gt0)
    gamma: float = attrs.field(default=0.1, validator=gt0)
    min_lr: float = attrs.field(default=0.0, validator=ge0)


@attrs.frozen
class TrainSpec:
    global_batch_size: int = attrs.field(default=32, validator=gt0)
    #: passes over the training set; None (unset): one, or as many as ``max_steps`` takes.
    #: With both set the earlier end wins (:class:`crosstrain.core.run.length.RunLength`)
    epochs: int | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    #: optimizer steps in the run; without ``epochs`` exactly this many, across epochs
    max_steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    grad_accum_steps: int = attrs.field(default=1, validator=gt0)
    clip_grad_norm: float | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    precision: Precision = "fp32"
    #: evaluate every this many epochs and at the run's end; 0: never (a throwaway run: the
    #: fp64 probes of compare, crosstrain tune's runs)
    eval_every_epochs: int = attrs.field(default=1, validator=ge0)
    #: compile the training step: torch.compile (and fused Adam/AdamW on CUDA) on torch,
    #: XLA (jit_compile) on tf; the losses stay within the parity tolerance of eager
    compile: bool = False
    #: on one GPU, replay the whole eager step (forward, backward, update) as one CUDA graph
    #: where it can be captured (torch; see crosstrain.backends.torch.graphs): the host then
    #: launches one graph a step, not every kernel. Same losses within the parity tolerance.
    #: tf's steps are graphs (tf.function) already
    cuda_graph: bool = True
    #: a step whose global loss is not finite: "stop" ends the run there (exit non-zero,
    #: the last good checkpoint kept); "skip" leaves the weights and optimizer untouched
    on_nonfinite: OnNonFinite = "stop"
    #: what each replica holds (:data:`ShardMode`); the same curve whichever it is. Left out
    #: of plan.json at its default, and out of the plan hash: a run may continue sharded
    #: another way (``--resume``), its checkpoints being neutral whatever the mode
    shard: ShardMode = "none"

    @property
    def weight_dtype(self) -> Literal["float32", "float64"]:
        """The dtype of the weights, slots and checkpoints (:data:`WEIGHT_DTYPES`)."""
        return WEIGHT_DTYPES[self.precision]


@attrs.frozen
class OutputSpec:
    """``dir``: where summary.json and metrics.jsonl go (default: a new folder under runs/).
    ``checkpoint``: save final weights as ``model.safetensors`` (neutral names).
    ``checkpoint_every_steps``, ``keep_checkpoints``, ``keep_best``: periodic checkpoints
    (see :mod:`crosstrain.core.run.checkpoint`).
    ``log_every_steps``: how many steps' losses stay on the device before they are read
    together (every step is still logged; reading each step would make the device wait
    for the host at every step); the end of an epoch always reads."""

    dir: str | None = None
    checkpoint: bool = True
    log_every_steps: int = attrs.field(default=50, validator=gt0)
    #: write ``checkpoints/step-NNNNNNNN/`` (weights, optimizer slots, loop state) every N
    #: optimizer steps and at the end; ``--resume`` continues from the last one
    checkpoint_every_steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(gt0))
    #: the newest checkpoints kept; older ones are removed once a new one is complete
    keep_checkpoints: int = attrs.field(default=3, validator=gt0)
    #: also keep the checkpoint with the best value of this metric (a checkpoint is then
    #: written after every evaluation)
    keep_best: KeepBest | None = None

    def __attrs_post_init__(self) -> None:
        if self.keep_best is not None and self.checkpoint_every_steps is None:
            raise ValueError("keep_best needs checkpoint_every_steps (it keeps one of the checkpoints)")


@attrs.frozen
class Plan:
    model: ModelSpec
    name: str = "plan"
    seed: int = 0
    metrics: tuple[MetricName, ...] = ("loss", "accuracy")
    #: k of the ``top_k_accuracy`` metric
    top_k: int = attrs.field(default=5, validator=gt0)
    data: DataSpec = attrs.field(factory=DataSpec)
    loss: LossSpec = LossSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    train: TrainSpec = TrainSpec()
    output: OutputSpec = OutputSpec()
    source: str | None = attrs.field(default=None, eq=False)


# --------------------------------------------------------------------------- validation


def validate_plan(plan: Plan) -> None:
    """Checks that need the whole plan: shapes through the model, the output against the loss."""
    if plan.model.native is not None and plan.model.init is not None:
        raise PlanError(
            "a native model's weights have no neutral names to start from; model.init needs a model "
            "of layers",
            field="model.init",
            source=plan.source,
        )
    if plan.model.native is None:
        if not plan.model.layers:
            raise PlanError(
                "a model needs layers (or a native model)", field="model.layers", source=plan.source
            )
        output = plan.model.graph(plan.source).output_shape
        if plan.loss.name == "cross_entropy" and not output:
            raise PlanError(
                "cross_entropy needs logits with classes on the last axis, got a scalar output",
                field="model.layers",
                source=plan.source,
            )
    _check_scaling(plan)
    _check_metrics(plan)
    if plan.output.keep_best is not None and plan.train.eval_every_epochs == 0:
        raise PlanError(
            "keeps the best evaluation's checkpoint, and train.eval_every_epochs = 0 never evaluates",
            field="output.keep_best",
            source=plan.source,
        )
    augment = plan.data.augment
    if augment.mixes and (plan.loss.name != "cross_entropy" or plan.model.native is not None):
        field = "data.augment.mixup" if augment.mixup else "data.augment.cutmix"
        raise PlanError(
            "mixes each row's class label with its partner's: it needs loss 'cross_entropy' and a "
            "model of layers",
            field=field,
            source=plan.source,
        )
    if plan.optimizer.decay != "all" and plan.model.native is not None:
        raise PlanError(
            f"decay {plan.optimizer.decay!r} chooses among the neutral layers' weights; a native "
            "model's are its own (use 'all')",
            field="optimizer.decay",
            source=plan.source,
        )


def _check_metrics(plan: Plan) -> None:
    """Hits count class labels; perplexity is exp of a plain cross-entropy; k fits the classes."""
    for metric in ("accuracy", "top_k_accuracy", "perplexity"):
        if metric in plan.metrics and plan.loss.name not in CLASS_LOSSES:
            raise PlanError(f"{metric} needs loss 'cross_entropy'", field="metrics", source=plan.source)
    if "perplexity" in plan.metrics and plan.loss.label_smoothing:
        raise PlanError(
            "perplexity is exp of the eval cross-entropy, which label_smoothing changes; "
            "leave one of them out",
            field="metrics",
            source=plan.source,
        )
    if "top_k_accuracy" in plan.metrics and plan.model.native is None:
        classes = plan.model.graph(plan.source).output_shape[-1]
        if plan.top_k > classes:
            raise PlanError(
                f"top_k {plan.top_k} exceeds the {classes} classes of the model's logits",
                field="top_k",
                source=plan.source,
            )


def _check_scaling(plan: Plan) -> None:
    """mean/std: one value, or one per channel of the input's last axis; float inputs only."""
    data = plan.data
    if data.scaling.is_identity:
        return
    if plan.model.input_dtype != "float32":
        raise PlanError(
            f"data.scale/mean/std scale float inputs; model.input_dtype is {plan.model.input_dtype!r}",
            field="data.scale",
            source=plan.source,
        )
    channels = plan.model.input_shape[-1]
    for name in ("mean", "std"):
        values = getattr(data, name)
        if len(values) not in (0, 1, channels):
            raise PlanError(
                f"{len(values)} values, but the input has {channels} channels (give 1 or {channels})",
                field=f"data.{name}",
                source=plan.source,
            )


def check_world_fits(plan: Plan, replicas: int) -> None:
    """The global batch must split evenly into replicas x grad_accum_steps micro-batches."""
    train = plan.train
    parts = replicas * train.grad_accum_steps
    if train.global_batch_size % parts:
        raise PlanError(
            f"{train.global_batch_size} is not divisible by replicas ({replicas}) x "
            f"grad_accum_steps ({train.grad_accum_steps}) = {parts}",
            field="train.global_batch_size",
            source=plan.source,
        )


def output_shape(plan: Plan) -> Shape | None:
    """One row's model output shape (None for a native model)."""
    if plan.model.native is not None:
        return None
    return plan.model.graph().output_shape
