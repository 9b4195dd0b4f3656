"""Error measures shared by the parity tests."""

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """Norm-wise relative error ‖a − b‖ / ‖b‖, computed in float64. ``floor``: the scale to
    measure against where the exact ``b`` is zero (e.g. dq and dk when every document is one
    token long, whose softmax is constant: pass the norm of a gradient of the same op)."""
    a, b = a.double(), b.double()
    denom = b.norm()
    if floor and denom == 0:
        denom = torch.tensor(floor, dtype=torch.float64)
    return ((a - b).norm() / denom.clamp_min(1e-30)).item()
