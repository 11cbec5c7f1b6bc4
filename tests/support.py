"""Helpers for tests that read what a real run wrote: crosstrain.testing's, in one place."""

from crosstrain.testing import assert_same_eval, max_relative_difference, step_losses, summary

__all__ = ["assert_same_eval", "max_relative_difference", "step_losses", "summary"]
