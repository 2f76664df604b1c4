"""xlaserve: an inference server for XLA-compiled models.

The public face is small: what a bundle's ``model.py`` needs.
"""
from xlaserve._hooks import NamedTensor, register_model

__all__ = ["NamedTensor", "register_model"]
__version__ = "0.1.0"
