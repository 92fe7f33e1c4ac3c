"""Server-side aggregation against the machine's memory bandwidth.

    python -m benchmarks.aggregation [--clients 100] [--values 10_000_000] [--repeats 3]
        [--relevance-clients 64] [--relevance-values 1_000_000]

K clients' updates of P float32 values, laid out as LoRA factors (tensors of 16 x 4096
and 4096 x 16), are averaged by FedAvg's weighted mean (``FedAvg.combine_flat``: the
block-by-block float32 accumulation of :func:`fedloom.params.weighted_mean_flat`). The mean has to
read every value once, K·P·4 bytes, so its effective bandwidth is that over its time;
the machine's is the best of ``torch.sum`` over one contiguous tensor of the same size
(a read-only pass). The former matrix path (flatten and stack every client into a K x P
float32 matrix, copy it to float64, one product) runs at ``--matrix-clients`` clients
(default K / 4: at K = 100 and P = 10 M it needs 12 GB beside the updates).

FedMosaic's personalized aggregation gives each of ``--relevance-clients`` clients its own
relevance-weighted mean of the others' adapters of ``--relevance-values`` values:
``FedMosaic.payloads`` computes all of them with one product per tensor (every adapter
read once), against one client at a time (``FedMosaic.payload``: every adapter read once
per client).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from fedloom.algorithms import ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.fedmosaic import TASK_VECTOR, FedMosaic
from fedloom.params import Params, stack

SHAPES = ((16, 4096), (4096, 16))

#: the mean reads no server state
NO_STATE = ServerState(0, {})


def updates(clients: int, values: int, seed: int = 0) -> list[Params]:
    """``clients`` random updates of about ``values`` float32 values in LoRA-factor tensors."""
    per = SHAPES[0][0] * SHAPES[0][1]
    generator = torch.Generator().manual_seed(seed)
    return [{f"layer{i}.lora_{'AB'[i % 2]}": torch.randn(SHAPES[i % 2], generator=generator)
             for i in range(max(1, values // per))} for _ in range(clients)]


def best_of(repeats: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--values", type=int, default=10_000_000)
    parser.add_argument("--matrix-clients", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--relevance-clients", type=int, default=64)
    parser.add_argument("--relevance-values", type=int, default=1_000_000)
    args = parser.parse_args()
    fedavg = FedAvg()
    out: dict[str, float | int] = {"threads": torch.get_num_threads()}

    clients = updates(args.clients, args.values)
    names = sorted(clients[0])
    p = sum(t.numel() for t in clients[0].values())
    results = [ClientResult(k, c, 1 + k % 7, {}) for k, c in enumerate(clients)]
    gigabytes = args.clients * p * 4 / 1e9
    streamed = best_of(args.repeats, lambda: fedavg.combine_flat(NO_STATE, results, names))
    del results, clients
    contiguous = torch.randn(args.clients * p)
    read = best_of(args.repeats, contiguous.sum)
    del contiguous
    out |= {"clients": args.clients, "values": p, "gigabytes": round(gigabytes, 3),
            "machine_read_gb_per_s": round(gigabytes / read, 2),
            "mean_s": round(streamed, 4), "mean_gb_per_s": round(gigabytes / streamed, 2),
            "mean_share_of_bandwidth": round(read / streamed, 3)}

    small = args.matrix_clients or max(1, args.clients // 4)
    clients = updates(small, args.values, seed=1)
    results = [ClientResult(k, c, 1 + k % 7, {}) for k, c in enumerate(clients)]
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)

    def matrix_mean() -> torch.Tensor:
        return (weights / weights.sum()) @ stack(clients, names).double()

    small_gb = small * p * 4 / 1e9
    matrix = best_of(args.repeats, matrix_mean)
    streamed_small = best_of(args.repeats, lambda: fedavg.combine_flat(NO_STATE, results, names))
    out |= {"matrix_clients": small, "matrix_mean_s": round(matrix, 4),
            "streamed_mean_s_same_clients": round(streamed_small, 4),
            "matrix_gb_per_s": round(small_gb / matrix, 2),
            "speedup_over_matrix": round(matrix / streamed_small, 2)}
    out |= relevance_aggregation(args.relevance_clients, args.relevance_values, args.repeats)
    print(json.dumps(out, indent=2))


def relevance_aggregation(clients: int, values: int, repeats: int) -> dict[str, float | int]:
    """All of FedMosaic's personalized aggregates at once against one client at a time."""
    adapters = [{f"{n}.local.weight": t for n, t in u.items()} for u in updates(clients, values, 2)]
    initial = {f"{n}.global.weight": torch.zeros_like(t) for n, t in updates(1, values)[0].items()}
    alg = FedMosaic()
    generator = torch.Generator().manual_seed(3)
    results = [ClientResult(k, {**a, TASK_VECTOR: torch.randn(32, 128, generator=generator)},
                            1, {}) for k, a in enumerate(adapters)]
    state = alg.aggregate(alg.init(initial), results)
    ids = list(range(clients))
    together = best_of(repeats, lambda: alg.payloads(state, ids))
    one_by_one = best_of(repeats, lambda: [alg.payload(state, c) for c in ids])
    gigabytes = clients * sum(t.numel() for t in adapters[0].values()) * 4 / 1e9
    return {"relevance_clients": clients, "relevance_gigabytes": round(gigabytes, 3),
            "relevance_all_at_once_s": round(together, 4),
            "relevance_one_by_one_s": round(one_by_one, 4),
            "relevance_speedup": round(one_by_one / together, 2)}


if __name__ == "__main__":
    main()
