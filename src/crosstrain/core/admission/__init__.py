"""What is checked before any process starts: the plan against the data, the cluster, the run folder."""
