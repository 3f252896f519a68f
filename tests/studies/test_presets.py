"""Presets: the shapes a notebook runs at, the reader's values over them, and the automatic
layout-only choice, which follows what a capture really costs and never changes the dtype."""

import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.studies import presets


def test_teaching_preset_computes_with_real_bytes_and_h200_goes_layout_only():
    teaching = presets.resolve("teaching", "sim")
    h200 = presets.resolve("h200", "sim")
    assert not teaching.layout_only and teaching.notes == []
    assert h200.layout_only and "LAYOUT_ONLY chosen automatically" in h200.notes[0]
    assert (h200.hidden, h200.intermediate, h200.vocab, h200.prefill_tokens) == (4096, 14336, 128256, 8192)
    assert h200.ladder == [64, 32, 16, 8, 4, 2, 1] and h200.draft_tokens == 8 and h200.batch_size == 32


def test_switching_layout_only_never_changes_the_dtype():
    for preset in ("teaching", "h200"):
        dtypes = {presets.resolve(preset, "sim", layout_only=choice).dtype for choice in (True, False, None)}
        assert dtypes == {presets.PRESETS[preset]["DTYPE"]}


def test_the_readers_values_win_and_none_takes_the_presets():
    setup = presets.resolve("h200", "sim", hidden=256, intermediate=512, vocab=None, prefill_tokens=512)
    assert (setup.hidden, setup.intermediate, setup.vocab, setup.prefill_tokens) == (256, 512, 128256, 512)


def test_the_automatic_choice_follows_the_cost_of_a_capture():
    small = presets.PRESETS["teaching"]
    assert not presets.too_large_for_cpu(small)
    assert presets.too_large_for_cpu({**small, "PREFILL_TOKENS": 16384, "INTERMEDIATE": 16384}), "work, not bytes"
    assert presets.too_large_for_cpu({**small, "VOCAB": 262144, "LADDER": [256], "DRAFT_TOKENS": 64}), "bytes"
    assert presets.capture_flops({**small, "LAYERS": 4}) > presets.capture_flops(small)


def test_the_batch_follows_a_smaller_ladder_unless_the_reader_set_it():
    assert presets.resolve("teaching", "sim", ladder=[4]).batch_size == 4
    with pytest.raises(ParameterError, match="BATCH_SIZE=8 needs a captured graph that large.*raise LADDER"):
        presets.resolve("teaching", "sim", ladder=[4], batch_size=8)
    assert presets.resolve("teaching", "sim", ladder=[8, 4]).batch_size == 8


def test_bad_presets_and_names_are_named():
    with pytest.raises(ParameterError, match="PRESET='a100' is not a preset"):
        presets.resolve("a100", "sim")
    with pytest.raises(ParameterError, match="not shape parameters"):
        presets.resolve("teaching", "sim", width=3)
    with pytest.raises(ParameterError, match="a GPU always has bytes"):
        presets.resolve("teaching", "cuda", layout_only=True)
    assert not presets.resolve("h200", "cuda").layout_only
