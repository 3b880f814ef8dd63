"""Synthetic two-turn user prompts in the spirit of UltraChat: the source `packaged:synthetic`.

Why: a drafter learns the target's distribution on the text it is trained on. Trained only on
ShareGPT/chitchat answers it sees little of what a chat benchmark asks for (essays, roleplay,
puzzles, arithmetic, code, extraction from a passage), and its acceptance drops there. This
module writes user turns of those kinds from hand-written tables (stdlib only, deterministic
given a seed); the target model answers them later, replacing the "." placeholders. The tables
are data, kept in synthetic.json beside this module: topics are noun phrases that read well
after "about", "explain", "discuss"; templates name their {fields}.

`contaminated` lets the caller drop prompts that share an n-word span with the benchmark's own
questions, so that training never sees benchmark text: `packaged_synthetic` (eyas.data.sources,
where the packaged texts are read) always leaves out those that share eight words in a row with
MT-bench (the eval prompts eyas ships).

On SmolLM2 these prompts were the data kind that mattered most (+0.3 MT-bench chain tau over
regenerated ShareGPT and chitchat alone; docs/train.md).
"""

from __future__ import annotations

import functools
import json
import random
import re
import unicodedata
from importlib import resources
from types import SimpleNamespace
from typing import Callable

FAMILIES: tuple[str, ...] = ("writing", "roleplay", "stem", "humanities", "reasoning", "math",
                             "coding", "extraction")
TABLES_FILE = "synthetic.json"


def _load_tables() -> SimpleNamespace:
    """The tables of TABLES_FILE (shipped as package data), each a tuple of strings or of string tuples."""
    raw = json.loads(resources.files(__package__).joinpath(TABLES_FILE).read_text(encoding="utf-8"))
    return SimpleNamespace(**{name: tuple(tuple(x) if isinstance(x, list) else x for x in items)
                              for name, items in raw.items()})


TABLES = _load_tables()
STEM_TOPICS = TABLES.science + TABLES.tech
HUMANITIES_TOPICS = TABLES.history + TABLES.philosophy_lit_arts + TABLES.econ_law_society
TOPICS = STEM_TOPICS + HUMANITIES_TOPICS + TABLES.mind_edu_life + TABLES.places_food_sport_env
NAMES = TABLES.female + TABLES.male
OPINION_FOLLOWUPS = TABLES.generic_followups + TABLES.opinion_followups  # the generic ones, then two of its own


# ========================================================================================= generators
Pair = tuple[str, str]


def _followup(rng: random.Random, specific: tuple[str, ...], generic_share: float = 0.5,
              generic: tuple[str, ...] = TABLES.generic_followups) -> str:
    """A family-specific follow-up or, with probability `generic_share`, a generic one."""
    return rng.choice(generic) if rng.random() < generic_share else rng.choice(specific)


def _writing(rng: random.Random, passages: list[str]) -> Pair:
    first = rng.choice(TABLES.writing).format(topic=rng.choice(TOPICS), limit=rng.choice(TABLES.limits))
    return first, _followup(rng, TABLES.writing_followups, generic=OPINION_FOLLOWUPS)


def _roleplay(rng: random.Random, passages: list[str]) -> Pair:
    first = (rng.choice(TABLES.role_openers).format(p=rng.choice(TABLES.personas)) + " "
             + rng.choice(TABLES.role_tasks).format(topic=rng.choice(TOPICS)))
    first += rng.choice(TABLES.role_suffixes)
    return first, _followup(rng, TABLES.role_followups, 0.3)


def _stem(rng: random.Random, passages: list[str]) -> Pair:
    pair = rng.choice(TABLES.pairs)
    first = rng.choice(TABLES.stem).format(topic=rng.choice(STEM_TOPICS), audience=rng.choice(TABLES.audiences),
                                           pair0=pair[0], pair1=pair[1])
    return first[0].upper() + first[1:] + rng.choice(TABLES.stem_suffixes), _followup(rng, TABLES.explain_followups)


def _humanities(rng: random.Random, passages: list[str]) -> Pair:
    first = rng.choice(TABLES.humanities).format(topic=rng.choice(HUMANITIES_TOPICS), debate=rng.choice(TABLES.debates),
                                                 words=rng.choice((200, 300, 400, 500)))
    first += rng.choice(TABLES.humanities_suffixes)
    return first, _followup(rng, TABLES.humanities_followups, generic=OPINION_FOLLOWUPS)


def _reasoning(rng: random.Random, passages: list[str]) -> Pair:
    """Puzzles with random names and numbers: the answer has to be worked out, not recalled."""
    kind = rng.randrange(9)
    if kind == 0:  # ordering
        people = rng.sample(NAMES, rng.randint(3, 5))
        comp, most, least = rng.choice(TABLES.comparatives)
        facts = [f"{a} is {comp} {b}." for a, b in zip(people, people[1:])]
        rng.shuffle(facts)
        first = " ".join(facts) + f" Who is the {rng.choice((most, least))}, and what is the full order?"
        follow = f"Now suppose {people[0]} and {people[-1]} swap places in the order. Which statements become false?"
    elif kind == 1:  # family relations
        w, d, g = rng.sample(TABLES.female, 3)
        m, c = rng.sample(TABLES.male, 2)
        first = rng.choice((
            f"{w} is the mother of {m}. {m} is the father of {c}. How is {w} related to {c}?",
            f"{m} and {d} are siblings. {d} has a son called {c}. What is {m} to {c}?",
            f"{w}'s brother is {m}. {m}'s daughter is {d}. {d}'s child is {c}. How are {w} and {c} related?"))
        follow = f"Add one more person: {g} is {c}'s only cousin's grandmother. Draw the family tree as text."
    elif kind == 2:  # knights and knaves
        a, b = rng.sample(NAMES, 2)
        claim = rng.choice((f"{b} is a knave.", "We are both knaves.", f"{b} and I are the same type.", "At least one of us is a knave."))
        first = (f"On an island, knights always tell the truth and knaves always lie. {a} says: \"{claim}\" "
                 f"{b} says nothing. What can you conclude about {a} and {b}?")
        follow = f"What if {b} then says: \"{a} is a knight\"? Does that change your conclusion?"
    elif kind == 3:  # rates of work
        a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 10)
        d, e = rng.randint(2, 12), rng.randint(2, 15)
        first = (f"If {a} workers can build {b} sheds in {c} days, how many days would {d} workers need to build {e} sheds, "
                 "working at the same rate?")
        follow = f"Now say only {max(1, d - 1)} workers are available for the first half of the job. How long does it take?"
    elif kind == 4:  # weekdays
        ago, ahead, day = rng.randint(2, 40), rng.randint(2, 100), rng.choice(TABLES.weekdays)
        first = f"If {ago} days ago it was a {day}, what day of the week will it be {ahead} days from today?"
        follow = f"And what day of the week was it {ahead + ago * 3} days before today?"
    elif kind == 5:  # pigeonhole
        r, b, g = rng.randint(3, 15), rng.randint(3, 15), rng.randint(0, 8)
        extra = f", {g} green socks" if g else ""
        first = (f"A drawer holds {r} red socks{extra} and {b} blue socks, all mixed up. In the dark, how many socks must you "
                 "take out to be sure of having a matching pair? And to be sure of two red ones?")
        follow = "Now the socks are replaced by gloves, which come as left and right. How does the answer change?"
    elif kind == 6:  # syllogism
        x, y, z = rng.sample(TABLES.categories, 3)
        q1 = rng.choice(("All", "Some", "No"))
        first = (f"{q1} {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}? "
                 "Explain with a diagram in words.")
        follow = "What extra premise would make the conclusion certain?"
    elif kind == 7:  # clock angle
        h, mm = rng.randint(1, 12), rng.choice(range(0, 60, 5))
        first = f"What is the smaller angle between the hour hand and the minute hand of a clock at {h}:{mm:02d}?"
        follow = f"At what time between {h}:00 and {h % 12 + 1}:00 do the two hands point in exactly the same direction?"
    else:  # ages or riddle
        if rng.random() < 0.3:
            return rng.choice(TABLES.riddles), _followup(rng, ("Explain why that is the answer.", "Write a new riddle of your own and give its answer."), 0.2)
        a, b = rng.sample(NAMES, 2)
        young, gap = rng.randint(3, 40), rng.randint(2, 30)
        first = f"{a} and {b} have ages that add up to {2 * young + gap}. {a} is {gap} years older than {b}. How old is each of them?"
        follow = f"In how many years will {a} be exactly {rng.choice(('twice', 'one and a half times'))} as old as {b}, if ever?"
    return first, (follow if rng.random() < 0.5 else rng.choice(TABLES.reasoning_followups))


def _math(rng: random.Random, passages: list[str]) -> Pair:
    """Word problems and equations with random numbers; the follow-up often changes one number."""
    kind = rng.randrange(10)
    if kind == 0:
        item, price, disc, tax = rng.choice(TABLES.items), rng.randrange(20, 900, 5), rng.choice((10, 15, 20, 25, 30, 40)), rng.choice((5, 7, 8, 10, 12))
        first = f"A {item} costs ${price}. It is discounted by {disc}% and then {tax}% sales tax is added. What is the final price?"
        follow = f"Now solve it if the price were ${price + rng.randrange(10, 200, 5)}."
    elif kind == 1:
        d, t, d2 = rng.randrange(60, 600, 10), rng.randint(2, 8), rng.randrange(100, 900, 10)
        first = f"A train covers {d} km in {t} hours at a steady speed. How long does it take to cover {d2} km? Give hours and minutes."
        follow = f"What if the train stops for {rng.choice((10, 15, 20, 30))} minutes halfway through the longer journey?"
    elif kind == 2:
        a, b, who = rng.randint(2, 12), rng.randint(3, 15), rng.sample(NAMES, 2)
        first = f"{who[0]} can paint a fence alone in {a} hours, and {who[1]} can paint it alone in {b} hours. How long does it take them working together?"
        follow = f"Now solve it if {who[1]} needed {b + rng.randint(1, 6)} hours alone."
    elif kind == 3:
        w, l = rng.randint(3, 40), rng.randint(3, 40)
        shape = rng.choice((f"a rectangular garden {w} m by {l} m surrounded by a path 1 m wide",
                            f"a circular pond with a radius of {w} m", f"a right triangle with legs of {w} cm and {l} cm"))
        first = f"Find the area and the perimeter of {shape}."
        follow = f"Now solve it if the first measurement were {w + rng.randint(1, 10)} instead."
    elif kind == 4:
        r, g, k = rng.randint(2, 12), rng.randint(2, 12), rng.choice((2, 3))
        first = f"A bag holds {r} red and {g} green marbles. You draw {k} marbles without replacement. What is the probability that all of them are red?"
        follow = "How does the answer change if each marble is put back before the next draw?"
    elif kind == 5:
        a, d, n = rng.randint(-10, 20), rng.randint(2, 9), rng.randint(15, 80)
        if rng.random() < 0.5:
            seq = ", ".join(str(a + i * d) for i in range(4))
            first = f"The sequence {seq}, ... continues in the same way. What is its {n}th term, and what is the sum of the first {n} terms?"
        else:
            a, r = rng.randint(1, 6), rng.choice((2, 3))
            seq = ", ".join(str(a * r ** i) for i in range(4))
            first = f"Find the rule behind {seq}, ... and the {n % 12 + 6}th term."
        follow = "Now find a formula for the general term and prove it by induction."
    elif kind == 6:
        a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(1, 40)
        c = a * x + b
        first = f"Solve for x: {a}x + {b} = {c}. Show each step."
        follow = f"Now solve {a}x + {b} = {c + a * rng.randint(1, 9)} and check your answer by substitution."
    elif kind == 7:
        x, y = rng.randint(-6, 9), rng.randint(-6, 9)
        a, b, d, e = rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7)
        first = f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and {d}x - {e}y = {d * x - e * y}."
        follow = "Solve it again by a different method and show that both methods agree."
    elif kind == 8:
        p, r, t = rng.randrange(500, 20000, 100), rng.choice((2, 3, 4, 5, 6)), rng.randint(2, 15)
        first = f"You invest ${p} at {r}% interest per year, compounded annually. How much will you have after {t} years, and how much of that is interest?"
        follow = f"Now solve it if the rate were {r + 1}% and interest were compounded monthly."
    else:
        r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
        b, c = -(r1 + r2), r1 * r2
        poly = "x^2" + (f" {'+' if b >= 0 else '-'} {abs(b)}x" if b else "") + (f" {'+' if c >= 0 else '-'} {abs(c)}" if c else "")
        first = f"Solve the quadratic equation {poly} = 0 by factoring, and check your roots."
        follow = "Now solve it with the quadratic formula and explain what the discriminant tells you."
    return first, (follow if rng.random() < 0.6 else rng.choice(TABLES.math_followups))


def _snippet(rng: random.Random) -> tuple[str, str]:
    """A short generated code snippet and what to ask about it ('fix' or 'explain')."""
    f, v = rng.choice(("total", "compute", "process", "summarize", "helper")), rng.choice(("items", "values", "nums", "data"))
    k = rng.randint(2, 9)
    snippets = (
        ("fix", f"def {f}({v}):\n    s = 0\n    for i in range(1, len({v})):\n        s += {v}[i]\n    return s"),
        ("fix", f"def {f}({v}):\n    best = 0\n    for x in {v}:\n        if x > best:\n            best = x\n    return best"),
        ("fix", f"def {f}(text):\n    counts = {{}}\n    for w in text.split():\n        counts[w] += 1\n    return counts"),
        ("fix", f"function {f}({v}) {{\n  let out = [];\n  for (let i = 0; i <= {v}.length; i++) {{\n    out.push({v}[i] * {k});\n  }}\n  return out;\n}}"),
        ("fix", f"def remember(x, seen=[]):\n    seen.append(x * {k})\n    return seen\n\nprint(remember(1))\nprint(remember(2))  # expected [{2 * k}]"),
        ("explain", f"result = [x * {k} for x in {v} if x % {k} == 0]"),
        ("explain", f"def {f}(n):\n    return 1 if n <= 1 else n * {f}(n - 1)"),
        ("explain", f"const {f} = {v}.reduce((acc, x) => acc + (x > {k} ? 1 : 0), 0);"),
        ("explain", f"SELECT city, COUNT(*) AS n\nFROM customers\nGROUP BY city\nHAVING COUNT(*) > {k}\nORDER BY n DESC;"),
        ("explain", f"find . -name '*.log' -mtime +{k} -exec gzip {{}} \\;"),
    )
    return rng.choice(snippets)


def _coding(rng: random.Random, passages: list[str]) -> Pair:
    r = rng.random()
    if r < 0.2:
        ask, code = _snippet(rng)
        if ask == "fix":
            first = rng.choice(("This code has a bug. Find it and fix it:", "Why doesn't this work as intended? Please fix it:",
                                "Can you spot the mistake in this snippet and correct it?")) + f"\n\n{code}"
        else:
            first = rng.choice(("Explain what this code does, line by line:", "What does the following snippet do, and when would you use it?")) + f"\n\n{code}"
        return first, rng.choice(("Now add error handling and tests.", "Rewrite it in a more readable way.", "What would change for very large inputs?"))
    if r < 0.3:
        lang, task = "SQL", rng.choice(TABLES.sql_tasks)
        first = rng.choice(("Write an SQL query{d} that {task}. Describe the tables you assume.", "Write a SQL query{d} that {task}.")).format(
            task=task, d=rng.choice(TABLES.sql_dialects)) + rng.choice(TABLES.code_suffixes[:4])
        return first, rng.choice(("Now add an index that would speed it up and explain why.", "Explain the query to someone new to SQL."))
    if r < 0.35:
        first = rng.choice(("Write a Bash script that {task}.", "Write a shell script that {task}, with comments.")).format(
            task=rng.choice(TABLES.bash_tasks)) + rng.choice(TABLES.code_suffixes[:4])
        return first, rng.choice(("Now add error handling and a dry-run option.", "Make it work on macOS as well as Linux."))
    lang = rng.choice(TABLES.languages)
    first = rng.choice(TABLES.coding).format(lang=lang, task=rng.choice(TABLES.coding_tasks))
    first += rng.choice(TABLES.code_suffixes)
    other = rng.choice([x for x in TABLES.languages if x != lang])
    return first, rng.choice(TABLES.coding_followups).format(other=other)


def _cut(rng: random.Random, passage: str, max_words: int = 120) -> str:
    """A random run of whole sentences from `passage`, at most `max_words` words (cut on a word boundary
    when a single sentence is longer)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(passage.split())) if s]
    if not sentences:
        return ""
    start = rng.randrange(len(sentences)) if len(" ".join(sentences).split()) > max_words else 0
    out: list[str] = []
    for s in sentences[start:]:
        if out and len(" ".join(out + [s]).split()) > max_words:
            break
        out.append(s)
    words = " ".join(out).split()
    return " ".join(words[:max_words])


def _extraction(rng: random.Random, passages: list[str]) -> Pair:
    passage = _cut(rng, rng.choice(passages))
    first = rng.choice(TABLES.extraction).format(passage=passage, k=rng.randint(3, 5))
    return first, _followup(rng, TABLES.extraction_followups, 0.3)


GENERATORS: dict[str, Callable[[random.Random, list[str]], Pair]] = {
    "writing": _writing, "roleplay": _roleplay, "stem": _stem, "humanities": _humanities,
    "reasoning": _reasoning, "math": _math, "coding": _coding, "extraction": _extraction,
}


def capacity(passages: list[str]) -> int:
    """A generous upper bound on the distinct first turns the tables can form (numeric families are
    bounded by their parameter ranges, rounded up). Asking for more than this is certainly impossible."""
    n_sent = sum(max(1, len(re.split(r"(?<=[.!?])\s+", p))) for p in passages if p.strip())
    t = TABLES
    return (len(t.writing) * len(TOPICS) * len(t.limits)
            + len(t.role_openers) * len(t.personas) * len(t.role_tasks) * len(TOPICS) * len(t.role_suffixes)
            + len(t.stem) * (len(STEM_TOPICS) * len(t.audiences) + len(t.pairs)) * len(t.stem_suffixes)
            + len(t.humanities) * (len(HUMANITIES_TOPICS) * 4 + len(t.debates)) * len(t.humanities_suffixes)
            + 10 ** 7 + 10 ** 7  # reasoning, math: products of their random ranges, rounded up
            + (len(t.coding) * len(t.languages) * len(t.coding_tasks) + 2 * len(t.sql_dialects) * len(t.sql_tasks)
               + 2 * len(t.bash_tasks)) * len(t.code_suffixes)
            + 10 ** 5  # generated snippets
            + len(t.extraction) * 3 * n_sent)


def synthetic_conversations_with_families(n: int, seed: int, passages: list[str]) -> list[tuple[str, list[dict[str, str]]]]:
    """Like `synthetic_conversations`, with each conversation's family name (one of FAMILIES) beside it."""
    passages = [p for p in passages if p.strip()]
    families = [f for f in FAMILIES if f != "extraction" or passages]
    if n > capacity(passages):
        raise ValueError(f"n={n} exceeds the {capacity(passages)} distinct first turns the prompt tables can form")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, list[dict[str, str]]]] = []
    misses = 0  # consecutive: one exhausted family just hands its share to the others
    while len(out) < n:
        family = rng.choice(families)
        first, follow = GENERATORS[family](rng, passages)
        if first in seen:  # redraw duplicates; a long run of them means the tables are exhausted
            misses += 1
            if misses > 10_000:
                raise ValueError(f"only {len(out)} distinct first turns found for n={n}: the prompt tables are exhausted")
            continue
        seen.add(first)
        misses = 0
        out.append((family, [{"role": "user", "content": first}, {"role": "assistant", "content": "."},
                             {"role": "user", "content": follow}, {"role": "assistant", "content": "."}]))
    return out


def synthetic_conversations(n: int, seed: int, passages: list[str]) -> list[list[dict[str, str]]]:
    """n conversations, each [user, assistant ".", user, assistant "."]: the "." answers are placeholders the
    target model regenerates. Deterministic given `seed`; first user turns are unique within a call.
    Extraction prompts quote a cut of a random entry of `passages`; with no passages that family is skipped.
    Raises ValueError when n exceeds what the tables can give without duplicates."""
    return [conv for _, conv in synthetic_conversations_with_families(n, seed, passages)]


# ========================================================================================= contamination
# Scripts written without spaces between words (Han, kana, Thai, Lao, Myanmar, Khmer): each
# character is a unit, and two of them weigh a word (a Chinese word takes about two characters),
# so 16 of them in a row count as 8 words do.
_UNSPACED = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF), (0x31F0, 0x31FF),
             (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x3134F))
_ASCII_WORD = re.compile("[a-z0-9]+")


def _char_class(chars: list[int]) -> str:
    """A regex character class of these (ascending) code points, as ranges."""
    ranges: list[list[int]] = []
    for c in chars:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return "[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges) + "]"


@functools.cache
def _patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(any unspaced character, a word, a word or an unspaced character with its marks). A word
    is letters and digits of any script with the combining marks inside it (Devanagari vowel
    signs are marks: without them a Hindi word would fall apart into fragments); underscores
    split words as other punctuation does. Marks are those of the Basic Multilingual Plane, and
    are tried only where a word's letters stop: a class of every mark is a list of ranges that
    re checks one by one, which made matching three times slower than [a-z0-9]+."""
    unspaced = "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in _UNSPACED)
    marks = _char_class([c for c in range(0x10000) if unicodedata.category(chr(c)).startswith("M")])
    word = f"[^\\W_{unspaced}]+(?:{marks}+[^\\W_{unspaced}]*)*"
    return re.compile(f"[{unspaced}]"), re.compile(word), re.compile(f"([{unspaced}]{marks}*)|{word}")


def _grams(text: str, n: int) -> list[tuple[str, ...]]:
    """Each shortest run of units weighing n words, one from each unit on. Units are casefolded
    words, apostrophes dropped (weight 2; on ASCII text, the lowercased runs of letters and
    digits), and characters of unspaced scripts (weight 1): n words in a row, 2n such
    characters, or a mix."""
    unspaced, word, unit = _patterns()
    text = text.casefold().replace("'", "").replace("\u2019", "")
    ascii_only = text.isascii()
    if ascii_only or not unspaced.search(text):
        words = (_ASCII_WORD if ascii_only else word).findall(text)  # on ASCII the same words, twice as fast
        return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    found = [(m.group(), 1 if m.group(1) else 2) for m in unit.finditer(text)]
    out, end, weight = [], 0, 0
    for start in range(len(found)):
        while end < len(found) and weight < 2 * n:
            weight, end = weight + found[end][1], end + 1
        if weight < 2 * n:
            break
        out.append(tuple(u for u, _ in found[start:end]))
        weight -= found[start][1]
    return out


def ngram_set(texts: list[str], n: int = 8) -> frozenset[tuple[str, ...]]:
    """Every n-word sequence of `texts` (`_grams`); build it once and pass it to `contaminated` for many prompts."""
    return frozenset(g for t in texts for g in _grams(t, n))


def contaminated(prompt: str, references: list[str] | frozenset[tuple[str, ...]], n: int = 8) -> bool:
    """True if prompt shares any n-word sequence (casefolded, punctuation stripped; 2n characters
    of a script written without spaces) with a reference.

    `references` is either the reference texts or, for many prompts, `ngram_set(texts, n)` built once."""
    grams = references if isinstance(references, frozenset) else ngram_set(references, n)
    return any(g in grams for g in _grams(prompt, n))


# ========================================================================================= command line
def passage_ok(text: str) -> bool:
    """An answer fit to serve as an extraction passage: plain English prose of 60+ words, no code."""
    return len(text.split()) >= 60 and "```" not in text and text.isascii()


def clean_conversations(n: int, seed: int, passages: list[str], references: list[str]) -> list[list[dict[str, str]]]:
    """`synthetic_conversations` without any whose user turns share eight words in a row with a
    reference text (the benchmark's questions), so that the benchmark stays unseen."""
    grams = ngram_set(references)
    made = synthetic_conversations(n, seed, passages)
    return [c for c in made if not any(contaminated(m["content"], grams) for m in c if m["role"] == "user")]
