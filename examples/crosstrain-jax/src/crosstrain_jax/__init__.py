"""crosstrain-jax: a jax backend for crosstrain, registered only through the ``crosstrain``
entry-point group, the way any third-party backend would be.

Importing this package does not import jax.
"""

from crosstrain_jax.strategy import JaxState, JaxStrategy

__all__ = ["JaxState", "JaxStrategy"]
__version__ = "0.1.0"
