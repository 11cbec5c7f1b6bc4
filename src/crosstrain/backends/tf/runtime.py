"""TensorFlow imported as crosstrain's processes need it: quiet, and without the optional
packages its own import pulls in for features crosstrain never calls.

When they are installed, ``import tensorflow`` imports jax (``tf.lite``'s jax converter),
matplotlib's pyplot (``keras.visualization``) and scikit-learn with scipy.stats
(``keras.wrappers``): about 2 of the 6 CPU-seconds a worker spends importing TensorFlow,
paid by every worker of every run (scikit-learn is one of crosstrain's own dependencies, so
it is always there). :func:`import_tensorflow` hides those packages for the length of
TensorFlow's import only: later imports of them work as ever; only the Keras helpers above
find their package missing in that process.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

#: environment every TensorFlow process of crosstrain gets unless the user set it
TF_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
#: packages TensorFlow 2.21 and Keras 3 import, when installed, for features crosstrain never calls
NOT_NEEDED_BY_TENSORFLOW = ("jax", "matplotlib", "sklearn")


def quiet_tensorflow() -> None:
    """TensorFlow's settings for crosstrain's processes (its C++ start-up log off), in this
    one, before it imports TensorFlow. A variable the user set is kept."""
    for name, value in TF_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def import_tensorflow() -> ModuleType:
    """``tensorflow``, quiet, imported (with Keras) without :data:`NOT_NEEDED_BY_TENSORFLOW`
    where this process has not imported them already."""
    quiet_tensorflow()
    if (imported := sys.modules.get("tensorflow")) is not None:
        return imported
    hidden = [name for name in NOT_NEEDED_BY_TENSORFLOW if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError, as if absent
    try:
        import tensorflow  # noqa: F401  # imports Keras 3 too (tf.keras)
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
    return sys.modules["tensorflow"]
