"""The torch backend: DDP over gloo (CPU) or NCCL (one process per GPU), launched by
torch's elastic agent. Importing this package does not import torch."""
