"""Position-weighted checksums of a destination shard, computable on either side.

After a sync the receiver checksums each parameter it received; the sender
checksums what it sent, placed where the receiver put it. Equal sums per
parameter mean the right values landed in the right places; a difference names
the parameter. Weights depend on the element's position in the destination
parameter, so rows in the wrong order are caught too.
"""

from __future__ import annotations

import torch


def _position_weights(shape: tuple[int, ...], dim: int, offset: int, region_shape: tuple[int, ...]) -> torch.Tensor:
    """Weights of the elements of a region at ``offset`` along ``dim`` of a tensor of ``shape``."""
    index = []
    for axis, size in enumerate(region_shape):
        start = offset if axis == dim else 0
        index.append(torch.arange(start, start + size, dtype=torch.float64))
    if len(index) == 1:
        flat = index[0]
    else:
        rows, cols = torch.meshgrid(index[0], index[1], indexing="ij")
        flat = rows * shape[1] + cols
    return 1.0 + torch.remainder(flat * 0.6180339887, 1.0)


def region_checksum(values: torch.Tensor, shape: tuple[int, ...], dim: int, offset: int) -> float:
    """Checksum contribution of ``values`` placed at ``offset`` along ``dim`` in a tensor of ``shape``."""
    weights = _position_weights(tuple(shape), dim, offset, tuple(values.shape))
    return float((values.detach().to("cpu", torch.float64) * weights).sum())


def tensor_checksum(tensor: torch.Tensor) -> float:
    return region_checksum(tensor, tuple(tensor.shape), 0, 0)
