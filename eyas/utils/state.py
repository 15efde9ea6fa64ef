"""Strict loading of a module's tensors from a safetensors state: every name and shape checked."""

from __future__ import annotations

from typing import Collection

import torch
from torch import Tensor, nn

from eyas.errors import EyasError


def check_state(expected: dict[str, Tensor], state: dict[str, Tensor], source: str, what: str,
                optional: Collection[str] = ()) -> None:
    """Raise EyasError unless `state` holds exactly the tensors named in `expected` (those in
    `optional` may be left out), each of the expected shape. `what` names the module."""
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise EyasError(f"{source} does not match {what}: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise EyasError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config implies "
                            f"{tuple(expected[name].shape)}")


def copy_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy the tensors of `state` into the module's parameters and buffers of the same names
    (converted to their dtypes); names absent from `state` keep their values."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in state:
                tensor.copy_(state[name])
