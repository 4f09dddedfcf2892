"""Rotary position embeddings as a table, for evidence that needs queries before RoPE.

Both serving paths hand attention post-RoPE queries, and the cache holds post-RoPE keys
(evicted tokens keep their positions; nothing is re-rotated). Expected attention needs
the statistics of the queries *before* rotation, so it un-rotates the captured rows (the
logical position of each is known) and rotates their mean and covariance forward by the
average rotation over the positions to come. :class:`Rotary` is that rotation read from
the model's own table (vLLM's ``cos_sin_cache``, or transformers' rotary module), so
every RoPE scaling the model uses comes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Rotary"]


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding as a position table.

    Attributes
    ----------
    cos_sin : Tensor[P, rot_dim]
        Row ``p`` holds ``cos(p * f_i)`` for the ``rot_dim / 2`` frequencies, then
        ``sin(p * f_i)`` (vLLM's ``cos_sin_cache`` layout; any attention scaling is
        folded in). Positions past ``P - 1`` read row ``P - 1``.
    neox : bool
        Pairs are ``(i, i + rot_dim / 2)`` (GPT-NeoX, Llama in transformers and vLLM);
        False: ``(2i, 2i + 1)`` (GPT-J).
    head_size : int
        Channels per head; channels past ``rot_dim`` are not rotated.
    offset : int
        First rotated channel (default 0): the rotated channels are ``offset ..
        offset + rot_dim - 1``, the others are not rotated. A multi-head latent attention
        query ``[q_nope @ W_UK_T (kv_lora_rank) | q_pe (qk_rope_head_dim)]`` rotates
        only its last ``qk_rope_head_dim`` channels (``offset = kv_lora_rank``).
    """

    cos_sin: torch.Tensor
    neox: bool
    head_size: int
    offset: int = 0

    def __post_init__(self) -> None:
        if self.cos_sin.dim() != 2 or self.cos_sin.shape[1] % 2 or self.cos_sin.shape[0] < 1:
            raise ValueError(f"cos_sin must be [P, rot_dim] with an even rot_dim, got "
                             f"{tuple(self.cos_sin.shape)}")
        if self.offset < 0 or self.offset + self.cos_sin.shape[1] > self.head_size:
            raise ValueError(f"rot_dim {self.cos_sin.shape[1]} from offset {self.offset} "
                             f"exceeds head_size {self.head_size}")

    @property
    def rot_dim(self) -> int:
        return int(self.cos_sin.shape[1])

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.cos_sin.to(positions.device, torch.float32)
        rows = table[positions.long().clamp(0, table.shape[0] - 1)]
        half = self.rot_dim // 2
        return rows[..., :half], rows[..., half:]

    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.rot_dim // 2
        idx = torch.arange(half)
        if self.neox:
            return idx + self.offset, idx + half + self.offset
        return 2 * idx + self.offset, 2 * idx + 1 + self.offset

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [..., W, H, D]`` rotated at ``positions [..., W]`` brought back to position
        0 (the inverse rotation), in float32."""
        cos, sin = self._cos_sin(positions)  # [..., W, half]
        # A scaled table (YaRN's mscale) rotates by s * R(p): its inverse is R(p)^T / s.
        scale2 = (cos * cos + sin * sin).clamp_min(1e-12)
        cos, sin = (cos / scale2).unsqueeze(-2), (sin / scale2).unsqueeze(-2)
        first, second = self._pairs()
        x = x.float()
        out = x.clone()
        x1, x2 = x[..., first.to(x.device)], x[..., second.to(x.device)]
        out[..., first.to(x.device)] = x1 * cos + x2 * sin
        out[..., second.to(x.device)] = x2 * cos - x1 * sin
        return out

    def mean_rotation(self, start: torch.Tensor, count: int) -> torch.Tensor:
        """The average rotation matrix over positions ``start .. start + count - 1``.

        Parameters
        ----------
        start : LongTensor[R]
            First future position of each of R sequences.
        count : int
            Positions averaged (>= 1).

        Returns
        -------
        Tensor[R, D, D] (float32): ``mean_p R(p)`` (not a rotation: each pair's 2x2
        block is ``[[c, -s], [s, c]]`` with the mean cosine and sine), identity on the
        channels not rotated.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        r = int(start.shape[0])
        pos = start.long().view(r, 1) + torch.arange(count, device=start.device).view(1, -1)
        cos, sin = self._cos_sin(pos)  # [R, count, half]
        cos, sin = cos.mean(dim=1), sin.mean(dim=1)  # [R, half]
        d = self.head_size
        out = torch.eye(d, dtype=torch.float32, device=start.device).repeat(r, 1, 1)
        first, second = (t.to(start.device) for t in self._pairs())
        out[:, first, first] = cos
        out[:, second, second] = cos
        out[:, first, second] = -sin
        out[:, second, first] = sin
        return out

    @classmethod
    def from_inv_freq(cls, inv_freq: torch.Tensor, positions: int, *, head_size: int,
                      scaling: float = 1.0, neox: bool = True) -> Rotary:
        """A table of ``positions`` rows from the frequencies ``inv_freq [rot_dim / 2]``
        (times ``scaling``, transformers' ``attention_scaling``)."""
        t = torch.arange(int(positions), dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float().cpu())
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * float(scaling)
        return cls(table, neox=neox, head_size=int(head_size))
