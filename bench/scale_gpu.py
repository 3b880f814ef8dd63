"""Scale-out benchmark: data-parallel capture and drafter training on G = 1, 2, 4, 8 GPUs of one host.

Phases (--phases, any subset; they run in this order, and each builds what it needs that an
earlier phase of the same call did not build):

  capture  a random bf16 Llama of --shape (8b: Llama-3.1-8B's) and random prepared samples;
           its pure forward on one GPU; the disk's fsync'd write rate (under --work) with 1
           and G writer threads; then `torchrun --nproc-per-node G -m eyas capture` for each
           G and each of --store-dtypes. Weak scaling: G processes capture G x --tokens
           tokens, the first --tokens of which are the 1-process run's samples, and every
           one of those is compared bit for bit with the 1-process store.
  train    `torchrun -m eyas train` of that target's drafter from the 1-process store, DDP, each G.
  seed     the same at the seed's drafter shape (--seed-shape kimi-k2: hidden 7168, target
           vocab 163840, draft vocab 32000) from a random fp8 store: DDP at each G, FSDP2
           (--fsdp) at each G > 1; tok/s per GPU, efficiency, peak memory per GPU.
  seqlen   FSDP2 at the seed's shape on the largest G: one sample of S tokens per process,
           S doubled from --seq-start until a run fails (or --seq-max), then bisected.
  online   `eyas train --online` on the largest G (the target's forward in the loop) against
           1 / (1/forward + 1/head): G x one GPU's pure forward at the trainer's batch size,
           and the train phase's rate on the same G.

Efficiency per GPU = throughput_G / (G x throughput_1). Peak memory per GPU is the largest of
the ranks' torch.cuda.max_memory_allocated (the trainer runs in its process under
`scale_gpu.py worker`, which records it), with max_memory_reserved beside it. The JSON
(--json) is rewritten after every measurement, so a call cut short keeps what it measured.

Runtimes at the defaults on 8 H200s, estimated from one-GPU figures (not measured): capture
~7-8 min for fp8 and bf16 (8 launches, each loading the 8B target); seed ~7 min (7 launches);
seqlen ~5 min (4-5 launches); train and online together ~5-6 min, the target and its 1-GPU
store rebuilt. One call may run 10 minutes: split by phase (bench/README.md has the commands).

  PYTHONPATH=src python3 bench/scale_gpu.py --gpus 1,2,4,8 --phases seed --store-root /dev/shm/eyas-scale --json $OUT/seed.json
  PYTHONPATH=src python3 bench/scale_gpu.py --shape tiny --seed-shape tiny --device cpu --gpus 1,2,4 --tokens 2000 \
      --train-steps 4 --train-batch-tokens 1024 --disk-gib 0.05 --json /tmp/scale.json     # a smoke run on CPUs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common import capture_rate, disk_write_rate, forward_rate, git
from random_target import SEED_SHAPES, SHAPES, build_prepared, build_target, random_samples, word_tokenizer

PHASES = ("capture", "train", "seed", "seqlen", "online")
# The seed's drafter: random_target.SEED_SHAPES' sizes ("8b" there: Kimi-K2's), and how to run it.
SEED_RUNS = {
    "kimi-k2": dict(shape="8b", tokens=400_000, lengths=(256, 2048), seq_start=32768, seq_max=262144),
    "tiny": dict(shape="tiny", tokens=6000, lengths=(64, 512), seq_start=512, seq_max=1024),
}


def pure_forward(model_dir: Path, prepared: Path, device: str, batch_tokens: int) -> float:
    """tok/s of the decoder alone (up to its final norm) over the capture's own batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    rate = forward_rate(model, prepared, device, batch_tokens)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


# ---------------------------------------------------------------- processes


def launch(g: int, args: list[str], log: Path, device: str, peaks: Path | None = None,
           timeout: float | None = None) -> int | None:
    """`eyas ARGS` in G processes under torchrun, output to `log`; through `worker` when `peaks`
    is a folder (each rank records its peak memory there). Returns the exit code, or None if
    it ran past `timeout` (then the whole process group, torchrun and its ranks, is killed)."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if device == "cpu" else "4")}
    entry = ["-m", "eyas"] if peaks is None else [str(Path(__file__).resolve()), "worker", str(peaks)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(g), *entry, *args]
    if peaks is not None:
        shutil.rmtree(peaks, ignore_errors=True)
        peaks.mkdir(parents=True)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # what this process built on GPU 0 (its context stays, ~0.5 GiB)
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def torchrun(g: int, args: list[str], log: Path, device: str, peaks: Path | None = None) -> str:
    """`launch`, which must succeed; returns its output."""
    code = launch(g, args, log, device, peaks)
    if code:
        raise SystemExit(f"failed ({code}), see {log}:\n{log.read_text()[-4000:]}")
    return log.read_text()


def worker(argv: list[str]) -> None:
    """Under torchrun: `eyas ARGV[1:]` in this process, then this rank's peak memory into the
    folder ARGV[0] (also after a failure, an out-of-memory one included)."""
    from eyas.cli import main as eyas_main

    try:
        eyas_main(argv[1:])
    finally:
        Path(argv[0], f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peak_memory()))


def peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"kind": "cuda max_memory_allocated (reserved beside it)",
                "allocated_gib": torch.cuda.max_memory_allocated() / (1 << 30),
                "reserved_gib": torch.cuda.max_memory_reserved() / (1 << 30)}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
    return {"kind": "host max RSS (CPU run)", "allocated_gib": rss, "reserved_gib": rss}


def read_peaks(folder: Path) -> dict[str, Any]:
    """The largest peak over the ranks that recorded one."""
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    if not rows:
        return {"peak_gib": None, "reserved_gib": None, "ranks": 0}
    return {"peak_gib": round(max(r["allocated_gib"] for r in rows), 2),
            "reserved_gib": round(max(r["reserved_gib"] for r in rows), 2), "ranks": len(rows), "kind": rows[0]["kind"]}


def train_rows(out: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def train_rate(out: Path) -> float:
    rates = [r["tokens_per_s"] for r in train_rows(out) if r.get("tokens_per_s")]
    return statistics.median(rates[1:] if len(rates) > 2 else rates)  # the first window holds warm-up


def compare_stores(reference: Path, other: Path) -> dict[str, Any]:
    """Every sample of `reference` against the same sample in `other`: the same tokens and mask
    (or SystemExit), and whether its stored bytes (states, and fp8 scales) are identical; where
    they are not, the largest per-row relative difference of the states."""
    from eyas.store import Store
    from eyas.store.format import dequantize

    a, b = Store(reference), Store(other)
    where = {int(i): pos for pos, i in enumerate(b.sample_indices().tolist())}
    same, worst = 0, 0.0
    for pos, index in enumerate(a.sample_indices().tolist()):
        if index not in where:
            raise SystemExit(f"{other} lacks sample {index} of {reference}")
        x, y = a.stored(pos), b.stored(where[index])
        if not (torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])):
            raise SystemExit(f"sample {index} differs in tokens or mask")
        if _same_bytes(x["hidden"], y["hidden"]) and (x["scale"] is None or _same_bytes(x["scale"], y["scale"])):
            same += 1
            continue
        hx, hy = dequantize(x["hidden"], x["scale"]), dequantize(y["hidden"], y["scale"])
        rel = (hx - hy).norm(dim=-1) / hx.norm(dim=-1).clamp_min(1e-6)
        worst = max(worst, rel.max().item())
    return {"samples": len(a), "bit_identical": same, "all_bit_identical": same == len(a), "max_row_rel_diff": worst}


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- the seed's shape


def seed_config(name: str):
    """The seed's target as its drafter sees it: a DeepseekV3 config of random_target.SEED_SHAPES'
    sizes whose layers are all dense. The drafter takes only the target's widths, heads and
    vocabulary, and no layer is ever built (training reads three tensors from the folder)."""
    from transformers import DeepseekV3Config

    shape = SEED_SHAPES[SEED_RUNS[name]["shape"]]
    return DeepseekV3Config(**shape, first_k_dense_replace=shape["num_hidden_layers"],
                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def seed_draft_vocab(config) -> int:
    return min(32000, config.vocab_size // 2)


def build_seed_target(folder: Path, name: str, device: str) -> None:
    """Config, tokenizer and the three tensors training reads (embeddings, final norm, lm_head),
    random bf16. The data's ids are 2 .. 2 + draft vocab and lm_head's other rows are halved,
    so the target's argmax falls in the draft vocabulary at nearly every position, as with a
    well-covering vocabulary on real data: every position then reaches lm_head and the loss
    (with uniform ids and rows, only ~20% would, and the step would be cheaper than a real one)."""
    from safetensors.torch import save_file

    config = seed_config(name)
    V, H, Vd = config.vocab_size, config.hidden_size, seed_draft_vocab(config)
    g = torch.Generator(device).manual_seed(0)
    embed = torch.randn(V, H, device=device, generator=g).mul_(0.02).bfloat16()
    lm_head = torch.randn(V, H, device=device, generator=g).mul_(0.02)
    lm_head[:2].mul_(0.5)
    lm_head[2 + Vd :].mul_(0.5)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": embed.cpu(), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
               "lm_head.weight": lm_head.bfloat16().cpu()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    word_tokenizer(V).save_pretrained(folder)


def build_seed_store(out: Path, folder: Path, samples: list, device: str) -> None:
    """An fp8 store of `samples` for the target in `folder` at layer ids (2, N//2, N-3, N):
    every sample's states are rows of one random block (speed does not depend on values)."""
    from transformers import AutoConfig

    from eyas.models import load_tokenizer, model_identity
    from eyas.store import StoreWriter
    from eyas.store.format import manifest_header, quantize_fp8

    config = AutoConfig.from_pretrained(folder)
    N, H = config.num_hidden_layers, config.hidden_size
    layer_ids = [2, N // 2, N - 3, N]
    identity = model_identity(str(folder), config, load_tokenizer(str(folder)))
    g = torch.Generator(device).manual_seed(1)
    hidden, scale = quantize_fp8(torch.randn(2048, len(layer_ids), H, device=device, generator=g))  # [R, L, H], [R, L]
    writer = StoreWriter(out, manifest_header(identity, layer_ids, "fp8", H, f"random-seed-{len(samples)}", None))
    for s in samples:
        rows = torch.arange(len(s.input_ids), device=device) % len(hidden)
        writer.add(s.source_index, s.input_ids, s.loss_mask, hidden[rows], scale=scale[rows])
    writer.close(expected_samples=len(samples))


# ---------------------------------------------------------------- the run


class Bench:
    """One call: what was built (memoised, so phases share it) and the result JSON."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.gpus = [int(g) for g in args.gpus.split(",")]
        self.base, self.top = self.gpus[0], max(self.gpus)
        self.work = Path(args.work)
        self.stores = Path(args.store_root or args.work)
        self.dtypes = args.store_dtypes.split(",")
        self.seed = SEED_RUNS[args.seed_shape]
        self._memo: dict[Any, Any] = {}
        machine = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu x{os.cpu_count()}"
        self.result: dict[str, Any] = {
            f"capture_efficiency_{self.top}": None, f"train_efficiency_{self.top}": None,
            f"train_peak_gib_{self.top}": None, f"max_seq_len_fsdp2_{self.top}": None,
            f"online_over_predicted_{self.top}": None,
            "command": "python3 " + " ".join([sys.argv[0], *sys.argv[1:]]),
            "commit": git("rev-parse", "HEAD") or args.commit, "dirty": bool(git("status", "--porcelain")),
            "machine": machine, "torch": torch.__version__, "gpus": self.gpus, "store_root": str(self.stores),
            "efficiency": "throughput_G / (G x throughput_1)", "phases": {},
        }

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def save(self) -> None:
        if self.args.json:
            path = Path(self.args.json)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.result, indent=2, default=str))
            os.replace(tmp, path)

    def phase(self, name: str) -> dict[str, Any]:
        return self.result["phases"].setdefault(name, {})

    def say(self, message: str) -> None:
        print(message, flush=True)

    # ------------------------------------------------ what phases share

    def target(self):
        """The --shape target's folder and config (built once)."""
        def build():
            t0 = time.time()
            config, tokenizer = build_target(self.work / "model", self.args.shape, self.args.device)
            self.say(f"target {self.args.shape} (random bf16) built in {time.time() - t0:.0f} s")
            return config, tokenizer
        return self.memo("target", build)

    def prepared(self, g: int) -> Path:
        """Random samples of g x --tokens tokens (those of a smaller g are a prefix)."""
        def build():
            config, tokenizer = self.target()
            folder = self.work / f"prepared-{g}"
            lengths = build_prepared(folder, self.work / "model", config, tokenizer, g * self.args.tokens)
            self.say(f"prepared for {g} process(es): {len(lengths)} samples, {sum(lengths):,} tokens")
            return folder
        return self.memo(("prepared", g), build)

    def forward(self, batch_tokens: int) -> float:
        """One GPU's pure forward over prepared(1) in batches of `batch_tokens`."""
        def measure():
            rate = pure_forward(self.work / "model", self.prepared(1), self.args.device, batch_tokens)
            self.say(f"pure forward (1 GPU, {batch_tokens} tokens a batch): {rate:,.0f} tok/s")
            self.result.setdefault("pure_forward_tok_s", {})[batch_tokens] = rate
            return rate
        return self.memo(("forward", batch_tokens), measure)

    def capture(self, g: int, dtype: str) -> tuple[float, float, Path]:
        """(tok/s, seconds waiting on the store, store) of G processes capturing prepared(g)."""
        def run():
            store = self.stores / f"store-{dtype}-{g}"
            out = torchrun(g, ["capture", "--model", str(self.work / "model"), "--data", str(self.prepared(g)),
                               "--out", str(store), "--device", self.args.device, "--model-dtype", "bf16",
                               "--batch-tokens", str(self.args.batch_tokens), "--dtype", dtype],
                           self.work / f"capture-{dtype}-{g}.log", self.args.device)
            rate, waited = capture_rate(out)
            self.say(f"captured {dtype} with {g} process(es) into {store}: {rate:,.0f} tok/s")
            return rate, waited, store
        return self.memo(("capture", g, dtype), run)

    def train_run(self, name: str, g: int, args: list[str]) -> dict[str, Any]:
        """`eyas train ARGS` in G processes: tok/s (median of the logged windows after the first),
        per GPU, peak memory per GPU, the draft vocabulary's coverage of the target's argmax."""
        steps = self.args.train_steps
        out = self.stores / name
        shutil.rmtree(out, ignore_errors=True)
        torchrun(g, ["train", *args, "--out", str(out), "--steps", str(steps), "--device", self.args.device,
                     "--eval-fraction", "0", "--log-every", str(max(1, steps // 6)), "--eval-every", "1000000",
                     "--save-every", "1000000", "--no-progress"],
                 self.work / f"{name}.log", self.args.device, peaks=self.work / f"{name}-peaks")
        rate = train_rate(out)
        row = {"tok_s": rate, "tok_s_per_gpu": rate / g, **read_peaks(self.work / f"{name}-peaks"),
               "vocab_coverage": train_rows(out)[-1]["vocab_coverage"]}
        shutil.rmtree(out)  # the checkpoint: large at the seed's shape
        return row

    def target_train(self, g: int) -> dict[str, Any]:
        """The --shape target's drafter trained from the 1-process store (the first store dtype)."""
        store = self.capture(self.base, self.dtypes[0])[2]
        return self.memo(("train", g), lambda: self.train_run(
            f"train-{g}", g, ["--store", str(store), "--batch-tokens", str(self.args.train_batch_tokens)]))

    def seed_target(self) -> Path:
        def build():
            folder = self.work / f"seed-{self.args.seed_shape}"
            build_seed_target(folder, self.args.seed_shape, self.args.device)
            return folder
        return self.memo("seed_target", build)

    def seed_vocab(self) -> int:
        return self.memo("seed_vocab", lambda: seed_draft_vocab(seed_config(self.args.seed_shape)))

    def seed_store(self) -> Path:
        def build():
            store = self.stores / f"seed-store-{self.args.seed_shape}"
            shutil.rmtree(store, ignore_errors=True)
            t0 = time.time()
            samples = random_samples(self.args.seed_tokens or self.seed["tokens"], 2, 2 + self.seed_vocab(),
                                     self.seed["lengths"])
            build_seed_store(store, self.seed_target(), samples, self.args.device)
            self.say(f"seed store: {len(samples)} samples in {time.time() - t0:.0f} s")
            return store
        return self.memo("seed_store", build)

    def covering_sample(self, S: int):
        """One S-token sample whose ids run through the whole draft range (each at least once if S
        is longer), so that the draft vocabulary built from it is that range (see build_seed_target)."""
        from eyas.data.prepared import PreparedSample

        mask = torch.ones(S, dtype=torch.bool)
        mask[: S // 5] = False
        return PreparedSample(2 + torch.randperm(S, generator=torch.Generator().manual_seed(S)) % self.seed_vocab(), mask, 0)

    def seed_args(self, store: Path, batch_tokens: int, fsdp: bool) -> list[str]:
        return ["--store", str(store), "--batch-tokens", str(batch_tokens), "--draft-vocab", str(self.seed_vocab()),
                *(["--fsdp"] if fsdp else [])]

    def efficiency(self, rates: dict[int, float], base: float) -> dict[int, float]:
        return {g: r / (g / self.base * base) for g, r in rates.items()}

    # ------------------------------------------------ phases

    def phase_capture(self) -> None:
        from eyas.store import Store

        out = self.phase("capture")
        out.update(shape=self.args.shape, tokens_per_process=self.args.tokens, scaling="weak: G x --tokens over G processes")
        forward = self.forward(self.args.batch_tokens)
        writers = sorted({1, self.top})
        out["disk_write_gb_s"] = {w: disk_write_rate(self.work, w, self.args.disk_gib) for w in writers}
        out["disk_measured_in"] = str(self.work)
        self.say("disk write (fsync'd): " + ", ".join(f"{w} writer(s) {r:.2f} GB/s" for w, r in out["disk_write_gb_s"].items()))
        self.save()
        for dtype in self.dtypes:
            row = out.setdefault(dtype, {"tok_s": {}, "efficiency": {}, "store_gb_s": {}, "wait_s": {}, "vs_first": {}})
            for g in self.gpus:
                rate, waited, store = self.capture(g, dtype)
                reference = self.capture(self.base, dtype)[2]
                row["bytes_per_token"] = Store(store).bytes_per_token()
                row["tok_s"][g], row["wait_s"][g] = rate, waited
                row["store_gb_s"][g] = rate * row["bytes_per_token"] / 1e9
                row["vs_first"][g] = compare_stores(reference, store) if g != self.base else None
                row["efficiency"] = self.efficiency(row["tok_s"], row["tok_s"][self.base])
                if g != self.base:
                    shutil.rmtree(store)  # G x --tokens of states: keep only the reference
                same = row["vs_first"][g]
                self.say(f"capture {dtype} G={g}: {rate:,.0f} tok/s (efficiency {row['efficiency'][g]:.3f}; "
                         f"{row['store_gb_s'][g]:.2f} GB/s to the store, {waited:.1f} s waiting on its writers)"
                         + (f"; {same['bit_identical']}/{same['samples']} samples bit-identical to G={self.base}"
                            f" (max row difference {same['max_row_rel_diff']:.2e})" if same else ""))
                self.save()
            row["over_pure_forward"] = row["tok_s"][self.base] / forward
        first = out[self.dtypes[0]]["efficiency"]
        self.result[f"capture_efficiency_{self.top}"] = first.get(self.top)
        self.result["capture_efficiency_dtype"] = self.dtypes[0]

    def phase_train(self) -> None:
        out = self.phase("train")
        out["shape"] = self.args.shape
        for g in self.gpus:
            out[g] = self.target_train(g)
            self.say(f"train {self.args.shape} G={g}: {out[g]['tok_s']:,.0f} tok/s, peak {out[g]['peak_gib']} GiB")
            self.save()
        rates = {g: out[g]["tok_s"] for g in self.gpus}
        out["efficiency"] = self.efficiency(rates, rates[self.base])

    def phase_seed(self) -> None:
        out = self.phase("seed")
        out.update(shape=SEED_SHAPES[self.seed["shape"]], draft_vocab=self.seed_vocab(),
                   layers_in_folder="all dense (the drafter reads widths, heads and vocabulary only)")
        store = self.seed_store()
        for mode in ("ddp", "fsdp2"):
            runs = out.setdefault(mode, {})
            for g in [g for g in self.gpus if mode == "ddp" or g > 1]:
                runs[g] = self.train_run(f"seed-{mode}-{g}", g, self.seed_args(store, self.args.train_batch_tokens,
                                                                                 mode == "fsdp2"))
                self.say(f"seed {mode} G={g}: {runs[g]['tok_s']:,.0f} tok/s ({runs[g]['tok_s_per_gpu']:,.0f} per GPU), "
                         f"peak {runs[g]['peak_gib']} GiB per GPU, vocab coverage {runs[g]['vocab_coverage']}")
                self.save()
        one = out["ddp"][self.base]["tok_s"]
        for mode in ("ddp", "fsdp2"):
            out[f"{mode}_efficiency"] = self.efficiency({g: r["tok_s"] for g, r in out[mode].items()}, one)
        best = max((m for m in ("ddp", "fsdp2") if self.top in out[m]), key=lambda m: out[m][self.top]["tok_s"])
        self.result[f"train_efficiency_{self.top}"] = out[f"{best}_efficiency"][self.top]
        self.result[f"train_peak_gib_{self.top}"] = out[best][self.top]["peak_gib"]
        self.result["train_best_mode"] = best

    def seq_probe(self, S: int) -> dict[str, Any]:
        """Does FSDP2 on the largest G train one S-token sample per process? Two steps over a
        store of one sample (each process reads it: every epoch is that one batch)."""
        store = self.stores / f"seq-store-{S}"
        shutil.rmtree(store, ignore_errors=True)
        build_seed_store(store, self.seed_target(), [self.covering_sample(S)], self.args.device)
        name, out = f"seq-{S}", self.stores / f"seq-{S}"
        shutil.rmtree(out, ignore_errors=True)
        log, peaks = self.work / f"{name}.log", self.work / f"{name}-peaks"
        code = launch(self.top, ["train", *self.seed_args(store, S, True), "--max-len", str(S), "--out", str(out),
                                 "--steps", "2", "--device", self.args.device, "--eval-fraction", "0", "--log-every", "1",
                                 "--no-progress"], log, self.args.device, peaks, timeout=self.args.probe_timeout)
        text = log.read_text()
        oom = "out of memory" in text.lower()
        if code and not oom:
            raise SystemExit(f"seq {S} failed, not for memory ({code}); see {log}:\n{text[-4000:]}")
        row = {"seq_len": S, "fits": code == 0, **read_peaks(peaks),
               "why_not": None if code == 0 else ("out of memory" if oom else f"no end within {self.args.probe_timeout} s")}
        if code == 0:
            row["tok_s_step_2"] = train_rows(out)[-1]["tokens_per_s"]
        for path in (store, out):
            shutil.rmtree(path, ignore_errors=True)
        self.say(f"seq {S} on {self.top} GPUs (FSDP2): " + ("fits" if row["fits"] else f"does not fit ({row['why_not']})")
                 + f", peak {row['peak_gib']} GiB")
        return row

    def phase_seqlen(self) -> None:
        out = self.phase("seqlen")
        out.update(gpus=self.top, probes=[], rule="one S-token sample per process and step, 2 steps, FSDP2")

        def fits(S: int) -> bool:
            out["probes"].append(self.seq_probe(S))
            self.save()
            return out["probes"][-1]["fits"]

        start, cap = self.args.seq_start or self.seed["seq_start"], self.args.seq_max or self.seed["seq_max"]
        step = max(1, start // 16)
        longest, shortest_failing = (start, None) if fits(start) else (None, start)
        while longest and not shortest_failing and 2 * longest <= cap:  # double while it fits
            longest, shortest_failing = (2 * longest, None) if fits(2 * longest) else (longest, 2 * longest)
        while not longest and shortest_failing // 2 >= step:  # halve until it fits
            half = shortest_failing // 2
            longest, shortest_failing = (half, shortest_failing) if fits(half) else (None, half)
        for _ in range(self.args.seq_bisect if longest and shortest_failing else 0):
            mid = (longest + shortest_failing) // 2 // step * step
            if mid in (longest, shortest_failing):
                break
            longest, shortest_failing = (mid, shortest_failing) if fits(mid) else (longest, mid)
        out.update(max_seq_len=longest, first_failing=shortest_failing, capped_at=None if shortest_failing else cap)
        self.result[f"max_seq_len_fsdp2_{self.top}"] = longest

    def phase_online(self) -> None:
        out = self.phase("online")
        G, batch = self.top, self.args.train_batch_tokens
        head = self.target_train(G)["tok_s"]
        forward = G * self.forward(batch)
        run = self.train_run(f"online-{G}", G, ["--online", "--model", str(self.work / "model"),
                                                "--data", str(self.prepared(1)), "--batch-tokens", str(batch)])
        predicted = 1 / (1 / forward + 1 / head)
        out.update(gpus=G, **run, forward_alone_tok_s=forward, head_alone_tok_s=head, predicted_tok_s=predicted,
                   over_predicted=run["tok_s"] / predicted,
                   prediction="1 / (1/forward + 1/head): G x one GPU's pure forward at the trainer's batch size, "
                              "and offline training from the store on the same G; the two run one after the other")
        self.result[f"online_over_predicted_{G}"] = out["over_predicted"]
        self.say(f"online G={G}: {run['tok_s']:,.0f} tok/s against {predicted:,.0f} predicted "
                 f"(forward alone {forward:,.0f}, head alone {head:,.0f}): {out['over_predicted']:.3f}")


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="process counts to measure, e.g. 1,2,4,8 (the first is the baseline)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of: " + ",".join(PHASES))
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="the target of capture, train and online")
    p.add_argument("--seed-shape", default=None, choices=sorted(SEED_RUNS),
                   help="the seed phases' drafter (default kimi-k2; tiny with --shape tiny): tiny is a CPU stand-in")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=300_000, help="tokens each capture process captures (default 300k)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="capture's --batch-tokens")
    p.add_argument("--store-dtypes", default="fp8,bf16", help="capture --dtype, each measured (default fp8,bf16)")
    p.add_argument("--train-steps", type=int, default=30, help="steps of each training run (default 30)")
    p.add_argument("--train-batch-tokens", type=int, default=8192, help="tokens per process and step")
    p.add_argument("--seed-tokens", type=int, default=None, help="the seed store's tokens (default 400k; 6000 tiny)")
    p.add_argument("--seq-start", type=int, default=None, help="first sequence length probed (default 32768; 512 tiny)")
    p.add_argument("--seq-max", type=int, default=None, help="longest probed (default 262144; 1024 tiny)")
    p.add_argument("--seq-bisect", type=int, default=2, help="bisections after the first failure (default 2)")
    p.add_argument("--probe-timeout", type=float, default=300, help="seconds a sequence-length probe may run")
    p.add_argument("--disk-gib", type=float, default=2.0, help="GiB each writer thread of the disk probe writes")
    p.add_argument("--work", default="/tmp/eyas-scale")
    p.add_argument("--store-root", default=None, help="where stores and runs go (default --work), e.g. /dev/shm to take the disk out")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--commit", default=None, help="recorded if git is not available where this runs")
    args = p.parse_args()
    args.seed_shape = args.seed_shape or ("tiny" if args.shape == "tiny" else "kimi-k2")
    phases = args.phases.split(",")
    if unknown := sorted(set(phases) - set(PHASES)):
        p.error(f"unknown phase(s) {unknown}; choose from {', '.join(PHASES)}")
    for folder in {Path(args.work), Path(args.store_root or args.work)}:
        shutil.rmtree(folder, ignore_errors=True)  # an earlier run's stores would be resumed, and fill memory or disk
        folder.mkdir(parents=True)
    bench = Bench(args)
    for name in PHASES:
        if name in phases:
            t0 = time.time()
            getattr(bench, f"phase_{name}")()
            bench.phase(name)["seconds"] = round(time.time() - t0, 1)
            bench.say(f"[{name}: {time.time() - t0:.0f} s]")
            bench.save()
    heads = {k: v for k, v in bench.result.items() if k.endswith(f"_{bench.top}")}
    bench.say(f"\n{bench.result['machine']}, G = {args.gpus}; headline: " + json.dumps(heads, default=str))


if __name__ == "__main__":
    main()
