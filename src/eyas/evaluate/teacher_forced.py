"""`eyas eval --teacher-forced PREPARED`: a drafter's accuracy per TTT step on a prepared set.

Teacher-forced: every position of every answer is drafted from the ground-truth prefix, the
target's states computed by the target itself (as online training does) or, given a
hidden-state store, read from it (as offline training does, so a target too large for
transformers, captured through vLLM, is scored without loading it), and step k's token
is scored against the target's greedy token, exactly as the trainer's held-out pass scores it
(the same function, `train.loop.score`), its loss the training run's `--loss` where the folder
records one. `--held-out` picks the samples the drafter's training run held out, with its
batch size and crop, so the figure equals the trainer's own; data whose split would hold out
other samples (another prepared set, a store missing some) is refused, since the run trained
on some of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from eyas import distributed
from eyas.device import resolve_device
from eyas.draft import load_config, load_drafter
from eyas.draft.objective import Objective
from eyas.errors import EyasError
from eyas.models import load_tokenizer, model_identity, resolve_model
from eyas.models.target_head import load_target_head
from eyas.options import BATCH_TOKENS, crop_length
from eyas.paths import atomic_write_json
from eyas.store.format import MANIFEST
from eyas.train.checkpoint import check_store_matches, latest_checkpoint, read_checkpoint
from eyas.train.data import OnlineSource, StoreSource, split
from eyas.train.loop import score
from eyas.train.metrics import TAU_DEFINITION, WALK_DEFINITION


def training_record(draft: str | Path) -> dict[str, Any] | None:
    """What `eyas train` recorded beside a drafter it trained (its OUT folder): the run's config
    and the data it trained on; None for a drafter folder without checkpoints (an export)."""
    folder = latest_checkpoint(Path(draft)) if (Path(draft) / "checkpoints").is_dir() else None
    return None if folder is None else read_checkpoint(folder)[1]


def _check_held_out(recorded: dict[str, Any] | None, source, positions: list[int], data: str | Path) -> None:
    """Refuse held-out positions that are not the samples the run held out: the split is drawn
    over the data's samples, so other data (more or fewer samples) draws another split, and the
    run trained on some of it. Runs from before eyas recorded their data are not checked."""
    if recorded is None:
        return
    if None not in (recorded.get("prepared"), source.fingerprint) and recorded["prepared"] != source.fingerprint:
        raise EyasError(f"--held-out: {data} comes from other prepared data than the training run's, which it "
                        f"did not hold out; score the data the run trained on.")
    held = sorted(source.sample_index[p] for p in positions)
    if hashlib.sha256(json.dumps(held).encode()).hexdigest() != recorded.get("held_out_sha256"):
        raise EyasError(f"--held-out: {data} holds {len(source.sample_index)} samples, the training run's data "
                        f"{recorded.get('samples')}; its split would hold out samples the run trained on. Score the "
                        f"data the run trained on (the prepared folder, or a store of all of it).")


def teacher_forced(model: str, draft: str | Path, data: str | Path, held_out: bool = False,
                   limit: int | None = None, batch_tokens: int = BATCH_TOKENS, max_len: int | None = None,
                   device: str | None = None) -> dict[str, Any]:
    """Loss, accuracy per TTT step and tau_sim of the drafter `draft` on `data`, a prepared
    folder or a store (all samples, the first `limit`, or with `held_out` the training run's
    held-out ones)."""
    seed = 0
    record = training_record(draft)
    trained = record["config"] if record else None
    if held_out:
        if trained is None:
            raise EyasError(f"{draft} holds no training checkpoint (checkpoints/latest): --held-out needs the training "
                            f"run's folder, which records its held-out split.")
        batch_tokens, max_len, seed = trained["batch_tokens"], trained["max_len"], trained["seed"]
    dev = resolve_device(device)
    config = load_config(draft)
    crop = crop_length(max_len, batch_tokens)
    if (Path(data) / MANIFEST).is_file():
        source = StoreSource(data, crop)
        check_store_matches(config, source.identity, source.layer_ids, source.hidden_size, f"The store {data}")
        _check_target(model, source.identity, f"The store {data}")  # the head below is the target's
    else:
        source = OnlineSource(model, data, ",".join(map(str, config.aux_layer_ids)), crop, dev)
    config.identity.check_same(source.identity, f"The drafter {draft}")
    positions = list(range(len(source.sample_index)))
    if held_out:
        positions = split(source.sample_index, trained["eval_fraction"], trained["seed"])[1]
        if not positions:
            raise EyasError(f"The training run of {draft} held out no sample (--eval-fraction 0).")
        _check_held_out(record.get("data"), source, positions, data)
    positions = positions[:limit] if limit else positions
    head = load_target_head(resolve_model(model)).to(dev)
    drafter = load_drafter(draft, head.embed_weight).to(dev).eval()
    draft_ids = torch.arange(len(drafter.d2t), device=dev) + drafter.d2t
    loss = Objective(trained.get("loss", "soft-ce"), trained.get("lk_eta", Objective.lk_eta)) if trained else Objective()
    result = score(source, head, drafter, draft_ids, config.ttt_steps, positions, batch_tokens, seed,
                   dev, distributed.Dist(), objective=loss)
    return {"data": str(data), "samples": len(positions), "held_out": held_out, "loss_kind": loss.loss, **result}


def _check_target(model: str, identity, what: str) -> None:
    folder = resolve_model(model)
    target = model_identity(model, AutoConfig.from_pretrained(folder), load_tokenizer(model), folder)
    target.check_same(identity, what)


def write(result: dict[str, Any], out: str | Path) -> None:
    atomic_write_json(Path(out), {"teacher_forced": result, "tau_sim_definition": TAU_DEFINITION,
                                  **({"tau_walk_definition": WALK_DEFINITION} if "tau_walk" in result else {})})


def format_result(result: dict[str, Any]) -> str:
    acc = "  ".join(f"{a:.3f}" for a in result["acc_per_step"])
    return (f"teacher-forced on {result['samples']} sample(s) of {result['data']}"
            f"{' (the training run held out)' if result['held_out'] else ''}: {result['positions']} positions\n"
            f"accuracy per TTT step: {acc}\ntau_sim {result['tau_sim']:.3f}, loss ({result.get('loss_kind', 'soft-ce')}) {result['loss']:.4f}\n"
            + (f"tau_walk {result['tau_walk']:.3f} over {result['chains']} chains; "
               f"{100 * result['greedy_path']:.1f}% of the answer tokens are the target's greedy tokens "
               f"({WALK_DEFINITION})\n" if "tau_walk" in result else "")
            + json.dumps({"acc_per_step": result["acc_per_step"]}))
