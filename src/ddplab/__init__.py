"""ddplab: distributed data-parallel PyTorch training as reproducible, tracked experiments."""

__version__ = "0.1.0"
