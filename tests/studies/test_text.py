"""Sizes keep the allocator's rules visible: nothing under 2 MiB is rounded to look like 2 MiB."""

import pytest

from graphborrow.studies.text import prose, share_text, size_text, sizes_text


def test_sizes_under_two_mib_print_in_kib_or_bytes():
    assert size_text(2 * 2**20 - 512) == "2047.5 KiB"      # one 512-byte block short of a small-pool segment
    assert size_text(2 * 2**20) == "2.00 MiB"
    assert size_text(2**20) == "1.00 MiB" and size_text(2**20 - 512) == "1023.5 KiB"
    assert size_text(512) == "512 B" and size_text(0) == "0 B"
    assert size_text(108 * 2**20) == "108.00 MiB" and size_text(140 * 2**30) == "140.00 GiB"
    assert sizes_text([3 * 2**20, 1000], limit=1) == "3.00 MiB … and 1 more"
    assert share_text(1, 4) == "25 %"
    with pytest.raises(ValueError, match="never negative"):
        size_text(-1)


def test_prose_prints_outside_ipython(capsys):
    assert prose("""
        two **words**
    """) is None
    assert capsys.readouterr().out == "two **words**\n"
