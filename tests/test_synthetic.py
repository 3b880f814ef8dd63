"""eyas.data.synthetic (`packaged:synthetic`) writes the synthetic training prompts it claims:
deterministic, well-formed, unique first turns, every family present, extraction quoting the
passages, and none overlapping MT-bench."""

from __future__ import annotations

import pytest

import eyas.data.synthetic as sp
from eyas.data.sources import packaged_synthetic
from eyas.prompts import mt_bench_turns

PASSAGES = [
    "The harbour town of Eldmoor was founded in 1642 by fishing families from the north. By 1800 it had "
    "grown to 4,300 residents. Its lighthouse, built by engineer Tomas Vell, still stands. The town council "
    "meets every second Tuesday. In 1921 a fire destroyed the old market hall, which was rebuilt two years later.",
    "Greenfield Robotics reported revenue of 48 million dollars in 2023, up 12 percent. Chief executive Dana Oru "
    "said the growth came from warehouse contracts in Ohio and Texas. The company employs 310 people. "
    "It plans to open an office in Lyon next spring. Analysts at Birch Capital expect slower growth.",
    "Volunteers counted 212 bird species during the spring survey at Lake Marra. The rarest sighting was a pair "
    "of spoonbills. Survey leader Ana Kirsch thanked the 85 participants. Results will be published in June.",
]


def test_deterministic_and_seed_dependent():
    a = sp.synthetic_conversations(300, 1, PASSAGES)
    assert a == sp.synthetic_conversations(300, 1, PASSAGES)
    assert a != sp.synthetic_conversations(300, 2, PASSAGES)


def test_structure():
    for conv in sp.synthetic_conversations(500, 0, PASSAGES):
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
        assert conv[1]["content"] == "." and conv[3]["content"] == "."
        assert conv[0]["content"].strip() and conv[2]["content"].strip()


def test_unique_first_turns():
    firsts = [c[0]["content"] for c in sp.synthetic_conversations(5000, 3, PASSAGES)]
    assert len(set(firsts)) == 5000


def test_every_family_and_extraction_quotes_passage():
    out = sp.synthetic_conversations_with_families(2000, 0, PASSAGES)
    assert {f for f, _ in out} == set(sp.FAMILIES)
    sentences = [s for p in PASSAGES for s in p.split(". ")]
    for family, conv in out:
        if family == "extraction":
            assert any(s[:40] in conv[0]["content"] for s in sentences)
    assert "extraction" not in {f for f, _ in sp.synthetic_conversations_with_families(500, 0, [])}


def test_contaminated():
    refs = ["Describe the migration of arctic terns across the globe in vivid, poetic language please."]
    hit = "Hello there. Describe the migration of arctic terns across the globe, today."
    assert sp.contaminated(hit, refs)
    assert sp.contaminated(hit, sp.ngram_set(refs, 8))
    assert not sp.contaminated("Describe the migration of arctic terns across oceans.", refs)
    assert not sp.contaminated("Tell me about arctic terns.", refs)


def test_impossible_n():
    with pytest.raises(ValueError):
        sp.synthetic_conversations(10**9, 0, PASSAGES)


def test_no_mtbench_contamination():
    refs = mt_bench_turns()
    assert len(refs) == 160
    grams = sp.ngram_set(refs, 8)
    bad = [t for c in sp.synthetic_conversations(20000, 0, PASSAGES) for t in (c[0]["content"], c[2]["content"])
           if sp.contaminated(t, grams)]
    assert not bad, bad[:5]


def test_packaged_source_is_deterministic_sized_and_free_of_mt_bench():
    """`packaged:synthetic:N:SEED` gives exactly N conversations, the same for a seed (and a
    larger N extends a smaller one), other ones for another seed, none sharing an 8-word run
    with MT-bench; its extraction prompts quote the packaged ShareGPT answers."""
    a = packaged_synthetic(400, 5)
    assert len(a) == 400 and a == packaged_synthetic(400, 5) and a[:100] == packaged_synthetic(100, 5)
    assert a != packaged_synthetic(400, 6)
    grams = sp.ngram_set(mt_bench_turns(), 8)
    assert not [m for c in a for m in c if m["role"] == "user" and sp.contaminated(m["content"], grams)]
    assert any("extract" in c[0]["content"].lower() or "passage" in c[0]["content"].lower() for c in a)


def test_clean_conversations_drops_those_overlapping_a_reference():
    """A conversation whose user turn shares eight words in a row with a reference is dropped;
    the rest come through in order."""
    made = sp.synthetic_conversations(50, 3, PASSAGES)
    leaked = made[7][2]["content"]  # a follow-up turn, quoted inside a reference text
    words = leaked.split()
    if len(words) < 8:
        leaked = made[7][0]["content"]
        words = leaked.split()
    reference = "An unrelated opening. " + " ".join(words[:8]) + " and more."
    kept = sp.clean_conversations(50, 3, PASSAGES, [reference])
    assert made[7] not in kept
    assert all(c in made for c in kept) and len(kept) < 50
    assert [c for c in made if c in kept] == kept


def test_passages_are_prose_without_code():
    prose = " ".join(["word"] * 60)
    assert sp.passage_ok(prose)
    assert not sp.passage_ok(" ".join(["word"] * 59))
    assert not sp.passage_ok(prose + " ```python")
    assert not sp.passage_ok(prose + " caf\u00e9")
