"""Server-side aggregation against the machine's memory bandwidth.

    python -m benchmarks.aggregation [--clients 100] [--values 10_000_000] [--repeats 3]

K clients' updates of P float32 values, laid out as LoRA factors (tensors of 16 x 4096
and 4096 x 16), are averaged by FedAvg's weighted mean (``FedAvg.combine_flat``: the
block-by-block float32 accumulation of :func:`fedloom.params.weighted_mean_flat`). The mean has to
read every value once, K·P·4 bytes, so its effective bandwidth is that over its time;
the machine's is the best of ``torch.sum`` over one contiguous tensor of the same size
(a read-only pass). The former matrix path (flatten and stack every client into a K x P
float32 matrix, copy it to float64, one product) runs at ``--matrix-clients`` clients
(default K / 4: at K = 100 and P = 10 M it needs 12 GB beside the updates).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from fedloom.algorithms import ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.params import Params, stack

SHAPES = ((16, 4096), (4096, 16))


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
    args = parser.parse_args()
    fedavg = FedAvg()
    out: dict[str, float | int] = {"threads": torch.get_num_threads()}

    clients = updates(args.clients, args.values)
    names = sorted(clients[0])
    p = sum(t.numel() for t in clients[0].values())
    results = [ClientResult(k, c, 1 + k % 7, {}) for k, c in enumerate(clients)]
    gigabytes = args.clients * p * 4 / 1e9
    streamed = best_of(args.repeats, lambda: fedavg.combine_flat(results, names))
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
    streamed_small = best_of(args.repeats, lambda: fedavg.combine_flat(results, names))
    out |= {"matrix_clients": small, "matrix_mean_s": round(matrix, 4),
            "streamed_mean_s_same_clients": round(streamed_small, 4),
            "matrix_gb_per_s": round(small_gb / matrix, 2),
            "speedup_over_matrix": round(matrix / streamed_small, 2)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
