"""The pieces of speculative decoding, each against a reference: tree masks against path
enumeration, tree verification against decoding each path alone, the drafter's cached
decoding against training-time test, the acceptance rule against the distribution it must
preserve, and the report against recomputation from accept counts."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.draft import DraftConfig, Eagle3Drafter
from eyas.evaluate.accept import accept_greedy, accept_sampled
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.proposers import PromptLookup
from eyas.evaluate.report import acceptance_rates, differing, format_table, low_precision_note, summarize
from eyas.evaluate.target import TargetSession
from eyas.evaluate.tree import DraftTree
from eyas.models import ModelIdentity

ATOL = 1e-4  # float32, same weights, different kernel shapes


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tree = DraftTree()
    for i in range(n):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    return tree


def path_to(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


@pytest.fixture(scope="module")
def toy():
    """A tiny random Llama target and a random EAGLE-3 drafter for it (vocab 96, draft vocab 64)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return target, toy_drafter(target)


def toy_drafter(target: LlamaForCausalLM, **options) -> Eagle3Drafter:
    identity = ModelIdentity("toy", "c", "t", 4, 32, 96)
    cfg = DraftConfig.for_target(target.config, identity, (0, 1, 2, 4), 64, **options)
    drafter = Eagle3Drafter(cfg, target.get_input_embeddings().weight.detach()).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1 and p.requires_grad:
                p.normal_(0, 0.3)
        for norm in drafter.fc_norm if cfg.fc_norm else []:
            norm.weight.normal_(1, 0.5)
    drafter.set_vocab(torch.randperm(96)[:64].sort().values)
    return drafter


@pytest.fixture(scope="module", params=["plain", "fc_norm+norm_output", "3 layers"])
def drafter(request, toy) -> Eagle3Drafter:
    """The toy drafter, one with both drafter options (fc_norm weights random too), and one of
    three layers (--draft-layers 3: two plain Llama layers after the first)."""
    if request.param == "plain":
        return toy[1]
    torch.manual_seed(5)
    if request.param == "3 layers":
        return toy_drafter(toy[0], num_hidden_layers=3, norm_output=True)
    return toy_drafter(toy[0], fc_norm=True, norm_output=True)


def test_ancestor_mask_is_exactly_the_path():
    rng = random.Random(0)
    for _ in range(20):
        tree = random_tree(rng, rng.randrange(1, 30), 50)
        mask = tree.ancestor_mask()
        for i in range(len(tree)):
            allowed = {0} | {n + 1 for n in path_to(tree, i)}
            assert set(torch.nonzero(mask[i + 1]).flatten().tolist()) == allowed
        assert mask[0].nonzero().flatten().tolist() == [0]
    chain = DraftTree.chain([5, 6, 7])
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.depths() == [1, 2, 3]


def test_tree_verification_equals_decoding_each_path(toy):
    """One tree pass gives, for every node, the logits of the prefix + its path alone; and
    after keeping a non-contiguous accepted path the cache continues exactly."""
    target, _ = toy
    rng = random.Random(1)
    prefix = [rng.randrange(96) for _ in range(9)]
    root = 17
    tree = random_tree(rng, 14, 96)
    session = TargetSession(target)
    session.prefill(torch.tensor(prefix))
    logits, _ = session.verify(root, tree)
    with torch.no_grad():
        full = target(torch.tensor([prefix + [root]])).logits[0, -1]
        assert torch.allclose(logits[0], full, atol=ATOL)
        for i in range(len(tree)):
            ids = prefix + [root] + [tree.tokens[n] for n in path_to(tree, i)]
            ref = target(torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(logits[i + 1], ref, atol=ATOL), f"node {i}"
    deepest = max(range(len(tree)), key=lambda i: len(path_to(tree, i)))
    path = path_to(tree, deepest)
    assert path != list(range(len(path))), "pick a seed whose deepest path is not a prefix of the node order"
    session.commit([0] + [n + 1 for n in path])
    nxt, _ = session.verify(3, DraftTree())
    with torch.no_grad():
        ref = target(torch.tensor([prefix + [root] + [tree.tokens[n] for n in path] + [3]])).logits[0, -1]
    assert session.length == len(prefix) + 1 + len(path)
    assert torch.allclose(nxt[0], ref, atol=ATOL)


def _ttt_logits(drafter, ids: list[int], aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [lg[0] for lg in drafter.forward_ttt(torch.tensor([ids]), aux[None], steps)]


def test_drafter_chain_matches_training_time_test(drafter):
    """Cached decoding of a chain = forward_ttt with the drafted tokens as ground truth."""
    torch.manual_seed(2)
    n, depth = 12, 4
    ids = torch.randint(0, 96, (n + 1,)).tolist()  # t_0 .. t_n
    aux = torch.randn(n + depth, 3, 32)  # aux rows past n are never read at position n - 1
    session = DrafterSession(drafter)
    session.extend(torch.tensor(ids[1:]), aux[:n])
    chain = session.chain(depth, temperature=1.0, generator=torch.Generator().manual_seed(0))
    seq = ids + chain.tokens
    ttt = _ttt_logits(drafter, seq[: n + depth], aux, depth)
    d2t = drafter.draft_to_target(torch.arange(64))
    for k in range(depth):
        q = torch.zeros(96)
        q[d2t] = torch.softmax(ttt[k][n - 1], -1)
        assert torch.allclose(chain.proposals[k], q, atol=ATOL), f"draft position {k + 1}"
    greedy = session.chain(depth)
    assert session.tree(depth, top_k=1, max_nodes=depth).tokens == greedy.tokens


def test_drafter_tree_nodes_are_top_k_of_their_path(drafter):
    """Each tree node is among the top-k draft tokens given its own ancestors (checked with
    forward_ttt, which knows nothing of trees), and ancestors are always kept."""
    torch.manual_seed(3)
    n, depth, k = 10, 3, 3
    ids = torch.randint(0, 96, (n + 1,)).tolist()
    aux = torch.randn(n + depth, 3, 32)
    session = DrafterSession(drafter)
    session.extend(torch.tensor(ids[1:]), aux[:n])
    tree = session.tree(depth, top_k=k, max_nodes=20)
    assert 0 < len(tree) <= 20 and max(tree.depths()) == depth
    d2t = drafter.draft_to_target(torch.arange(64))
    for i in range(len(tree)):
        path = [tree.tokens[m] for m in path_to(tree, i)]
        ttt = _ttt_logits(drafter, (ids + path + [0] * depth)[: n + depth], aux, len(path))
        top = d2t[ttt[len(path) - 1][n - 1].topk(k).indices].tolist()
        assert path[-1] in top, f"node {i} at depth {len(path)}"


def _reference_tree(drafter, ids: list[int], aux: torch.Tensor, depth: int, k: int, max_nodes: int) -> DraftTree:
    """EAGLE-2's dynamic tree by its definition, each node's children from forward_ttt over its
    own path (no cache, no masks): the k best children of the root; per level the k best-scored
    of the last level's nodes each give their k best children; the max_nodes best nodes are
    kept with their ancestors, in creation order."""
    n = len(ids) - 1
    d2t = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size)).tolist()

    def children(path: list[int]) -> list[tuple[int, float]]:
        ttt = _ttt_logits(drafter, (ids + path + [0] * depth)[: n + depth], aux, len(path) + 1)
        top = torch.log_softmax(ttt[len(path)][n - 1].float(), -1).topk(k)
        return [(d2t[i], v) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    paths, parents, scores = [], [], []
    for token, lp in children([]):
        paths.append([token]), parents.append(-1), scores.append(lp)
    frontier = list(range(k))
    for _ in range(1, depth):
        level = []
        for f in frontier:
            for token, lp in children(paths[f]):
                level.append(len(paths))
                paths.append(paths[f] + [token]), parents.append(f), scores.append(scores[f] + lp)
        frontier = sorted(level, key=lambda m: -scores[m])[:k]
    keep = set(sorted(range(len(paths)), key=lambda m: -scores[m])[:max_nodes])
    for m in list(keep):
        while parents[m] >= 0:
            m = parents[m]
            keep.add(m)
    order = sorted(keep)
    tree = DraftTree()
    for m in order:
        tree.add(paths[m][-1], order.index(parents[m]) if parents[m] >= 0 else -1)
    return tree


@pytest.mark.parametrize("depth,k,max_nodes", [(4, 3, 12), (3, 4, 40), (5, 2, 6), (1, 3, 2)])
def test_drafter_tree_equals_its_definition(drafter, depth, k, max_nodes):
    """The tree drafted on the device in fixed-shape levels (one CUDA graph on a GPU) is the
    tree the definition builds node by node from forward_ttt: same tokens, same parents."""
    torch.manual_seed(4)
    n = 11
    ids = torch.randint(0, 96, (n + 1,)).tolist()
    aux = torch.randn(n + depth, 3, 32)
    session = DrafterSession(drafter)
    session.extend(torch.tensor(ids[1:]), aux[:n])
    tree = session.tree(depth, top_k=k, max_nodes=max_nodes)
    ref = _reference_tree(drafter, ids, aux, depth, k, max_nodes)
    assert (tree.tokens, tree.parents) == (ref.tokens, ref.parents)
    session.extend(torch.tensor([ids[-1]]), aux[n:n + 1])  # the drafted entries are overwritten, not kept
    again = DrafterSession(drafter)
    again.extend(torch.tensor(ids[1:] + [ids[-1]]), aux[:n + 1])
    assert session.tree(depth, k, max_nodes).tokens == again.tree(depth, k, max_nodes).tokens


def test_greedy_acceptance_walks_the_argmax_path():
    tree = DraftTree()
    a = tree.add(4, -1)
    tree.add(5, -1)
    c = tree.add(6, a)
    tree.add(7, c)
    logits = torch.full((5, 10), -5.0)
    logits[0, 4] = logits[1, 6] = logits[3, 9] = 5.0  # root -> 4 -> 6 -> (9, not drafted)
    assert accept_greedy(tree, logits) == ([a, c], 9)
    logits[0, 4], logits[0, 1] = -5.0, 5.0
    assert accept_greedy(tree, logits) == ([], 1)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expected under 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


@pytest.mark.parametrize("kind", ["sampled-chain", "point-mass-siblings"])
def test_acceptance_rule_emits_the_target_distribution(kind):
    """The first emitted token (accepted draft or bonus) is distributed as p, whatever q is."""
    g = torch.Generator().manual_seed(4)
    V = 12
    p_logits = torch.randn(V, generator=g) * 2
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    p = torch.softmax(p_logits, -1)
    counts = torch.zeros(V)
    trials = 6000
    for _ in range(trials):
        if kind == "sampled-chain":
            x = int(torch.multinomial(q, 1, generator=g))
            tree = DraftTree.chain([x], [q])
        else:
            tree = DraftTree()
            for t in (int(p.argmin()), 3, 7):  # a bad first guess, then two more siblings
                tree.add(t, -1)
        logits = torch.stack([p_logits, torch.zeros(V)] + [torch.zeros(V)] * (len(tree) - 1))
        path, bonus = accept_sampled(tree, logits, 1.0, g)
        counts[tree.tokens[path[0]] if path else bonus] += 1
    assert _chi2_pvalue(counts, p) > 1e-3
    assert (counts - p * trials).abs().max() < 5 * (p * trials).sqrt().max()


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    pl = PromptLookup(num_tokens=3)
    assert pl.propose([1, 2, 3, 4, 5, 9, 2, 3], budget=10).tokens == [4, 5, 9]
    assert pl.propose([1, 2, 3, 4, 5, 9, 2, 3], budget=2).tokens == [4, 5]
    assert pl.propose([7, 8, 9], budget=5).tokens == []
    assert pl.propose([5, 1, 5, 2, 5], budget=5).tokens == [2, 5]  # unigram fallback, latest match
    assert pl.propose([1, 2], budget=0).tokens == []


def test_report_recomputes_tau_and_rates_from_counts():
    records = [
        {"method": "plain", "generated_ids": list(range(10)), "accept_counts": [0] * 9, "seconds": 2.0},
        {"method": "eagle3-chain", "generated_ids": list(range(10)), "accept_counts": [3, 0, 2, 1], "seconds": 1.0},
    ]
    s = summarize(records, {"eagle3-chain": 4})
    assert s["eagle3-chain"].tau == pytest.approx(1 + 6 / 4)
    assert s["eagle3-chain"].acceptance == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert s["eagle3-chain"].tau == pytest.approx(1 + sum(s["eagle3-chain"].acceptance))
    assert s["eagle3-chain"].speedup == pytest.approx(2.0)
    assert acceptance_rates([], 2) == [0.0, 0.0]
    table = format_table(s)
    assert "1 + accepted draft tokens per verification step" in table
    assert "eagle3-chain     2.50" in table and "2.00x" in table


def test_report_counts_answers_identical_to_plain_decoding_turn_by_turn():
    """At T=0 the table says, per method, how many answers equal plain decoding's answer to the
    same prompt and turn, and eval warns about the others; sampled runs promise no such thing."""
    def rec(method, pid, turn, ids):
        return {"method": method, "prompt_id": pid, "turn": turn, "generated_ids": ids, "accept_counts": [1],
                "seconds": 1.0}

    records = [rec("plain", "a", 0, [1, 2]), rec("plain", "a", 1, [3]), rec("plain", "b", 0, [4]),
               rec("chain", "a", 0, [1, 2]), rec("chain", "a", 1, [3]), rec("chain", "b", 0, [4]),
               rec("lookup", "a", 0, [1, 2]), rec("lookup", "a", 1, [4]), rec("lookup", "b", 0, [3])]
    s = summarize(records, {})
    assert (s["plain"].identical, s["chain"].identical, s["lookup"].identical) == (None, 3, 1)
    assert differing(s) == ["2 of 3 lookup answers differ from plain decoding's"]
    table = format_table(s)
    assert "= plain" in table and "3/3" in table and "1/3" in table
    assert all(x.identical is None for x in summarize(records, {}, greedy=False).values())
    no_ids = [{k: v for k, v in r.items() if k != "prompt_id"} for r in records]
    assert all(x.identical is None for x in summarize(no_ids, {}).values())  # nothing to match turns by
    assert differing(summarize(records, {}, greedy=False)) == []


def test_a_difference_below_float32_names_rounding_and_the_float32_check():
    """In float32 a differing answer is a fault and the warning says nothing else; below it, a
    verification pass's several rows round otherwise than plain decoding's one, and the warning
    says so and where to check."""
    assert low_precision_note("float32") == ""
    for dtype in ("bfloat16", "float16"):
        note = low_precision_note(dtype)
        assert f"in {dtype} a verification pass over several rows" in note and "--dtype float32" in note


def test_a_timed_decoding_step_is_the_same_step_with_its_parts_timed(toy):
    """bench/parallel_gpu.py times drafting and verification through `generate(timer=)`: the
    answer and its acceptance are the untimed run's, and both parts are counted."""
    from eyas.evaluate.generate import generate
    from eyas.evaluate.proposers import Eagle3
    from eyas.timing import StepTimer

    target, drafter = toy
    runs = []
    for timer in (None, StepTimer(torch.device("cpu"))):
        session = TargetSession(target, drafter.config.aux_layer_ids)
        g = generate(session, Eagle3(DrafterSession(drafter), 3), [5, 9, 17, 33], 20, set(), timer=timer)
        session.close()
        runs.append((g.generated_ids, g.accept_counts))
    assert runs[0] == runs[1] and len(runs[0][0]) == 20
    assert set(timer.seconds) == {"draft", "verify"} and all(s > 0 for s in timer.seconds.values())


def test_a_recorded_pass_reads_a_power_of_two_of_slots_within_the_cache():
    """`read_width`: every row a pass writes is read, never past the cache, and the width is a
    whole number of the attention's key parts (models/attention.SPLIT_KEYS)."""
    from eyas.evaluate.static_target import WIDTH_MIN, read_width
    from eyas.models.attention import SPLIT_KEYS

    assert read_width(1, 2304) == WIDTH_MIN
    assert read_width(257, 2304) == 512 and read_width(512, 2304) == 512
    assert read_width(2049, 2304) == read_width(5000, 2304) == 2304
    for slots in range(1, 2305, 37):
        width = read_width(slots, 2304)
        assert slots <= width <= 2304 and width % SPLIT_KEYS == 0


def test_parallel_bench_arms_pass_their_train_options_through(monkeypatch):
    """bench/parallel_gpu.py's --arms: options separated by ':' or ',', a value holding either
    (layers=spread:5, causal_layers=0,2), a new arm only before a kind; each arm's options make
    the TrainConfig its trainer gets."""
    from pathlib import Path
    from types import SimpleNamespace

    from eyas.train.config import TrainConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    parallel = pytest.importorskip("parallel_gpu")
    given = "dflash:batch_tokens=8192,loss=hard-ce,causal_layers=0,2:layers=spread:5,eagle3,dflash:causal_layers=all"
    arms = parallel.split_arms(given)
    assert arms == ["dflash:batch_tokens=8192,loss=hard-ce,causal_layers=0,2:layers=spread:5", "eagle3",
                    "dflash:causal_layers=all"]
    options = parallel.arms(SimpleNamespace(arms=arms, dflash_anchors=8, dflash_layers=3))
    first, last = options[arms[0]], options[arms[2]]
    assert (first["batch_tokens"], first["loss"], first["causal_layers"], first["layers"]) == \
        (8192, "hard-ce", "0,2", "spread:5")
    assert last["causal_layers"] == "all"
    assert options["eagle3"]["ttt_steps"] == 7  # an EAGLE-3 arm gives its depth, unless it leaves it to the rule:
    assert parallel.arms(SimpleNamespace(arms=["eagle3:ttt_steps=null"], dflash_anchors=8,
                                         dflash_layers=3))["eagle3:ttt_steps=null"]["ttt_steps"] is None
    target = SimpleNamespace(vocab_size=100, num_layers=30)
    for arm, causal, loss in ((first, (0, 2), "hard-ce"), (last, (0, 1, 2), "soft-ce")):
        cfg = TrainConfig(out="unused", online=True, model="m", data="d", **arm)
        assert cfg.kind_options(target)["causal_layers"] == causal and cfg.loss == loss
