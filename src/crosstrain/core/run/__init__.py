"""A run: the strategy protocol, the job, and the training loop every backend drives."""
