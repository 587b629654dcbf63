"""Shared layer of the MoE backward kernels: routing, MX numerics, references, dispatch, CLI."""

from common._version import __version__

__all__ = ["__version__"]
