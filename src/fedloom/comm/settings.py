"""The settings that choose a compressor, shared by the ``compress`` transforms and the
algorithms built on compression (DIANA, ADIANA, MARINA, EF21): ``compressor`` names the
operator, the other fields are its hyperparameters (unset ones take the operator's
defaults; one the operator does not have is refused by name)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated

from pydantic import AllowInfNan

from fedloom.comm.compressors import Compressor, create

#: the operators' hyperparameters, as every section that chooses one spells them
HYPERPARAMETERS = ("k", "ratio", "levels", "norm", "rank")


@dataclass(frozen=True)
class CompressionSettings:
    #: the operator (:mod:`fedloom.comm.compressors`)
    compressor: str = "identity"
    #: top-k / random-k: the number of coordinates kept (or ``ratio``, the fraction)
    k: int | None = None
    ratio: float | None = None
    #: QSGD / (p, s)-quantization: s, the number of levels
    levels: int | None = None
    #: (p, s)-quantization: p, the norm the levels are scaled by (``inf`` allowed)
    norm: Annotated[float, AllowInfNan()] | None = None
    #: PowerSGD: r, the rank of the low-rank approximation
    rank: int | None = None

    @functools.cached_property
    def operator(self) -> Compressor:
        """The operator, built once (:meth:`build_compressor`)."""
        return self.build_compressor()

    def build_compressor(self) -> Compressor:
        """The operator these settings choose (a ``ValueError`` naming the key)."""
        hp = {n: getattr(self, n) for n in HYPERPARAMETERS if getattr(self, n) is not None}
        return create(self.compressor, **hp)
