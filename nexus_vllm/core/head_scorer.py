"""A learned stand-in for KVzip's reconstruction score per (layer, KV head, token).

KVzip scores a cached pair by the attention the model pays it while repeating the context:
at head granularity that score, one threshold over every (layer, KV head, token), keeps
94% of dense's answers on long documents in ``stream`` where every score the forward
reads for itself keeps none (``docs/results.md``, "Head-paged KV"). It costs a second
forward over the prompt. KVzap's answer is a small map per layer from what the layer
already computes to the score: here a linear one, from the attention input (the layer's
input norm's output) of each token to ``log(score)`` of each KV head, trained by ridge
regression on reconstruction scores of text outside every evaluation set
(``scripts/train_head_scorer.py``). It costs one ``[D, Hkv]`` product per token and
layer, once, when the token is fed.

Scorers ship per model in ``head_scorers/`` (a ``.pt`` file of tensors and metadata,
loaded with ``weights_only``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from ._validate import ConfigError, load_shipped_or_file

__all__ = ["SCORERS_DIR", "HeadScorer", "load_head_scorer", "shipped_head_scorers"]

SCORERS_DIR = pathlib.Path(__file__).with_name("head_scorers")


@dataclass(frozen=True)
class HeadScorer:
    """Per full-attention layer, a linear map from a token's attention input to the
    predicted ``log`` reconstruction score of each KV head.

    Attributes
    ----------
    model : str
        The model it was trained on (a name, for messages).
    weight : Tensor[L, D, Hkv]
        ``L`` the model's full-attention layers in order, ``D`` its hidden size.
    bias : Tensor[L, Hkv]
    source : str
        The command that trained it.
    """

    model: str
    weight: torch.Tensor
    bias: torch.Tensor
    source: str = ""

    def __post_init__(self) -> None:
        if self.weight.dim() != 3 or tuple(self.bias.shape) != (self.weight.shape[0],
                                                                 self.weight.shape[2]):
            raise ValueError(f"a head scorer's weight is [L, D, Hkv] and its bias [L, Hkv]; "
                             f"got {tuple(self.weight.shape)} and {tuple(self.bias.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, hidden size, KV heads)``."""
        layers, hidden, heads = self.weight.shape
        return int(layers), int(hidden), int(heads)

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The predicted score of ``hidden`` (``[T, D]``, the ``layer``-th full layer's
        attention input) per KV head: ``[Hkv, T]`` float32."""
        w = self.weight[layer].to(hidden.device)
        b = self.bias[layer].to(hidden.device)
        return (hidden.float() @ w + b).transpose(0, 1)

    def check_model(self, layers: int, hidden: int, heads: int, ref: str) -> None:
        """Raise a :class:`ConfigError` naming ``head_scorer`` unless the scorer fits a
        model with ``layers`` full layers, hidden size ``hidden`` and ``heads`` KV heads."""
        if self.shape != (layers, hidden, heads):
            raise ConfigError("head_scorer", f"head_scorer {ref!r} was trained on "
                              f"{self.model} (full layers, hidden size, KV heads = "
                              f"{self.shape}); this model has {(layers, hidden, heads)}")

    def save(self, path: str | pathlib.Path) -> None:
        torch.save({"model": self.model, "source": self.source,
                    "weight": self.weight.float().contiguous(),
                    "bias": self.bias.float().contiguous()}, str(path))


def shipped_head_scorers() -> list[str]:
    """The names ``head_scorer`` takes without a path."""
    return sorted(p.stem for p in SCORERS_DIR.glob("*.pt"))


def load_head_scorer(ref: str) -> HeadScorer:
    """A shipped scorer by name (``smollm2-135m-instruct``) or a ``.pt`` file's path.

    Raises
    ------
    ConfigError
        Naming ``head_scorer``: no such scorer, or not a scorer.
    """
    return load_shipped_or_file(ref, SCORERS_DIR, ".pt", "head_scorer", "scorer",
                                _read_head_scorer,
                                (ValueError, KeyError, TypeError, RuntimeError, AttributeError))


def _read_head_scorer(path: pathlib.Path) -> HeadScorer:
    data: dict[str, Any] = torch.load(str(path), map_location="cpu", weights_only=True)
    return HeadScorer(model=str(data["model"]), weight=data["weight"].float(),
                      bias=data["bias"].float(), source=str(data.get("source", "")))
