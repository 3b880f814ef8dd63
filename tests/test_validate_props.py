"""Property tests (issue 27) of the option rules (eyas.validate) and of output confinement
(eyas.paths.check_confined), over values and folder layouts hypothesis generates."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from eyas.errors import EyasError  # noqa: E402
from eyas.paths import check_confined  # noqa: E402
from eyas.validate import Number  # noqa: E402

bounds = st.one_of(st.none(), st.integers(-5, 5).map(float))
values = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.none(), st.text(max_size=3), st.sampled_from([float("nan"), float("inf"), -float("inf"), 0, 1]))
rules = st.builds(Number, lo=bounds, hi=bounds, lo_open=st.booleans(), hi_open=st.booleans(), integer=st.booleans(),
                  required=st.booleans())


@given(rules, values)
@settings(max_examples=400, deadline=None)
def test_a_rule_accepts_exactly_the_finite_numbers_in_its_range(rule, value):
    accepted = rule.accepts(value)
    if value is None:
        assert accepted == (not rule.required)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        assert not accepted  # nan, inf, text and booleans are never a number option's value
        return
    inside = (rule.lo is None or (value > rule.lo if rule.lo_open else value >= rule.lo)) and \
             (rule.hi is None or (value < rule.hi if rule.hi_open else value <= rule.hi))
    assert accepted == (inside and (not rule.integer or value == int(value)))


@given(rules, values, st.from_regex(r"--[a-z]{1,8}(-[a-z]{1,8})?", fullmatch=True))
@settings(max_examples=200, deadline=None)
def test_a_refusal_is_one_line_naming_the_option_and_its_range(rule, value, option):
    if rule.accepts(value):
        rule.check(option, value)  # no error
        return
    with pytest.raises(EyasError) as e:
        rule.check(option, value)
    message = str(e.value)
    assert message.startswith(f"{option} must be {rule.describe()} (got ") and "\n" not in message.replace(repr(value), "")


names = st.lists(st.sampled_from(["a", "b", "c"]), min_size=0, max_size=3)


@given(names, names, st.booleans())
@settings(max_examples=150, deadline=None)
def test_an_output_is_refused_exactly_when_it_is_holds_or_lies_inside_an_input(out_parts, in_parts, through_link):
    """Folders a/b/c...: the input exists, the output may not; the output may be reached through
    a symbolic link to its real place, which is resolved before comparing. One path holding the
    other, either way round, is refused."""
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        source = root.joinpath("x", *in_parts)
        source.mkdir(parents=True, exist_ok=True)
        real_out = root.joinpath("x", *out_parts)
        out = real_out
        if through_link:
            os.symlink(root / "x", root / "link")
            out = root.joinpath("link", *out_parts)
        shorter = min(len(out_parts), len(in_parts))
        should_refuse = in_parts[:shorter] == out_parts[:shorter]
        try:
            check_confined(out, {"--data": source})
            refused = False
        except EyasError as e:
            refused = True
            assert "--data" in str(e) and "\n" not in str(e)
        assert refused == should_refuse
