"""METP ops have first-order gradients only: a double backward is refused before any transfer.

A backward run with ``create_graph=True`` (``torch.autograd.grad(..., create_graph=True)``,
gradient penalties, Hessian-vector products) would record the ring's buffers and in-place
accumulations in a graph; instead the op's backward raises :class:`DoubleBackwardError` (a
``ValueError``) naming the op and the argument, on every rank of the ring alike (each rank runs
the same backward), before it sends anything.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["DoubleBackwardError", "first_order_only"]


class DoubleBackwardError(ValueError):
    """A METP op's backward was asked to build a graph of itself (``create_graph=True``)."""


def first_order_only(op: str):
    """Decorate an ``autograd.Function.backward`` (below ``@staticmethod``): refuse
    ``create_graph=True`` (inside a backward, grad mode is on exactly then)."""

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise DoubleBackwardError(
                    f"METP {op}: double backward is not supported (backward was called with "
                    f"create_graph=True, e.g. torch.autograd.grad(..., create_graph=True)); the "
                    f"METP ops have first-order gradients only: call backward without "
                    f"create_graph")
            return backward(ctx, *grads)

        return checked

    return decorate
