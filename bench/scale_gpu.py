"""Scale-out benchmark: data-parallel capture and training throughput at G = 1, 2, ... GPUs.

Builds a random-weight Llama-shaped target (speed does not depend on weight values) and
random prepared samples, then, in one run:
  1. pure forward throughput of the target on GPU 0 over the same token-budget batches,
  2. `torchrun --nproc-per-node G -m eyas capture` end to end into a store, for each G,
  3. a check that every G-GPU store equals the 1-GPU store (same samples and tokens;
     hidden states within bf16 batch-shape noise),
  4. `torchrun --nproc-per-node G -m eyas train` throughput on the 1-GPU store, for each G.
It prints capture/forward, and the per-GPU scaling efficiency throughput_G / (G x
throughput_1) for capture and training, with the absolute figures, and writes JSON.

  PYTHONPATH=src python3 bench/scale_gpu.py --gpus 1,2 --json $OUT/scale.json
  PYTHONPATH=src python3 bench/scale_gpu.py --shape tiny --device cpu --gpus 1,2   # a smoke run on CPUs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # Llama-family shapes: hidden, layers, intermediate, heads, kv heads, vocab
    "8b": (4096, 32, 14336, 32, 8, 128256),
    "1b": (2048, 16, 8192, 32, 8, 128256),
    "tiny": (128, 8, 256, 4, 2, 4096),
}


def random_target_config(shape: str):
    """The LlamaConfig of `shape` and a word-level tokenizer (token i is "t{i}") with a chat template."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    H, L, I, nh, nkv, V = SHAPES[shape]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = LlamaConfig(hidden_size=H, num_hidden_layers=L, intermediate_size=I, num_attention_heads=nh,
                         num_key_value_heads=nkv, vocab_size=V, max_position_embeddings=8192, tie_word_embeddings=False)
    return config, tokenizer


def build_target(folder: Path, shape: str, device: str):
    """A random bf16 Llama of `shape` and a word-level tokenizer with a chat template."""
    from transformers import AutoModelForCausalLM

    config, tokenizer = random_target_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return config, tokenizer


def build_prepared(folder: Path, model_dir: Path, config, tokenizer, tokens: int, seed: int = 0) -> list[int]:
    from eyas.data.prepared import PreparedSample, write_prepared
    from eyas.models import model_identity

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    samples, total = [], 0
    while total < tokens:
        n = rng.randint(256, 2048)
        mask = torch.ones(n, dtype=torch.bool)
        mask[: n // 5] = False  # a "prompt" that is not trained
        samples.append(PreparedSample(torch.randint(2, config.vocab_size, (n,), generator=g), mask, len(samples)))
        total += n
    identity = model_identity(str(model_dir), config, tokenizer)
    write_prepared(folder, samples, [[] for _ in samples], {
        "target": identity.to_dict(), "source": "random", "max_len": 2048, "fingerprint": f"random-{seed}-{tokens}",
        "summary": {"kept": len(samples), "tokens": total},
    })
    return [len(s.input_ids) for s in samples]


def pure_forward(model_dir: Path, prepared: Path, device: str, batch_tokens: int) -> float:
    """tok/s of the decoder alone (up to its final norm) over the capture's own batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    rate = forward_rate(model, prepared, device, batch_tokens)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


def forward_rate(model, prepared: Path, device: str, batch_tokens: int, max_tokens: int | None = None) -> float:
    """tok/s of `model`'s decoder (up to its final norm) over the capture's own batches of
    `prepared` (the first batches holding `max_tokens`, if given), after two warm-up batches."""
    from eyas.capture.batching import token_budget_batches
    from eyas.data.prepared import PreparedData

    data = PreparedData(prepared)
    lengths = [data.length(i) for i in range(len(data))]
    batches = token_budget_batches(list(range(len(data))), lengths, batch_tokens)
    if max_tokens is not None:
        kept, total = [], 0
        for batch in batches:
            if total >= max_tokens:
                break
            kept.append(batch)
            total += sum(lengths[i] for i in batch)
        batches = kept

    def run(batch):
        T = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, : lengths[i]], mask[b, : lengths[i]] = data[i].input_ids, 1
        with torch.inference_mode():
            model.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    for batch in batches[:2]:
        run(batch)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        run(batch)
    _sync(device)
    return sum(lengths[i] for batch in batches for i in batch) / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def disk_write_rate(folder: Path, writers: int, gib: float = 2.0) -> float:
    """GB/s that `writers` threads reach writing and fsyncing `gib` GiB each into `folder`:
    the ceiling for capture's store writes on this machine."""
    import threading

    block = os.urandom(64 << 20)
    paths = [folder / f"disk-probe-{w}.bin" for w in range(writers)]

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(int(gib * 16)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    threads = [threading.Thread(target=write, args=(p,)) for p in paths]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for path in paths:
        path.unlink()
    return writers * gib * (1 << 30) / seconds / 1e9


def torchrun(g: int, args: list[str], log: Path) -> str:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(g), "--master-port",
           str(29500 + g), "-m", "eyas", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    return done.stdout


def capture_rate(stdout: str) -> tuple[float, float]:
    """(tok/s, seconds the capture waited on its store writers) from capture's last line."""
    m = re.search(r"captured ([\d,]+) tokens in ([\d.]+) s.*; ([\d.]+) s of it waiting", stdout)
    return int(m.group(1).replace(",", "")) / float(m.group(2)), float(m.group(3))


def train_rate(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    return statistics.median(rates[1:] if len(rates) > 2 else rates)  # the first window holds warm-up


def compare_stores(a: Path, b: Path, samples: int = 64) -> float:
    """Same samples and tokens; returns the largest per-row relative difference of hidden."""
    from eyas.store import Store

    sa, sb = Store(a), Store(b)
    ia, ib = sa.sample_indices().tolist(), sb.sample_indices().tolist()
    if sorted(ia) != sorted(ib):
        raise SystemExit(f"{b} holds other samples than {a}")
    where_b = {idx: pos for pos, idx in enumerate(ib)}
    worst = 0.0
    for pos in random.Random(0).sample(range(len(ia)), min(samples, len(ia))):
        x, y = sa.sample(pos), sb.sample(where_b[ia[pos]])
        if not (torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])):
            raise SystemExit(f"sample {ia[pos]} differs in tokens or mask")
        rel = (x["hidden"] - y["hidden"]).norm(dim=-1) / x["hidden"].norm(dim=-1).clamp_min(1e-6)
        worst = max(worst, rel.max().item())
    return worst


def main() -> None:
    from eyas.store import Store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="process counts to measure, e.g. 1,2,4")
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=600_000, help="prepared tokens (default 600k)")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--store-dtype", default="bf16", help="capture --dtype: fp8 halves the bytes a disk must take")
    p.add_argument("--train-steps", type=int, default=40, help="0 measures capture only")
    p.add_argument("--train-batch-tokens", type=int, default=8192)
    p.add_argument("--work", default="/tmp/eyas-scale")
    p.add_argument("--store-root", default=None, help="where the stores go (default --work), e.g. /dev/shm to take the disk out")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    work = Path(args.work)
    stores = Path(args.store_root or work)
    for folder in (work, stores):
        folder.mkdir(parents=True, exist_ok=True)
        for old in [d for d in (*folder.glob("store-*"), *folder.glob("train-*")) if d.is_dir()]:
            shutil.rmtree(old)  # an earlier run's stores would be resumed, and fill memory or disk
    machine = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu x{os.cpu_count()}"

    t0 = time.time()
    config, tokenizer = build_target(work / "model", args.shape, args.device)
    lengths = build_prepared(work / "prepared", work / "model", config, tokenizer, args.tokens)
    print(f"target {args.shape} (random bf16), {len(lengths)} samples, {sum(lengths):,} tokens; setup {time.time() - t0:.0f} s")
    forward = pure_forward(work / "model", work / "prepared", args.device, args.batch_tokens)
    print(f"pure forward (G=1): {forward:,.0f} tok/s")

    disk = {w: disk_write_rate(stores, w) for w in sorted({1, max(gpus)})}
    print("disk write (fsync'd): " + ", ".join(f"{w} writer(s) {r:.2f} GB/s" for w, r in disk.items()))

    capture, waited, train, drift = {}, {}, {}, {}
    for g in gpus:
        store = stores / f"store-{g}"
        out = torchrun(g, ["capture", "--model", str(work / "model"), "--data", str(work / "prepared"), "--out", str(store),
                           "--device", args.device, "--model-dtype", "bf16", "--batch-tokens", str(args.batch_tokens),
                           "--dtype", args.store_dtype],
                       work / f"capture-{g}.log")
        capture[g], waited[g] = capture_rate(out)
        drift[g] = compare_stores(stores / f"store-{gpus[0]}", store) if g != gpus[0] else 0.0
        store_gb_s = capture[g] * Store(store).bytes_per_token() / 1e9
        print(f"capture G={g}: {capture[g]:,.0f} tok/s ({store_gb_s:.2f} GB/s to the store, "
              f"{waited[g]:.1f} s waiting on the store writers); "
              f"max row difference vs G={gpus[0]}: {drift[g]:.2e}")
    for g in gpus if args.train_steps else []:
        run_dir = work / f"train-{g}"
        torchrun(g, ["train", "--store", str(stores / f"store-{gpus[0]}"), "--out", str(run_dir), "--steps",
                     str(args.train_steps), "--batch-tokens", str(args.train_batch_tokens), "--device", args.device,
                     "--log-every", "5", "--eval-every", "1000000", "--save-every", "1000000", "--no-progress"],
                 work / f"train-{g}.log")
        train[g] = train_rate(run_dir)
        print(f"train G={g}: {train[g]:,.0f} tok/s")

    base = gpus[0]
    result = {
        "machine": machine, "command": " ".join(sys.argv[1:]), "store_root": str(stores),
        "shape": args.shape, "tokens": sum(lengths), "pure_forward_tok_s": forward,
        "disk_write_gb_s": disk, "store_bytes_per_token": Store(stores / f"store-{gpus[0]}").bytes_per_token(),
        "store_dtype": args.store_dtype, "capture_tok_s": capture, "capture_wait_on_store_s": waited,
        "train_tok_s": train, "store_max_row_rel_diff": drift,
        "capture_over_forward": capture[base] / forward,
        "capture_efficiency": {g: capture[g] / (g / base * capture[base]) for g in gpus},
        "train_efficiency": {g: train[g] / (g / base * train[base]) for g in train},
    }
    print(f"\n{machine}, {args.shape} shape, medians where repeated")
    print(f"capture / pure forward at G={base}: {result['capture_over_forward']:.3f}")
    for g in gpus:
        print(f"G={g}: capture {capture[g]:>10,.0f} tok/s (efficiency {result['capture_efficiency'][g]:.3f})"
              + (f", train {train[g]:>9,.0f} tok/s (efficiency {result['train_efficiency'][g]:.3f})" if g in train else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
