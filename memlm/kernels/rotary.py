"""Rotary positions (Su et al., 2021) in the fewest ops, for decoding steps: a one-token step rotates its queries and
keys with the same cos and sin in every layer, so the rotate-half sign is folded into the sine once per step."""

import torch

__all__ = ["rotate", "signed_sine"]


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """[−sin₁, sin₂] of sin = [sin₁, sin₂] (…, d), for `rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`modeling.layers.apply_rotary` in fewer ops: x·cos + [−x₂, x₁]·sin = x·cos + roll(x, d/2)·[−sin₁, sin₂], the
    same numbers (a negation moves only a sign bit); `signed_sin` from `signed_sine`, made once per step."""
    rolled = states.roll(states.shape[-1] // 2, dims=-1)
    if states.dtype in (torch.float32, torch.float64):  # already at least float32: no conversions
        return states * cos + rolled * signed_sin
    return (states.float() * cos + rolled.float() * signed_sin).to(states.dtype)
