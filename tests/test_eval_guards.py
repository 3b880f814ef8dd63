"""Guards of eval and export found by an audit: a later turn never decodes past the target's
positions; long prompts build on templates that demand strict user/assistant alternation; a
replayed graph commit is not run again eagerly; a block or parallel drafter is never asked
for more tokens than it drafts (eval and export agree); an imported speculators drafter
keeps its depth; the tau-by columns sort numbers as numbers."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.draft import DraftConfig, load_config, save_drafter
from eyas.draft.build import new_drafter
from eyas.errors import EyasError
from eyas.models import load_target, load_tokenizer, model_identity, resolve_layer_ids
from eyas.prompts import render
from test_export import make_drafter, speculators, target_embeddings

# Gemma-2/3's and Mistral's shipped templates refuse a conversation that does not alternate.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/model/user/model/...') }}{% endif %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    model, tokenizer = load_target(str(tiny_llama_dir))
    return model, tokenizer, model_identity(str(tiny_llama_dir), model.config, tokenizer)


def drafter_of(target, kind: str, ttt_steps: int = 3) -> torch.nn.Module:
    """A random drafter of `kind` for the tiny target, weights large enough that drafts vary."""
    model, _, identity = target
    extra = {} if kind == "eagle3" else {"mask_token_id": 0}
    cfg = DraftConfig.for_target(model.config, identity, resolve_layer_ids("auto", identity.num_layers),
                                 model.config.vocab_size, drafter=kind, ttt_steps=ttt_steps, **extra)
    torch.manual_seed(0)
    drafter = new_drafter(cfg, model.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1 and p.requires_grad:
                p.normal_(0, 0.3)
    drafter.set_vocab(torch.arange(model.config.vocab_size))
    return drafter.eval()


# --- 1. every turn within the target's positions ------------------------------------------------

def test_a_later_turn_that_would_run_past_the_positions_stops_before_decoding(tmp_path, tiny_llama_dir):
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate

    tokenizer = load_tokenizer(str(tiny_llama_dir))
    limit = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    words = "the cat sat on the mat and looked at the dog "
    first, second = words * 40, words * 50
    assert len(render(tokenizer, [{"role": "user", "content": first}])) + 8 < limit  # turn 1 fits ...
    assert len(render(tokenizer, [{"role": "user", "content": first}, {"role": "assistant", "content": ""},
                                  {"role": "user", "content": second}])) > limit  # ... turn 2 cannot
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": [first, second]}) + "\n")
    out = tmp_path / "r.json"
    with pytest.raises(EyasError, match=rf"at turn 2 .* more than the {limit} of .*fewer new tokens") as e:
        evaluate(EvalConfig(model=str(tiny_llama_dir), prompts=str(prompts), max_new_tokens=8, baselines=(),
                            output=str(out)))
    assert "\n" not in str(e.value) and not out.exists()


# --- 2. long prompts on templates that demand alternation ---------------------------------------

def test_long_prompts_build_on_a_template_that_demands_alternation(tiny_llama_dir):
    from eyas.data.long_prompts import load_prompt_set

    tokenizer = load_tokenizer(str(tiny_llama_dir))
    tokenizer.chat_template = STRICT_TEMPLATE
    [prompt] = load_prompt_set("long:1k:1", lambda: tokenizer)
    roles = [m["role"] for m in prompt.history]
    assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
    n = len(render(tokenizer, [*prompt.history, {"role": "user", "content": prompt.turns[0]}]))
    assert 0.95 * 1024 <= n <= 1024


def test_pair_costs_build_the_same_prompts_as_message_costs_where_messages_render_alone(tiny_llama_dir,
                                                                                      monkeypatch):
    """Templates without the check get the very prompts they got when each message was measured alone."""
    from eyas.data import long_prompts

    tokenizer = load_tokenizer(str(tiny_llama_dir))
    pairs = long_prompts.load_prompt_set("long:1k,2k:2", lambda: tokenizer)

    def message_costs(tok):  # the rule before pairs: each message rendered alone, the costs added
        base = long_prompts._tokens(tok, [], "Hi.")

        def alone(message: dict[str, str]) -> int:
            return long_prompts._tokens(tok, [message], "Hi.") - base

        return lambda user, assistant: alone(user) + alone(assistant)

    monkeypatch.setattr(long_prompts, "_pair_tokens", message_costs)
    messages = long_prompts.load_prompt_set("long:1k,2k:2", lambda: tokenizer)
    assert [(p.turns, p.history) for p in pairs] == [(p.turns, p.history) for p in messages]


# --- 3. a replayed graph is not run again ------------------------------------------------------

def _copy_into(new, static) -> None:
    """What a graph replay does to its outputs: rewrite the recorded tensors in place."""
    if isinstance(static, torch.Tensor):
        static.copy_(new)
    elif isinstance(static, (tuple, list)):
        for n, s in zip(new, static):
            _copy_into(n, s)


class CallGraph:
    """A 'CUDA graph' on the CPU: recording calls the function once, a replay calls it again
    and writes its outputs into the recorded ones, which is what a replay computes."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self) -> None:
        _copy_into(self.fn(), self.out)


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Recorders that record and replay `CallGraph`s on the CPU, where sessions ask for graphs."""
    from eyas.models import graphs

    init = graphs.Recorder.__init__

    def enabled_init(self, device, enabled, what):
        init(self, device, enabled, what)
        self.enabled = enabled

    def capture(fn, pool=None):
        graph = CallGraph(fn)
        return graph, graph.out

    monkeypatch.setattr(graphs.Recorder, "__init__", enabled_init)
    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_a_replayed_dflash_commit_is_not_run_again_eagerly(target, cpu_graphs, monkeypatch):
    from eyas.evaluate.dflash import DFlashSession

    drafter = drafter_of(target, "dflash")
    session = DFlashSession(drafter, capacity=64)
    session.extend(torch.randn(3, 3, 64))  # records the commit of 4 rows (and replays it)
    calls = []
    context = drafter.context
    monkeypatch.setattr(drafter, "context", lambda aux: (calls.append(len(aux)), context(aux))[1])
    replays = session.graphs.replays
    session.extend(torch.randn(3, 3, 64))  # a step's commit: the recorded graph, replayed
    assert session.graphs.replays == replays + 1
    assert calls == [4]  # the replay's own pass, and no eager pass after it
    assert session.length == 6


def test_a_recorded_pass_that_returns_nothing_is_refused(cpu_graphs):
    from eyas.models.graphs import Recorder

    recorder = Recorder(torch.device("cpu"), True, "a pass")
    with pytest.raises(TypeError, match="returns None"):
        recorder.run("k", {"x": torch.zeros(2)}, lambda s: None)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "peagle"])
def test_every_recorded_pass_replays_to_the_eager_answers(target, kind, cpu_graphs):
    """Every caller of `Recorder.run` returns its outputs, so replays stand in for eager passes."""
    from eyas.evaluate.dflash import DFlash, DFlashSession
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.generate import generate
    from eyas.evaluate.peagle import PEagle
    from eyas.evaluate.proposers import Eagle3
    from eyas.evaluate.static_target import StaticTargetSession

    model, tokenizer, _ = target
    drafter = drafter_of(target, kind)
    ids = render(tokenizer, [{"role": "user", "content": "tell me a story about a cat and a dog"}])
    got = []
    for graphs in (True, False):
        session = StaticTargetSession(model, drafter.config.aux_layer_ids, capacity=128, graphs=graphs)
        how = {"capacity": 128, "graphs": graphs}
        proposer = (DFlash(DFlashSession(drafter, **how), 3) if kind == "dflash" else
                    PEagle(DrafterSession(drafter, **how), 3) if kind == "peagle" else
                    Eagle3(DrafterSession(drafter, **how), 3))
        g = generate(session, proposer, ids, 12, set())
        got.append((g.generated_ids, g.accept_counts, session.graphs.replays, proposer.session.graphs.replays))
        session.close()
    (ids_g, counts_g, target_replays, drafter_replays), (ids_e, counts_e, _, _) = got
    assert (ids_g, counts_g) == (ids_e, counts_e)
    assert target_replays > 0 and drafter_replays > 0


# --- 4. no more tokens than a block or parallel drafter drafts -----------------------------------

@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_steps_above_what_a_one_pass_drafter_drafts_are_refused_by_eval_and_export(target, kind, tmp_path,
                                                                                   tiny_llama_dir):
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import draft_depth
    from eyas.export.exporter import speculative_tokens

    ckpt = tmp_path / kind
    save_drafter(drafter_of(target, kind, ttt_steps=3), ckpt)
    cfg = load_config(ckpt)
    common = dict(model=str(tiny_llama_dir), draft=str(ckpt))
    assert draft_depth(EvalConfig(**common))[0] == 3 == speculative_tokens(cfg, None)
    assert draft_depth(EvalConfig(steps=2, **common)) == (2, "--steps") and speculative_tokens(cfg, 2) == 2
    for refuse in (lambda: draft_depth(EvalConfig(steps=6, **common)), lambda: speculative_tokens(cfg, 6)):
        with pytest.raises(EyasError, match=r"(--steps|--num-speculative-tokens) 6: .* at most its trained depth, "
                                            r"3 tokens.*--ttt-steps 6") as e:
            refuse()
        assert "\n" not in str(e.value)


def test_a_step_by_step_drafter_drafts_any_depth(target, tmp_path, tiny_llama_dir):
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import draft_depth
    from eyas.export.exporter import speculative_tokens

    ckpt = tmp_path / "eagle3"
    save_drafter(drafter_of(target, "eagle3", ttt_steps=3), ckpt)
    assert draft_depth(EvalConfig(model=str(tiny_llama_dir), draft=str(ckpt), steps=6)) == (6, "--steps")
    assert speculative_tokens(load_config(ckpt), 6) == 6


# --- 5. an imported speculators drafter keeps its depth -----------------------------------------

@pytest.mark.parametrize("tokens", [3, 5])
def test_import_of_a_speculators_drafter_keeps_its_speculative_tokens(tokens, tiny_llama_dir, tmp_path):
    from eyas.export import import_drafter

    ckpt = make_drafter(tiny_llama_dir, tmp_path / "ckpt", norm_before_residual=True)
    assert load_config(ckpt).ttt_steps not in (3, 5)
    folder = speculators(ckpt, tmp_path / "spec", str(tiny_llama_dir), target_embeddings(tiny_llama_dir))
    config = json.loads((folder / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = tokens
    (folder / "config.json").write_text(json.dumps(config))
    summary = import_drafter(folder, tmp_path / "back")
    assert load_config(tmp_path / "back").depth == tokens and summary["depth"] == tokens


def test_import_refuses_a_speculative_tokens_that_is_no_count(tiny_llama_dir, tmp_path):
    from eyas.export import import_drafter

    ckpt = make_drafter(tiny_llama_dir, tmp_path / "ckpt", norm_before_residual=True)
    folder = speculators(ckpt, tmp_path / "spec", str(tiny_llama_dir), target_embeddings(tiny_llama_dir))
    config = json.loads((folder / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = "3"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match="speculative_tokens"):
        import_drafter(folder, tmp_path / "back")


# --- 6. tau-by columns in numeric order ----------------------------------------------------------

def test_tau_by_columns_sort_numbers_as_numbers():
    from eyas.evaluate.report import format_breakdown, tau_by

    records = [{"method": m, "category": f"ctx {n}", "turn": t, "accept_counts": [1, 2]}
               for m in ("plain", "eagle3-chain") for n in (65536, 8192, 32768) for t in (10, 2, 1)]
    table = format_breakdown({"category": tau_by(records, "category"), "turn": tau_by(records, "turn")})
    lines = table.splitlines()
    category = lines[lines.index("tau by category:") + 1].split()
    assert category == ["method", "ctx", "8192", "ctx", "32768", "ctx", "65536"]
    assert lines[lines.index("tau by turn:") + 1].split() == ["method", "1", "2", "10"]
