"""Compressor families, each a module registered by name."""

from .base import Compressor, compressor_class, compressor_names, register
from .onebit import OneBitCompressor, OneBitPayload
from .topk import TopKCompressor, TopKPayload

__all__ = [
    "Compressor",
    "OneBitCompressor",
    "OneBitPayload",
    "TopKCompressor",
    "TopKPayload",
    "compressor_class",
    "compressor_names",
    "register",
]
