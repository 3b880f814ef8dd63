"""`--layers spread:K`: K aux ids spread evenly over the target's depth, as the peers' DFlash
heads read it (SpecForge's Qwen3-8B recipe: outputs of layers 1, 9, 17, 25, 33 of 36, ids
2, 10, 18, 26, 34 in eyas's convention); known in count before the target is, resolved to ids
once it is, and captured like any other ids."""

from __future__ import annotations

import pytest
import torch

from eyas.errors import EyasError
from eyas.models.layers import resolve_layer_ids
from eyas.options import aux_layer_count
from test_capture import ATOL, RTOL, _samples, reference_states


def test_spread_ids_for_the_peers_recipe_and_small_targets():
    assert resolve_layer_ids("spread:5", 36) == (2, 10, 18, 26, 34, 36)
    assert resolve_layer_ids("spread:3", 30) == (2, 15, 28, 30)
    assert resolve_layer_ids("spread:1", 30) == (15, 30)
    assert resolve_layer_ids("spread:5", 8) == (2, 3, 4, 5, 6, 8)  # every id from 2 to N-2


@pytest.mark.parametrize("layers", [8, 30, 36, 61, 126])
def test_every_spread_is_distinct_sorted_and_within_2_to_n_minus_2(layers):
    for count in range(1, layers - 2):
        aux = resolve_layer_ids(f"spread:{count}", layers)[:-1]
        assert len(aux) == count and list(aux) == sorted(set(aux)), count
        assert 2 <= aux[0] and aux[-1] <= layers - 2
        if count > 1:
            assert aux[0] == 2 and aux[-1] == layers - 2
            gaps = [b - a for a, b in zip(aux, aux[1:])]
            assert max(gaps) - min(gaps) <= 1  # even, up to rounding


@pytest.mark.parametrize("spec, message", [
    ("spread:0", r"a 30-layer model has 27 ids from 2 to N-2 to spread over; ask for 1 to that many"),
    ("spread:28", r"ask for 1 to that many"),
    ("spread:five", r"write spread:K with K a whole number"),
    ("spread:", r"write spread:K with K a whole number"),
    ("spread:-2", r"write spread:K with K a whole number"),
])
def test_a_spread_that_cannot_be_met_is_refused_in_one_line(spec, message):
    with pytest.raises(EyasError, match=message):
        resolve_layer_ids(spec, 30)


def test_the_count_of_states_is_known_before_the_target():
    assert aux_layer_count("auto") == 3
    assert aux_layer_count("spread:5") == 5
    assert aux_layer_count("2,10,18,26") == 4
    assert aux_layer_count("spread:x") is None


def test_a_spread_is_captured_as_the_target_computes_it(tiny_llama_dir):
    from eyas.capture.hf import HFCapturer

    capturer = HFCapturer(str(tiny_llama_dir), layers="spread:4")
    n = capturer.num_layers
    assert capturer.layer_ids == resolve_layer_ids("spread:4", n) and len(capturer.layer_ids) == 5
    samples = _samples([17, 6], capturer.identity.vocab_size)
    for sample, got in zip(samples, capturer.capture(samples)):
        want = reference_states(capturer.model, sample.input_ids, capturer.layer_ids)
        assert got.shape[1] == 5
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
