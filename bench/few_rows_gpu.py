"""The target's linear layers at the few rows a verification pass feeds them, each way of
computing them side by side in one process: what a chain's verify of 8 rows costs against a
plain step's 1 row. On an H200 a SmolLM2 step's 8-row linears took 2.77 ms of float32 GEMMs
(cuBLAS's 32x128 tiles: about 12 thread blocks a product over K = 576) where one row's gemv
took 0.74 ms (bench/results/decode_gpu_split_keys_profile_h200.json).

Every layer's products (q, k, v, o, gate, up, down; then the output head) are recorded as one
CUDA graph per way and row count, as eval's static path records them, and replayed: median
milliseconds a pass, and each way's time over float32 `F.linear` at the same rows. Ways:
`linear` (today: F.linear, float32), `nn` (x @ W^T with W^T stored contiguous), `split4`
(K cut into 4 parts, one batched product, then a sum), `tf32` (F.linear with TF32 allowed:
other numerics) and `bf16` (bf16 weights: other numerics). Random weights.

  PYTHONPATH=src python3 bench/few_rows_gpu.py --out OUT/few_rows.json            # ~1 min
  PYTHONPATH=src python3 bench/few_rows_gpu.py --smoke --out /tmp/few_rows.json    # CPU, eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, dump, git, say, sync  # noqa: E402

SHAPES = {  # hidden, intermediate, query heads x head dim, KV heads x head dim, layers, vocab
    "135m": (576, 1536, 576, 192, 30, 49152),
    "8b": (4096, 14336, 4096, 1024, 32, 128256),
}
WAYS = ("linear", "nn", "split4", "tf32", "bf16")


def layer_weights(shape: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """[out, in] weights of every product one pass runs: per layer q, k, v, o, gate, up, down;
    then the output head."""
    h, inter, q, kv, layers, vocab = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    one = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    dims = one * layers + [(vocab, h)]
    return [torch.randn(o, i, generator=g, device=device, dtype=dtype) * i**-0.5 for o, i in dims]


def products(way: str, weights: list[torch.Tensor]):
    """fn(xs) -> outputs: each weight's product with the input of its width, computed `way`."""
    if way == "nn":
        transposed = [w.t().contiguous() for w in weights]  # [in, out]
        return lambda xs: [xs[w.shape[0]] @ w for w in transposed]
    if way == "split4":
        parts = [w.t().contiguous().view(4, w.shape[1] // 4, w.shape[0]) for w in weights]  # [4, in/4, out]
        return lambda xs: [torch.bmm(xs[p.shape[0] * p.shape[1]].view(-1, 4, p.shape[1]).transpose(0, 1), p).sum(0)
                           for p in parts]
    return lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights]


def time_way(way: str, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Median milliseconds of one pass's products at `rows` rows, replayed as a graph on CUDA."""
    device, dtype = weights[0].device, weights[0].dtype
    xs = {k: torch.randn(rows, k, device=device, dtype=dtype) for k in {w.shape[1] for w in weights}}  # [rows, in]
    fn = products(way, weights)
    torch.backends.cuda.matmul.allow_tf32 = way == "tf32"
    try:
        if device.type == "cuda":
            from eyas.models.graphs import capture

            graph, _ = capture(lambda: fn(xs))
            run = graph.replay
        else:
            run = lambda: fn(xs)  # noqa: E731
        for _ in range(3):
            run()
        sync(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            sync(device)
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", type=lambda t: t.split(","), default=["135m"],
                   help="of 135m (SmolLM2's) and 8b (Llama-3.1-8B's: 32 GiB of float32 weights, twice over for nn and split4)")
    p.add_argument("--rows", type=lambda t: [int(r) for r in t.split(",")], default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--ways", type=lambda t: t.split(","), default=list(WAYS))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU, the small shape, 2 row counts: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.device, args.shapes, args.rows, args.repeats = "cpu", ["135m"], [1, 8], 2
    if unknown := set(args.ways) - set(WAYS):
        p.error(f"--ways: unknown {sorted(unknown)}; choose from {','.join(WAYS)}")
    device = torch.device(args.device)
    report: dict = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
                    "settings": vars(args), "ms": {}, "over_linear": {}, "over_one_row": {}}
    for shape in args.shapes:
        ms = report["ms"][shape] = {rows: {} for rows in args.rows}
        for dtype in (torch.float32, torch.bfloat16):
            ways = [w for w in args.ways if (w == "bf16") == (dtype == torch.bfloat16)]
            if not ways:
                continue
            weights = layer_weights(shape, dtype, device)
            for rows in args.rows:
                for way in ways:
                    ms[rows][way] = round(time_way(way, weights, rows, args.repeats), 4)
            del weights
        for rows in args.rows:
            say(f"{shape} rows {rows}: " + ", ".join(f"{w} {t:.3f} ms" for w, t in ms[rows].items()))
        if "linear" in args.ways:
            report["over_linear"][shape] = {r: {w: round(t / ms[r]["linear"], 3) for w, t in m.items()}
                                            for r, m in ms.items()}
            report["over_one_row"][shape] = {r: round(m["linear"] / ms[args.rows[0]]["linear"], 3) for r, m in ms.items()}
    dump(Path(args.out), report)
    say({k: report[k] for k in ("over_linear", "over_one_row")})


if __name__ == "__main__":
    main()
