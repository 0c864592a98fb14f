"""distribuuuu: config-driven distributed image classification on native PyTorch."""

__version__ = "0.1.0"
