"""MLA against GQA drafter quality on a small random DeepseekV3-style target, on the CPU (issue 25).

No packaged real model uses MLA, so the target is tests/tiny.py's random DeepseekV3 (8 layers,
hidden 64, 4 heads, MLA kv_lora_rank 16, q_lora_rank 24, qk_nope 16, qk_rope 8, v_head 16,
MoE), sharpened so that a drafter can learn it (`sharpen`: embeddings x16, lm_head x8). Its
answers to chitchat prompts are meaningless but deterministic (greedy): `eyas prepare` ->
`eyas regenerate` (the target's own answers) -> `eyas capture` -> `eyas train` twice on the
same store, `--draft-attention gqa` and `mla`, the same steps, seed and schedule, the whole
target vocabulary as draft vocabulary, the GQA drafter's MLP width chosen so that both have
the same number of trainable parameters (as close as one MLP unit allows). Reported:
held-out top-1 accuracy per TTT step and tau_sim (training's own held-out pass), parameters,
and the KV cache bytes per token each drafter costs a serving engine (bf16).

  PYTHONPATH=src python3 bench/mla_quality_cpu.py --work /tmp/mlaq --conversations 64 \
      --max-new-tokens 48 --steps 300 --mlp 128 --batch-tokens 2048 --out bench/results/mla_quality_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def trainable(draft) -> int:
    from eyas.draft.model import Eagle3Drafter

    with torch.device("meta"):
        model = Eagle3Drafter(draft)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def drafts(model: str, layer_ids: tuple[int, ...], mlp: int) -> tuple[dict, int]:
    """The two drafters' configs at equal parameters: MLA with MLP width `mlp`, GQA with the
    width that brings its count closest to MLA's."""
    from transformers import AutoConfig

    from eyas.draft.config import DraftConfig
    from eyas.models import load_tokenizer, model_identity

    config = AutoConfig.from_pretrained(model)
    identity = model_identity(model, config, load_tokenizer(model))

    def build(attention: str, width: int):
        return DraftConfig.for_target(config, identity, layer_ids, identity.vocab_size, attention=attention,
                                      intermediate_size=width)

    mla = build("mla", mlp)
    target = trainable(mla)
    per_unit = trainable(build("gqa", mlp + 1)) - trainable(build("gqa", mlp))  # 3H per MLP unit
    gqa_width = mlp + round((target - trainable(build("gqa", mlp))) / per_unit)
    return {"mla": mla, "gqa": build("gqa", gqa_width)}, gqa_width


def sharpen(model: Path, embed_scale: float, lm_head_scale: float) -> None:
    """Make the random target's behaviour learnable. Its layers add as much to the residual as
    its embeddings hold, so each of its next tokens is a chaotic function of the whole context,
    and its lm_head gives near-uniform distributions (soft labels with no signal). Scaling the
    embeddings up makes the current token dominate (the context still perturbs it); scaling
    lm_head lowers the temperature (sharp labels; the argmax, so the greedy text, is unchanged)."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"] *= embed_scale
    weights["lm_head.weight"] *= lm_head_scale
    save_file(weights, path, metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=96, help="the MLA drafter's MLP width (GQA's is set to equal parameters)")
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--embed-scale", type=float, default=16.0, help="the target's embeddings times this (see sharpen)")
    p.add_argument("--lm-head-scale", type=float, default=8.0, help="the target's lm_head times this (see sharpen)")
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--work", default=None, help="keep the target, data and drafters here (default: a temporary folder)")
    args = p.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    with TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        run(args, work)


def run(args, work: Path) -> None:
    from tiny import build_model

    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.draft.mla_config import kv_cache_bytes_per_token
    from eyas.paths import atomic_write_json
    from eyas.regenerate.config import RegenerateConfig
    from eyas.regenerate.run import regenerate
    from eyas.store.reader import Store
    from eyas.train import TrainConfig, train
    from common import git

    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work / "target", "deepseek_v3")
    sharpen(model, args.embed_scale, args.lm_head_scale)
    model = str(model)
    prepare(PrepareConfig(model=model, data=["packaged:chitchat"], out=str(work / "prepared"), max_len=256,
                          limit=args.conversations), progress=False)
    regenerate(RegenerateConfig(model=model, data=str(work / "prepared"), out=str(work / "regenerated"),
                                max_new_tokens=args.max_new_tokens), progress=False)
    capture(CaptureConfig(model=model, data=str(work / "regenerated"), out=str(work / "store"), dtype="fp32"),
            progress=False)
    layer_ids = Store(work / "store").layer_ids
    configs, gqa_width = drafts(model, layer_ids, args.mlp)
    record = {"command": "python3 " + " ".join(sys.argv), "commit": git("rev-parse", "HEAD"),
              "target": "tests/tiny.py deepseek_v3 (random weights, seed 0), sharpened", "layer_ids": list(layer_ids),
              "embed_scale": args.embed_scale, "lm_head_scale": args.lm_head_scale,
              "conversations": args.conversations, "steps": args.steps, "batch_tokens": args.batch_tokens,
              "ttt_steps": args.ttt_steps, "tau_sim": "1 + sum_k prod_{j<=k} acc_j (held out)", "drafters": {}}
    for attention, draft in configs.items():
        width = args.mlp if attention == "mla" else gqa_width
        cfg = TrainConfig(out=str(work / attention), store=str(work / "store"), steps=args.steps, lr=3e-3,
                          batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps,
                          intermediate_size=width, draft_attention=attention, eval_fraction=0.1, eval_every=100,
                          device="cpu", progress=False, seed=0)
        result = train(cfg)
        record["drafters"][attention] = {
            "heldout_acc_per_step": result["eval"]["acc_per_step"], "heldout_tau_sim": result["eval"]["tau_sim"],
            "heldout_positions": result["eval"]["positions"], "trainable_params": trainable(draft),
            "intermediate_size": width, "kv_cache_bytes_per_token_bf16": kv_cache_bytes_per_token(draft),
            "attention": {"heads": draft.num_attention_heads, "kv_heads": draft.num_key_value_heads,
                          "head_dim": draft.head_dim, "mla": draft.mla},
        }
    g, m = record["drafters"]["gqa"], record["drafters"]["mla"]
    record["mla_minus_gqa_acc_per_step"] = [round(a - b, 5) for a, b in zip(m["heldout_acc_per_step"],
                                                                         g["heldout_acc_per_step"])]
    record["mla_at_least_gqa_every_step"] = all(d >= 0 for d in record["mla_minus_gqa_acc_per_step"])
    record["elapsed_s"] = round(time.monotonic() - started, 1)
    atomic_write_json(Path(args.out), record)
    print(f"{'':28}{'gqa':>10}{'mla':>10}")
    for k, (a, b) in enumerate(zip(g["heldout_acc_per_step"], m["heldout_acc_per_step"])):
        print(f"{f'held-out acc, TTT step {k}':28}{a:>10.4f}{b:>10.4f}")
    for label, key in (("tau_sim", "heldout_tau_sim"), ("trainable params", "trainable_params"),
                       ("KV cache B/token (bf16)", "kv_cache_bytes_per_token_bf16")):
        print(f"{label:28}{g[key]:>10}{m[key]:>10}")
    print(f"written {args.out} in {record['elapsed_s']} s")


if __name__ == "__main__":
    main()
