"""The engine's arguments to :class:`~kvtier.tier.KVTier`, checked and as the tier uses them: its config, the
options of its lower tiers and shared pools, token ids and device slot indices."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import torch

from kvtier._checks import model_identity as check_model_identity
from kvtier.config import TierConfig

__all__ = ["as_config", "lower_tier_identity", "store_layers", "as_tokens", "as_slots"]


def as_config(config) -> TierConfig:
    """A :class:`TierConfig`, a mapping of a kvtier config file's keys (checked as the file's would be), or None
    (``$KVTIER_CONFIG``, else the defaults)."""
    if isinstance(config, Mapping):
        return TierConfig.from_dict(config)
    if config is not None and not isinstance(config, TierConfig):
        raise TypeError(f"KVTier: config must be a TierConfig, a mapping of its keys or None ($KVTIER_CONFIG), "
                        f"got {type(config).__name__}")
    return config if config is not None else TierConfig.from_env()


def lower_tier_identity(asked: list[str], finalize: str, identity: Optional[Mapping]) -> Optional[Mapping]:
    """The model identity the lower tiers ``asked`` for need (checked), or an error naming what is missing."""
    if finalize not in ("auto", "ordered"):
        raise ValueError(f"finalize must be 'auto' or 'ordered', got {finalize!r}")
    for name in asked:
        if identity is None:
            raise ValueError(f"the {name} tier needs model_identity (model path and revision, TP rank and size): "
                             "its blocks outlive the process, and another model must never read them")
    return check_model_identity(identity) if asked else identity


def store_layers(layers: Optional[range], num_layers: int) -> range:
    """The layers a store copies: all by default, else a range of consecutive layers within the model's."""
    every = range(num_layers)
    if layers is None:
        return every
    if not isinstance(layers, range) or layers.step != 1 or (
            len(layers) and (layers.start < 0 or layers.stop > num_layers)):
        raise ValueError(f"store_layers must be a range of consecutive layers within {every}, got {layers!r}")
    return layers


def as_tokens(tokens) -> np.ndarray:
    """Token ids as a contiguous array; an empty sequence (``[]`` is float64 to numpy) as empty int64: no page."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    toks = np.ascontiguousarray(np.asarray(tokens))
    return toks.astype(np.int64) if toks.size == 0 else toks


def as_slots(slots, name: str = "slot_indices") -> torch.Tensor:
    """Slot indices as a 1-D int64 tensor; TypeError naming ``name`` for anything but integers (a float or bool
    slot is no index: it is not truncated), ValueError for another shape."""
    if not isinstance(slots, torch.Tensor):
        arr = np.asarray(slots)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {arr.dtype} values (floats and bools are not indices)")
        slots = torch.as_tensor(arr.astype(np.int64, copy=False))
    elif slots.dtype == torch.bool or slots.dtype.is_floating_point or slots.dtype.is_complex:
        raise TypeError(f"{name} must hold integers, got {slots.dtype} values (floats and bools are not indices)")
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    return slots
