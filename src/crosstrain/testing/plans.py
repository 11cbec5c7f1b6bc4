"""Small plans of every kind, shared by the suites of every backend (and a third party's).

Each is a TOML text (the plan format of docs/plans.md) small enough to train a few steps in
seconds on a CPU: an MLP with dropout (the classic Keras MNIST shape), a residual CNN with
batch norm, the blocks of a ResNet and a MobileNetV2, a GPT-style decoder with dropout on
token data, and a Llama-style and a GPT-2-style decoder on the built-in ``python-stdlib``
text. Plans whose data a test writes, and their writers, are in :mod:`crosstrain.testing.data_plans`.
"""

DROPOUT_MLP_PLAN = """
name = "dropout_mlp"
seed = 3
[model]
input_shape = [64]
layers = [
  { type = "dense", units = 128 },
  { type = "relu" },
  { type = "dropout", rate = 0.5 },
  { type = "dense", units = 10 },
]
[data]
source = "digits"
[optimizer]
name = "adam"
lr = 0.003
[train]
global_batch_size = 32
epochs = 1
"""

#: the README's example, ``examples/digits_mlp.toml``, word for word (a test keeps them equal):
#: trained whole by every backend's conformance suite, which reaches 95 % on it
DIGITS_MLP_PLAN = """\
# An MLP on scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with
# scikit-learn: no download). Runs unchanged on every backend:
#   crosstrain run examples/digits_mlp.toml --backend torch --nproc 2
#   crosstrain run examples/digits_mlp.toml --backend tf    --nproc 2
name = "digits_mlp"
seed = 0
metrics = ["loss", "accuracy"]

[model]
input_shape = [64]
layers = [
  { type = "dense", units = 128 },
  { type = "relu" },
  { type = "dense", units = 64 },
  { type = "relu" },
  { type = "dense", units = 10 },
]

[data]
source = "digits"
eval_fraction = 0.2

[loss]
name = "cross_entropy"

[optimizer]
name = "adam"
lr = 0.003

[schedule]
name = "cosine"
warmup_steps = 10

[train]
global_batch_size = 64
epochs = 20
precision = "fp32"
"""

RESNET_PLAN = """
name = "tiny_resnet"
seed = 1
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm" },
  { type = "relu" },
  { type = "block", block = "res", repeat = 2, name = "res_3" },
  { type = "conv2d", filters = 8, kernel_size = 2, strides = 2, use_bias = false },
  { type = "batchnorm", momentum = 0.8 },
  { type = "avgpool2d", pool_size = 2 },
  { type = "concat", inputs = ["avgpool2d_6", "avgpool2d_6"] },
  { type = "global_avg_pool2d" },
  { type = "dense", units = 10 },
]
[model.blocks.res]
layers = [
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm" },
  { type = "relu" },
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm", name = "branch" },
  { type = "add", inputs = ["input", "branch"] },
  { type = "relu" },
]
[data]
source = "digits"
[optimizer]
name = "sgd"
lr = 0.01  # gentle: batch norm over 32 rows amplifies rounding at larger steps
momentum = 0.9
[train]
global_batch_size = 32
epochs = 1
"""

#: what every Keras ResNet and MobileNetV2 writes: a stem, a downsampling residual block
#: (``same`` at stride 2, whose extra padding row TensorFlow puts at the bottom, beside a
#: 1x1 stride-2 projection) and an inverted residual (1x1 expand, depthwise 3x3 ``same``
#: at stride 2 with groups = channels, relu6, 1x1 linear projection). Batch norm's epsilon is
#: Keras's 1e-3: at 1e-5 a depthwise channel nearly constant over the digits' blank borders
#: amplifies rounding (tf's two-replica sums) to a 3e-3 step-loss difference by step 12
VISION_PLAN = """
name = "tiny_vision"
seed = 5
[model]
input_shape = [8, 8, 1]
layers = [
  { type = "conv2d", filters = 8, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm", epsilon = 0.001 },
  { type = "relu", name = "stem" },
  { type = "conv2d", filters = 16, kernel_size = 3, strides = 2, padding = "same", use_bias = false },
  { type = "batchnorm", epsilon = 0.001 },
  { type = "relu" },
  { type = "conv2d", filters = 16, kernel_size = 3, padding = "same", use_bias = false },
  { type = "batchnorm", epsilon = 0.001, name = "branch" },
  { type = "conv2d", filters = 16, kernel_size = 1, strides = 2, use_bias = false, inputs = ["stem"] },
  { type = "batchnorm", epsilon = 0.001, name = "shortcut" },
  { type = "add", inputs = ["branch", "shortcut"] },
  { type = "relu" },
  { type = "conv2d", filters = 32, kernel_size = 1, use_bias = false },
  { type = "batchnorm", epsilon = 0.001 },
  { type = "relu6" },
  { type = "conv2d", filters = 32, kernel_size = 3, strides = 2, padding = "same", groups = 32 },
  { type = "batchnorm", epsilon = 0.001 },
  { type = "relu6" },
  { type = "conv2d", filters = 16, kernel_size = 1, use_bias = false },
  { type = "batchnorm", epsilon = 0.001 },
  { type = "global_avg_pool2d" },
  { type = "dense", units = 10 },
]
[data]
source = "digits"
[optimizer]
name = "sgd"
lr = 0.01  # gentle: batch norm over 32 rows amplifies rounding at larger steps
momentum = 0.9
[train]
global_batch_size = 32
epochs = 1
"""

GPT_PLAN = """
name = "tiny_gpt"
seed = 2
[model]
input_shape = [16]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 32, units = 16 },
  { type = "position_embedding" },
  { type = "block", block = "decoder", repeat = 2 },
  { type = "layernorm" },
  { type = "dense", units = 32 },
]
[model.blocks.decoder]
layers = [
  { type = "layernorm" },
  { type = "attention", heads = 2, causal = true, name = "att" },
  { type = "dropout", rate = 0.1, name = "att_drop" },
  { type = "add", inputs = ["input", "att_drop"], name = "mid" },
  { type = "layernorm" },
  { type = "dense", units = 32 },
  { type = "gelu" },
  { type = "dense", units = 16, name = "mlp" },
  { type = "add", inputs = ["mid", "mlp"] },
]
[data]
source = "tokens"
path = "tokens.npy"
sequence_length = 16
eval_fraction = 0.1
[optimizer]
name = "adamw"
lr = 0.003
weight_decay = 0.01
[train]
global_batch_size = 16
epochs = 1
clip_grad_norm = 1.0
"""


#: a Llama-style decoder: RMS norms, rotary grouped-query attention without biases, the
#: SwiGLU MLP (silu(x W1) * (x W3), then W2), the output tied to the token embedding, no decay
#: on norms and embeddings; label smoothing and the top-5 accuracy.
LLAMA_PLAN = """
name = "tiny_llama"
seed = 5
metrics = ["loss", "accuracy", "top_k_accuracy"]
top_k = 5
[model]
input_shape = [32]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 256, units = 32, name = "tokens" },
  { type = "block", block = "decoder", repeat = 2 },
  { type = "rmsnorm" },
  { type = "dense", units = 256, use_bias = false, tie = "tokens" },
]
[model.blocks.decoder]
layers = [
  { type = "rmsnorm" },
  { type = "attention", heads = 4, kv_heads = 2, causal = true, rotary = true, use_bias = false },
  { type = "add", inputs = ["input", "attention_1"], name = "mid" },
  { type = "rmsnorm", name = "normed" },
  { type = "dense", units = 64, use_bias = false, activation = "silu", name = "gate" },
  { type = "dense", units = 64, use_bias = false, inputs = ["normed"], name = "up" },
  { type = "multiply", inputs = ["gate", "up"] },
  { type = "dense", units = 32, use_bias = false, name = "mlp" },
  { type = "add", inputs = ["mid", "mlp"] },
]
[data]
source = "python-stdlib"
sequence_length = 32
limit = 400
eval_fraction = 0.1
[loss]
name = "cross_entropy"
label_smoothing = 0.1
[optimizer]
name = "adamw"
lr = 0.003
weight_decay = 0.1
decay = "kernels"
[train]
global_batch_size = 16
clip_grad_norm = 1.0
"""

#: a GPT-2-style decoder: learned positions, layer norms, attention and MLP with biases,
#: dropout, the output tied to the token embedding (with a bias of its own); perplexity
GPT2_PLAN = """
name = "tiny_gpt2"
seed = 6
metrics = ["loss", "accuracy", "perplexity"]
[model]
input_shape = [32]
input_dtype = "int32"
layers = [
  { type = "embedding", vocab_size = 256, units = 32 },
  { type = "position_embedding" },
  { type = "dropout", rate = 0.1 },
  { type = "block", block = "decoder", repeat = 2 },
  { type = "layernorm" },
  { type = "dense", units = 256, tie = "embedding_0" },
]
[model.blocks.decoder]
layers = [
  { type = "layernorm" },
  { type = "attention", heads = 4, causal = true, name = "att" },
  { type = "dropout", rate = 0.1, name = "att_drop" },
  { type = "add", inputs = ["input", "att_drop"], name = "mid" },
  { type = "layernorm" },
  { type = "dense", units = 128, activation = "gelu" },
  { type = "dense", units = 32, name = "mlp" },
  { type = "add", inputs = ["mid", "mlp"] },
]
[data]
source = "python-stdlib"
sequence_length = 32
limit = 400
eval_fraction = 0.1
[optimizer]
name = "adamw"
lr = 0.003
weight_decay = 0.1
decay = "kernels"
[train]
global_batch_size = 16
clip_grad_norm = 1.0
"""
