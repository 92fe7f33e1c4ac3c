"""The neighbour graph: who masks with whom and who holds whose shares.

The rule. SecAgg (Bonawitz et al. 2017, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning") masks every pair of clients: the complete graph,
O(n) keys, shares and mask expansions per client, O(n²) for the server. SecAgg+ (Bell
et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead") masks
and shares only along a sparse random graph of degree k = O(log n); in
practice they take a Harary graph H(k, n) whose nodes are the clients in a random
order, which is what this module builds from a seed the server announces, so that
every client can derive the same graph and check its neighbours.

H(k, n), on positions 0..n−1 of a ring:

* k even: each position is joined to the k/2 nearest on each side (offsets 1..k/2): exactly
  k-regular;
* k odd, n even: the same with offsets 1..(k−1)/2, plus the opposite position (offset
  n/2): exactly k-regular;
* k odd, n odd: offsets 1..(k−1)/2, plus position i joined to i + (n−1)/2 for
  i = 0..(n−1)/2: every node has degree k but position (n−1)/2, which has k + 1 (a k-regular
  graph on an odd number of nodes does not exist);
* k ≥ n − 1: the complete graph, degree n − 1.

The clients are placed on the positions by a permutation drawn from the 32-byte seed
(numpy's PCG64 through a ``SeedSequence`` fed all 256 bits: the graph is public, so a
non-cryptographic generator is fine here, unlike the masks).

The default degree (:func:`default_neighbours`) is k = 2·⌈log2 n⌉, capped at n − 1: the
O(log n) of the paper with the constant 2 and made even, so that the graph is exactly
k-regular. How fedloom differs: Bell et al. derive k from their security parameters and
the fractions of corrupt and dropped clients it must tolerate (the constants in front of
log n depend on those); fedloom's default is a cost-minded choice, and a round that needs more drop-out tolerance
sets ``secagg.neighbours``. Flower's SecAgg+ shuffles the clients with
Python's ``random`` on the server only and joins each to the ⌊s/2⌋ nearest on each side
(s shares, odd); the clients cannot check their neighbours against a seed.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np

Graph = dict[int, frozenset[int]]


def new_seed() -> bytes:
    """A fresh 32-byte graph seed for the server to announce."""
    return secrets.token_bytes(32)


def default_neighbours(clients: int) -> int:
    """k = min(n − 1, 2·⌈log2 n⌉)."""
    if clients < 2:
        return 0
    return min(clients - 1, 2 * math.ceil(math.log2(clients)))


def harary(n: int, k: int) -> list[set[int]]:
    """The Harary graph H(k, n) on positions 0..n−1, as adjacency sets."""
    if n < 1 or k < 0:
        raise ValueError(f"secagg: no Harary graph with n = {n}, k = {k}")
    adj: list[set[int]] = [set() for _ in range(n)]

    def join(a: int, b: int) -> None:
        a, b = a % n, b % n
        if a != b:
            adj[a].add(b)
            adj[b].add(a)

    if k >= n - 1:
        for i in range(n):
            for j in range(i + 1, n):
                join(i, j)
        return adj
    for i in range(n):
        for offset in range(1, k // 2 + 1):
            join(i, i + offset)
    if k % 2:
        if n % 2 == 0:
            for i in range(n // 2):
                join(i, i + n // 2)
        else:
            for i in range((n - 1) // 2 + 1):
                join(i, i + (n - 1) // 2)
    return adj


def neighbour_graph(clients: Sequence[int], k: int, seed: bytes) -> Graph:
    """SecAgg+'s graph: H(k, n) over ``clients`` placed in the order a permutation drawn
    from ``seed`` gives; the same for every party that knows the clients and the seed."""
    if len(seed) != 32:
        raise ValueError(f"secagg: a graph seed of {len(seed)} bytes (32 needed)")
    ordered = sorted(set(clients))
    if len(ordered) != len(clients):
        raise ValueError(f"secagg: repeated client ids in {list(clients)}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(seed))))
    placed = [ordered[i] for i in rng.permutation(len(ordered))]
    adj = harary(len(placed), k)
    return {placed[i]: frozenset(placed[j] for j in adj[i]) for i in range(len(placed))}


def complete_graph(clients: Sequence[int]) -> Graph:
    """SecAgg's graph: every client is every other's neighbour."""
    everyone = frozenset(clients)
    return {c: everyone - {c} for c in clients}
