"""Framework-neutral core: plans, layers, data, the loop and the strategy protocol.
Nothing in this package imports torch, tensorflow or jax."""
