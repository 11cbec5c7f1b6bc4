"""Rows and batches: the sources, the global sampler, scaling, augmentation, tokens."""
