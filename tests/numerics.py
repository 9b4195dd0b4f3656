"""Error measures shared by the parity tests."""

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ‖a − b‖ / ‖b‖, computed in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
