"""On-policy distillation (`eyas train --position-weights on-policy`, the recipe's `onpolicy`
stage): training scores exactly the steps that greedy decoding with the drafter reaches, as a
draft -> verify loop run by hand on the real SmolLM2 finds them (and for DFlash, whose decoding
keeps a context cache across steps, the held-out walk over a block at every row drafts the
loop's own blocks); `--init` starts from a trained drafter; a run killed mid-write resumes to
the weights of one never killed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from eyas.draft.loss import CHAINS_ACCEPTING, CHAINS_REACHING, COUNT, step_counts
from eyas.draft.objective import Objective
from eyas.draft.reach import accepted_lengths, chain_reach, reached_pairs
from eyas.evaluate.proposers import Proposer
from eyas.train.metrics import summarize
from test_adversarial import cli, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401

SMOLLM2 = "packaged:smollm2-135m"
K = 3  # TTT steps, and the chain the hand-run loop drafts
MAX_NEW = 64
QUESTIONS = ("What is the capital of France? Answer in one short sentence.",
             "And of Italy? Answer in one short sentence.")


def test_the_walk_drafts_each_turn_from_its_first_token_and_jumps_past_each_verified_chain():
    """Labels 2..7 and 9..11 are two turns' (label j trained: token j+1 is an assistant token).
    Turn one: a chain from row 2 accepts 1 (reaches steps 0, 1), the next is drafted from row
    2 + 1 + 1 = 4 and accepts all 3 (reaches 0..2), then row 8 lies past the turn. Turn two:
    row 9 accepts none, row 10 accepts 2. Rows no chain is drafted from reach nothing, whatever
    their drafts would have done."""
    trained = torch.zeros(1, 12, dtype=torch.bool)
    trained[0, 2:8] = trained[0, 9:12] = True
    accepted = torch.full((1, 12), 3)
    accepted[0, 2], accepted[0, 4], accepted[0, 9], accepted[0, 10] = 1, 3, 0, 2
    reach = chain_reach(accepted, trained, K)
    assert reach[0].tolist() == [0, 0, 2, 0, 3, 0, 0, 0, 0, 1, 3, 0]
    assert reached_pairs(reach, K)[:, 0, 4].tolist() == [True, True, True]
    assert reached_pairs(reach, K)[:, 0, 2].tolist() == [True, True, False]
    # accepted_lengths counts the leading steps that pass, not every passing step.
    passes = torch.tensor([[True], [False], [True]])[:, :, None].expand(K, 1, 1)
    assert accepted_lengths(passes).tolist() == [[1]]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from eyas.models import load_target, model_identity

    model, tokenizer = load_target(SMOLLM2, dtype="float32")
    return model, tokenizer, model_identity(SMOLLM2, model.config, tokenizer)


@pytest.fixture(scope="module")
def answers(smollm2, tmp_path_factory) -> Path:
    """A folder whose `store` holds SmolLM2's own greedy answers to the two questions, captured."""
    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.prompts import render
    from eyas.models.eos import eos_ids

    model, tokenizer, _ = smollm2
    eos = sorted(eos_ids(model.generation_config, tokenizer))
    messages = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids = render(tokenizer, messages)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        messages.append({"role": "assistant", "content": tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True)})
    root = tmp_path_factory.mktemp("on-policy")
    (root / "answers.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    prepare(PrepareConfig(model=SMOLLM2, data=[str(root / "answers.jsonl")], out=str(root / "prepared"), max_len=512),
            progress=False)
    capture(CaptureConfig(model=SMOLLM2, data=str(root / "prepared"), out=str(root / "store"), dtype="fp32"),
            progress=False)
    return root


def train_on_answers(answers: Path, name: str, **options) -> Path:
    """A drafter trained briefly on the answers, so that its chains are accepted whole, in part
    and not at all."""
    from eyas.train import TrainConfig, train

    train(TrainConfig(out=str(answers / name), store=str(answers / "store"), warmup=0, ttt_steps=K, batch_tokens=512,
                      draft_vocab=2048, eval_fraction=0, device="cpu", progress=False, **options))
    return answers / name


@pytest.fixture(scope="module")
def drafter(answers):
    return train_on_answers(answers, "drafter", steps=25, lr=3e-3)


@pytest.fixture(scope="module")
def dflash_drafter(answers):
    """A DFlash drafter with blocks of K + 1, every row with a trained label anchoring one at
    every step (--anchors as long as the sample may be), and its own head trained: in 35 steps
    the frozen default head does not fit these answers enough for the loop to accept whole
    blocks, which the walk's check needs beside partial and empty ones."""
    return train_on_answers(answers, "dflash", drafter="dflash", block_size=K + 1, anchors=512, steps=35, lr=3e-3,
                            lm_head="own")


def hand_run(smollm2, drafter_dir: Path, proposer: Callable[[torch.nn.Module], Proposer], static: bool = False
             ) -> tuple[list[int], list[bool], list[tuple[int, int]]]:
    """Two turns decoded by eyas's draft -> verify loop (greedy, chains of K) with the drafter's
    proposer, `proposer(drafter)` as eval builds it, on the eager target (`static`: eval's
    static path, preallocated caches grown from 16 slots): the sample they make (prompt,
    answer, next user turn, answer), its assistant mask, and each verification step's (row the
    chain was drafted from, drafts accepted)."""
    from eyas.evaluate.generate import generate
    from eyas.prompts import render
    from eyas.evaluate.run import load_checked_drafter
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.evaluate.target import TargetSession
    from eyas.models.eos import eos_ids

    model, tokenizer, identity = smollm2
    drafter = load_checked_drafter(str(drafter_dir), model, identity)
    aux = drafter.config.aux_layer_ids
    target = StaticTargetSession(model, aux, capacity=16) if static else TargetSession(model, aux)
    propose = proposer(drafter)
    eos = set(eos_ids(model.generation_config, tokenizer))
    ids: list[int] = []
    mask: list[bool] = []
    chains: list[tuple[int, int]] = []
    for turn, question in enumerate(QUESTIONS):
        first = render(tokenizer, [{"role": "user", "content": question}])
        # The next user turn, as the chat template renders it after a finished answer.
        prompt = ids + (first if turn == 0 else tokenizer.encode("\n", add_special_tokens=False) + first)
        g = generate(target, propose, prompt, MAX_NEW, eos)
        assert g.generated_ids[-1] in eos, "each answer ends before the length limit"
        row = len(prompt) - 1  # the prefill's token is read by the row before it
        for accepted in g.accept_counts:
            chains.append((row, accepted))
            row += accepted + 1
        mask += [False] * (len(prompt) - len(ids)) + [True] * len(g.generated_ids)
        ids = prompt + g.generated_ids
    target.close()  # the module's model serves the next loop without this one's hooks
    return ids, mask, chains


def accepted_mix(chains: list[tuple[int, int]]) -> list[int]:
    """The loop's accepted counts, checked to hold chains accepted whole, in part and not at all."""
    accepted = [a for _, a in chains]
    assert {0, K} <= set(accepted) and any(0 < a < K for a in accepted), accepted
    return accepted


def on_sample(ids: list[int], mask: list[bool], drafter_dir: Path):
    """The hand-run sample as training sees it: input_ids [1, T], the target's states [1, T, 4, H]
    (the drafter's aux layers, then id N), the drafter, the loss mask and the labels."""
    from eyas.draft.checkpoint import load_drafter
    from eyas.models import resolve_model
    from eyas.models.states import TargetStates
    from eyas.models.target_head import load_target_head
    from eyas.train.labels import make_labels

    head = load_target_head(resolve_model(SMOLLM2))
    model = load_drafter(drafter_dir, head.embed_weight)
    states = TargetStates(SMOLLM2, layers=",".join(map(str, model.config.aux_layer_ids)))
    input_ids = torch.tensor([ids])
    hidden = states.states(input_ids, torch.ones_like(input_ids)).float().clone()  # out of inference mode
    assert hidden.shape[2] == len(model.config.aux_layer_ids) + 1
    loss_mask = torch.tensor([mask])
    draft_ids = torch.arange(len(model.d2t)) + model.d2t
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids, input_ids)
    assert labels.greedy[0, :-1][labels.trained[0, :-1]].all(), "the answers are the target's greedy tokens"
    return input_ids, hidden, model, loss_mask, labels


def assert_counts_the_loop(stats: torch.Tensor, accepted: list[int]) -> None:
    """The chains the statistics count are the loop's: how many reach and accept each step; so
    tau_walk is the loop's own tau on these answers."""
    assert stats[:, CHAINS_REACHING].tolist() == [sum(min(a + 1, K) > k for a in accepted) for k in range(K)]
    assert stats[:, CHAINS_ACCEPTING].tolist() == [sum(a > k for a in accepted) for k in range(K)]
    assert summarize(stats)["tau_walk"] == round(1 + sum(accepted) / len(accepted), 4)
    assert summarize(stats)["greedy_path"] == 1.0


def test_on_policy_training_scores_exactly_what_a_draft_verify_loop_reaches(smollm2, drafter):
    """The loop's verification steps give the reached pairs (row s, steps 0..min(a, K-1)); the
    walk over the stored sample, from the drafter's greedy drafts and the target's greedy
    tokens, finds the same ones; and the on-policy loss is soft cross-entropy summed over
    exactly those pairs, over the trained positions of step 0, values and gradients (float32,
    1e-5); the chains counted in the statistics are the loop's, so tau_walk is its tau."""
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.proposers import Eagle3

    ids, mask, chains = hand_run(smollm2, drafter, lambda d: Eagle3(DrafterSession(d), steps=K))
    accepted = accepted_mix(chains)
    input_ids, hidden, model, loss_mask, labels = on_sample(ids, mask, drafter)

    T = len(ids)
    expected = torch.zeros(K, 1, T, dtype=torch.bool)
    for row, a in chains:
        for k in range(min(a + 1, K)):
            if row + 1 + k < T and labels.trained[0, row + 1 + k]:
                expected[k, 0, row] = True

    logits = model.forward_ttt(input_ids, hidden[:, :, :-1], K)  # K x [1, T, Vd]
    passes = torch.zeros(K, 1, T, dtype=torch.bool)
    for k in range(K):
        j = torch.arange(T - 1 - k) + 1 + k
        passes[k, 0, : T - 1 - k] = (logits[k][0, : T - 1 - k].argmax(-1) == labels.target_draft[0, j]) \
            & labels.greedy[0, j] & labels.trained[0, j]
    walked = reached_pairs(chain_reach(accepted_lengths(passes), labels.trained, K), K)
    for k in range(K):
        walked[k, :, T - 1 - k:] = False
        walked[k, 0, : T - 1 - k] &= labels.trained[0, 1 + k:]
    assert torch.equal(walked, expected)

    counts = step_counts(loss_mask, K)
    weights = torch.full((K,), 1.0) / counts[0]
    params = [p for p in model.parameters() if p.requires_grad]
    loss, stats, _ = model(input_ids, hidden[:, :, :-1], labels, weights, None, Objective(on_policy=True))
    grads = torch.autograd.grad(loss, params)
    ref = torch.zeros(())
    for k, b, i in expected.nonzero().tolist():
        j = i + 1 + k
        if labels.target_draft[b, j] >= 0:
            ref = ref - (labels.probs(b, j) * logits[k][b, i].log_softmax(-1)).sum()
    ref = ref / counts[0]
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # Every trained pair is still measured; only the reached ones weigh.
    assert stats[:, COUNT].tolist() == counts.tolist()
    plain_loss, plain_stats, _ = model(input_ids, hidden[:, :, :-1], labels, weights)
    assert not torch.isclose(loss, plain_loss, rtol=1e-3)
    # Either way the statistics count the loop's chains.
    for s in (stats, plain_stats):
        assert_counts_the_loop(s, accepted)


def test_dflash_held_out_walk_counts_exactly_the_chains_its_draft_verify_loop_accepts(smollm2, dflash_drafter):
    """DFlash decoding (eval's DFlash proposer: a context cache extended by each verification
    step's committed states, one block [last token, mask x K] after it) drafts exactly the
    chains that the training forward with every row anchoring a block (rows=None, as the
    held-out scorer runs it) walks along the same sample: the statistics count the loop's
    chains, each step's, so tau_walk is the loop's tau; and every block the loop drafts, after
    accepted and rejected steps alike, is the forward's row before its last token, logits
    within 1e-4 (float32), so no difference hides behind equal argmaxes. A mismatch between the
    two paths would lose acceptance and leave the answers as they were, which no answer check
    sees."""
    from eyas.evaluate.dflash import DFlash, DFlashSession

    blocks = []  # every block the loop drafts: (committed context length, its last token, slot logits [K, Vd])

    def recorded(drafter):
        session = DFlashSession(drafter)
        block = session.block

        def drafted(last: int) -> torch.Tensor:
            blocks.append((session.length, last, block(last)))
            return blocks[-1][2]

        session.block = drafted
        return DFlash(session, steps=K)

    ids, mask, chains = hand_run(smollm2, dflash_drafter, recorded)
    accepted = accepted_mix(chains)
    # Eval's static path (preallocated caches, the drafter's grown from 16 slots) runs the same loop.
    assert hand_run(smollm2, dflash_drafter, lambda d: DFlash(DFlashSession(d, capacity=16), steps=K),
                    static=True) == (ids, mask, chains)
    input_ids, hidden, model, loss_mask, labels = on_sample(ids, mask, dflash_drafter)
    weights = torch.full((K,), 1.0) / step_counts(loss_mask, K)[0]
    with torch.no_grad():
        _, stats, _ = model(input_ids, hidden[:, :, :-1], labels, weights)  # rows=None: every row anchors
        logits = model.forward_ttt(input_ids, hidden[:, :, :-1], K)  # K x [1, T, Vd]
    assert_counts_the_loop(stats, accepted)
    assert [length - 1 for length, _, _ in blocks] == [row for row, _ in chains]
    for length, last, block in blocks:  # measured: within 6e-6 of logits ~12
        torch.testing.assert_close(block, torch.stack([lg[0, length - 1] for lg in logits]), atol=1e-4, rtol=1e-4)
        assert last == ids[length]


TRAIN = ["--steps", "3", "--ttt-steps", "2", "--save-every", "1", "--lr", "0.001"]


def test_on_policy_on_smollm2_resumes_after_a_kill_and_keeps_decoding_plain(smollm2, drafter, tmp_path, capsys):
    """On the real SmolLM2 and the store of its own answers: an on-policy run from the trained
    drafter, killed while writing its second checkpoint, resumes to the weights of the run never
    killed; and the drafter it makes leaves greedy decoding as it was: chain and tree answers
    equal plain decoding's on both decoding paths (eager, and preallocated caches)."""
    from faults import killed

    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.proposers import Eagle3, Proposer
    from eyas.evaluate.run import load_checked_drafter, run_methods
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.evaluate.target import TargetSession
    from eyas.models.eos import eos_ids
    from eyas.prompts import EvalPrompt

    def args(out: Path, *extra) -> list:
        return ["train", "--store", drafter.parent / "store", "--out", out, "--steps", "4", "--ttt-steps", K,
                "--batch-tokens", "512", "--lr", "0.003", "--warmup", "0", "--save-every", "1", "--eval-fraction", "0",
                "--no-progress", "--device", "cpu", "--init", drafter, "--position-weights", "on-policy", *extra]

    assert cli(capsys, *args(tmp_path / "whole"))[0] == 0
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    assert not torch.equal(whole["lm_head.weight"], load_file(drafter / "model.safetensors")["lm_head.weight"])
    killed([str(a) for a in args(tmp_path / "killed")], match=r"killed/checkpoints/latest$", nth=2)
    assert cli(capsys, *args(tmp_path / "killed", "--resume"))[0] == 0
    again = load_file(tmp_path / "killed" / "model.safetensors")
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)

    model, tokenizer, identity = smollm2
    on_policy = load_checked_drafter(str(tmp_path / "whole"), model, identity)
    eos = set(eos_ids(model.generation_config, tokenizer))
    records = []
    for target in (TargetSession(model, on_policy.config.aux_layer_ids),
                   StaticTargetSession(model, on_policy.config.aux_layer_ids, capacity=16)):
        methods = [Proposer(), Eagle3(DrafterSession(on_policy, capacity=16), K),
                   Eagle3(DrafterSession(on_policy, capacity=16), K, tree=True, top_k=4, max_nodes=12)]
        records += run_methods(target, tokenizer, methods, [EvalPrompt("q", list(QUESTIONS))], MAX_NEW, eos,
                               progress=False)
    plain = {r["turn"]: r["generated_ids"] for r in records if r["method"] == "plain"}
    assert len(records) == 12 and all(r["generated_ids"] == plain[r["turn"]] for r in records)
    assert sum(sum(r["accept_counts"]) for r in records if r["method"] != "plain") > 0, "the drafter accepted nothing"


def test_init_then_on_policy_trains_records_and_resumes_to_the_uninterrupted_weights(tmp_path, capsys,
                                                                                     tiny_store):  # noqa: F811
    from faults import killed

    from eyas.cli import main

    first = tmp_path / "first"
    assert cli(capsys, *train_args(tiny_store, first, *TRAIN))[0] == 0
    on = [*TRAIN, "--init", str(first), "--position-weights", "on-policy"]
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in train_args(tiny_store, tmp_path / "whole", *on)])
    assert exit_.value.code == 0 and f"starting from --init {first}" in capsys.readouterr().out
    trainer = json.loads(next((tmp_path / "whole" / "checkpoints").glob("step-*/trainer.json")).read_text())
    assert trainer["config"]["init"] == str(first) and trainer["config"]["position_weights"] == "on-policy"
    start, end = load_file(first / "model.safetensors"), load_file(tmp_path / "whole" / "model.safetensors")
    assert not torch.equal(start["lm_head.weight"], end["lm_head.weight"])
    assert torch.equal(start["d2t"], end["d2t"]), "the draft vocabulary is --init's"

    killed(train_args(tiny_store, tmp_path / "killed", *on), match=r"killed/checkpoints/latest$", nth=2)
    got, _ = cli(capsys, *train_args(tiny_store, tmp_path / "killed", *on, "--resume"))
    assert got == 0
    again = load_file(tmp_path / "killed" / "model.safetensors")
    assert end.keys() == again.keys() and all(torch.equal(end[k], again[k]) for k in end)


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "dflash"], "--position-weights on-policy follows chains drafted from every row"),
    (["--draft-layers", "2"], "--draft-layers 2: --init"),
    (["--draft-vocab", "32"], "--draft-vocab 32: --init"),
])
def test_what_on_policy_and_init_cannot_take_is_refused_in_one_line(tmp_path, capsys, tiny_store, extra,
                                                                     message):  # noqa: F811
    first = tmp_path / "first"
    assert cli(capsys, *train_args(tiny_store, first, *TRAIN))[0] == 0
    args = [*TRAIN, "--init", str(first), *extra]
    if extra[0] == "--drafter":
        args += ["--position-weights", "on-policy"]
    got, out = cli(capsys, *train_args(tiny_store, tmp_path / "second", *args))
    assert got != 0 and message in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "second" / "model.safetensors").exists()


def test_init_of_another_kind_is_refused(tmp_path, capsys, tiny_store):  # noqa: F811
    first = tmp_path / "first"
    assert cli(capsys, *train_args(tiny_store, first, *TRAIN, "--drafter", "peagle"))[0] == 0
    got, out = cli(capsys, *train_args(tiny_store, tmp_path / "second", *TRAIN, "--init", str(first)))
    assert got != 0 and "is a P-EAGLE drafter; pass --drafter peagle" in out, out


def test_the_recipe_runs_onpolicy_after_train_on_the_same_data_and_takes_its_drafter(tmp_path):
    from eyas.recipe.run import plan

    recipe = {"model": SMOLLM2, "prepare": {"data": ["packaged:chitchat"]},
              "train": {"online": True, "minutes": 7.5, "ttt_steps": 3, "max-len": 256, "eval_fraction": 0.1},
              "onpolicy": {"steps": 40, "lr": 1e-4}, "eval": {"limit": 1}}
    stages = {s.name: s for s in plan(recipe, tmp_path, "recipe")}
    names = list(stages)
    assert names.index("train") < names.index("onpolicy") < names.index("heldout")
    on = stages["onpolicy"].config("recipe")
    assert on.init == str(tmp_path / "drafter") and on.position_weights == "on-policy"
    assert on.out == str(tmp_path / "onpolicy") and on.online and on.data == stages["train"].config("recipe").data
    assert (on.ttt_steps, on.max_len, on.eval_fraction, on.steps, on.minutes, on.lr) == (3, 256, 0.1, 40, None, 1e-4)
    for name in ("heldout", "eval-chain", "export-vllm"):
        assert str(tmp_path / "onpolicy") in stages[name].argv
    # --dry-run's estimates are each stage's own: train's 7.5 minutes, the onpolicy stage's steps.
    from eyas.recipe.estimate import describe
    from eyas.recipe.run import State
    lines = describe(recipe, list(stages.values()), State(tmp_path)).splitlines()
    estimate = {lines[n].split()[1]: lines[n + 2] for n in range(1, len(lines), 3)}
    assert "7.5 min" in estimate["train"] and "steps or epochs as given" in estimate["onpolicy"], estimate
