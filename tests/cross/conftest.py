"""Parity tests: quiet TensorFlow and keras.json kept out of $HOME, set before anything
imports keras. Both frameworks are needed; each test module skips without them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("KERAS_HOME", str(Path(tempfile.gettempdir()) / "crosstrain-keras"))
os.environ["KERAS_BACKEND"] = "tensorflow"
