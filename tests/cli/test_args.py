"""The command line's argument types (dtp/cli/args.py): what each accepts and the exact refusal."""

from __future__ import annotations

import argparse

import pytest

from dtp.cli.args import bounded, memory_size, positive_int, seed_int, tp_list
from dtp.runtime.job import DTYPES


def test_apply_offers_exactly_the_dtypes_a_rank_can_run():
    from dtp.verify.rank import DTYPES as RANK_DTYPES  # torch's dtypes, imported by the rank only

    assert DTYPES == tuple(RANK_DTYPES)


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (positive_int, "0", "expected a positive integer, got 0"),
        (positive_int, "two", "expected a positive integer, got 'two'"),
        (bounded(4096), "4097", "expected an integer in [1, 4096], got 4097"),
        (bounded(4096), "x", "expected a positive integer, got 'x'"),
        (seed_int, "-1", "seed must be between 0 and 9223372036854710272, got -1"),
        (tp_list, "2,2", "expected two or more distinct positive tp sizes, got '2,2'"),
        (
            memory_size,
            "1.5XB",
            "expected a positive size like 3000000, 512KiB or 1.5GiB, got '1.5XB'",
        ),
    ],
)
def test_refusals_say_what_was_expected(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert str(info.value) == message


def test_accepted_values():
    assert (positive_int("3"), bounded(8)("8"), seed_int("0"), tp_list("1,2,4")) == (
        3,
        8,
        0,
        [1, 2, 4],
    )
    assert memory_size("1.5MiB") == 1572864 and memory_size("2GB") == 2 * 10**9
