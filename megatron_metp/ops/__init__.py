"""METP operators: autograd functions over explicit METP process groups."""

from .mlp import metp_mlp

__all__ = ["metp_mlp"]
