"""What random-k and top-k share: the number k of coordinates they keep, given as ``k`` or
as a ``ratio`` of the d values (k = ⌈ratio · d⌉, at least 1; 0.01 when neither is given,
refused when both are, or when k > d)."""

from __future__ import annotations

from dataclasses import dataclass

from fedloom.comm.compressors.base import Compressor
from fedloom.comm.compressors.coding import check_k_ratio, kept

#: the fraction kept when neither k nor ratio is given
DEFAULT_RATIO = 0.01


@dataclass(frozen=True)
class Sparsifier(Compressor):
    """A compressor that keeps k of the d coordinates."""

    #: the number of coordinates kept
    k: int | None = None
    #: or the fraction of them (k = ⌈ratio · d⌉); 0.01 when neither is given
    ratio: float | None = None

    def __post_init__(self) -> None:
        check_k_ratio(self.k, self.ratio)
        if self.k is None and self.ratio is None:
            object.__setattr__(self, "ratio", DEFAULT_RATIO)

    def kept(self, d: int) -> int:
        """k for a vector of d values (a ``ValueError`` when k > d)."""
        return kept(self.k, self.ratio, d)

    def check(self, numel: int) -> None:
        self.kept(numel)
