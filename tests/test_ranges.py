"""kvdbg.util.ranges: one grammar for integer sets and lists, for CLI options and capture variables."""

from __future__ import annotations

import time
import tracemalloc

import click
import pytest
from click.testing import CliRunner

from kvdbg.errors import OptionError
from kvdbg.util.ranges import (
    MAX_VALUE,
    IntListParam,
    IntRanges,
    IntRangesParam,
    RangeError,
    parse_int_list,
    parse_ranges,
)
from tests.helpers import run_python


@pytest.mark.parametrize("text, members, shown", [
    ("3", [3], "3"),
    ("1,4", [1, 4], "1,4"),
    ("2-5", [2, 3, 4, 5], "2-5"),
    (" 0 , 4,10 - 12 ,\t7 ", [0, 4, 7, 10, 11, 12], "0,4,7,10-12"),
    ("5-5", [5], "5"),
    ("3-6,1-4,8,7", [1, 2, 3, 4, 5, 6, 7, 8], "1-8"),  # overlapping and adjacent ranges merge
    ("100-", list(range(100, 151)), "100-"),
    ("4,100-,2-3,200-", [2, 3, 4, *range(100, 151)], "2-4,100-"),
])
def test_grammar(text, members, shown):
    ranges = parse_ranges(text, "--x")
    assert [v for v in range(0, 151) if v in ranges] == members
    assert str(ranges) == shown
    assert parse_ranges(shown, "--x") == ranges  # the printed form reads back as the same set


def test_membership_is_exact_at_every_edge():
    ranges = parse_ranges("0,4,10-20,100-", "KVDBG_CAPTURE_STEPS")
    assert [v for v in (0, 1, 3, 4, 5, 9, 10, 20, 21, 99, 100, 10**6, 10**30) if v in ranges] == \
        [0, 4, 10, 20, 100, 10**6, 10**30]
    assert -1 not in ranges and None not in ranges and "4" not in ranges and True not in ranges
    assert 5 not in IntRanges(())


def test_whether_a_span_meets_the_set_is_one_search_exact_at_every_edge():
    """meets(lo, hi) is whether any member lies from lo to hi: the plugin's hooks let an armed engine's step go
    for all its layers at once with it."""
    ranges = parse_ranges("0,4,10-20,100-", "KVDBG_CAPTURE_STEPS")
    for lo in range(0, 130):
        for hi in range(lo, lo + 12):
            assert ranges.meets(lo, hi) == any(v in ranges for v in range(lo, hi + 1)), (lo, hi)
    assert ranges.meets(10**30, 10**30 + 5) and not ranges.meets(5, 4)  # open-ended; an empty span
    assert not IntRanges(()).meets(0, 10**18)


@pytest.mark.parametrize("text, says", [
    ("", "is empty; give numbers or ranges like 3, 1,4 or 2-5 or 100-"),
    ("  ", "is empty"),
    ("ten", "'ten' is not a number or a range like 3, 1,4 or 2-5"),
    ("1,,2", "'1,,2' has an empty item between commas"),
    ("1,", "'1,' has an empty item between commas"),
    ("-4", "'-4' is negative; numbers here start at 0"),
    ("5-3", "range '5-3' ends before it starts"),
    ("1-2-3", "'1-2-3' is not a number"),
    ("0x10", "'0x10' is not a number"),
    ("1.5", "'1.5' is not a number"),
    ("+3", "'+3' is not a number"),
    ("٣", "'٣' is not a number"),  # a digit, but not an ASCII one
    ("1 2", "'1 2' is not a number"),
    (str(2**63), f"is over the largest number allowed here, {MAX_VALUE}"),
    ("0-" + "9" * 5000, f"is over the largest number allowed here, {MAX_VALUE}"),
])
def test_bad_text_is_one_line_naming_the_option(text, says):
    with pytest.raises(RangeError) as info:
        parse_ranges(text, "--request")
    message = str(info.value)
    assert message.startswith("--request: ") and says in message, message
    assert "\n" not in message and len(message) < 160, message
    assert isinstance(info.value, OptionError)  # the CLI's one-line, exit-2 path


def test_open_ended_only_where_the_caller_allows_it():
    assert 10**9 in parse_ranges("3-", "--x")
    with pytest.raises(RangeError, match="'3-' is open-ended; give its end too, e.g. 3-13"):
        parse_ranges("3-", "--x", open_ended=False)
    with pytest.raises(RangeError, match="over the largest number allowed here, 7"):
        parse_ranges("2-8", "--x", max_value=7)


def test_huge_ranges_stay_lazy():
    tracemalloc.start()
    started = time.perf_counter()
    ranges = parse_ranges(f"0-{MAX_VALUE},5-{10**18}", "--x")
    assert MAX_VALUE in ranges and ranges.last == MAX_VALUE
    assert ranges.out_of(8) == MAX_VALUE
    assert ranges.below(5) == [0, 1, 2, 3, 4]  # bounded by what the caller knows, not by the text
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000 and time.perf_counter() - started < 1.0


def test_many_items_parse_in_linear_time():
    text = ",".join(str(i * 3) for i in range(50_000))
    started = time.perf_counter()
    ranges = parse_ranges(text, "--x")
    assert 149_997 in ranges and 149_998 not in ranges
    assert time.perf_counter() - started < 5.0


def test_bounds_for_callers():
    ranges = parse_ranges("2-3,7", "--heads")
    assert (ranges.first, ranges.last, ranges.open_ended) == (2, 7, False)
    assert ranges.out_of(8) is None and ranges.out_of(7) == 7
    assert ranges.below(8) == [2, 3, 7] and ranges.below(3) == [2]
    open_ = parse_ranges("1,5-", "--request")
    assert (open_.first, open_.last, open_.open_ended) == (1, None, True)
    assert open_.out_of(6) is None and open_.out_of(5) == 5 and open_.below(7) == [1, 5, 6]
    empty = IntRanges(())
    assert empty.empty and empty.first is None and empty.out_of(0) is None and empty.below(5) == []


def test_python_values():
    assert IntRanges.of(None, "steps") is None
    assert str(IntRanges.of(4, "steps")) == "4"
    assert str(IntRanges.of(range(3, 7), "steps")) == "3-6"
    assert IntRanges.of(range(3, 3), "steps").empty
    assert str(IntRanges.of([5, 1, 2, 3], "steps")) == "1-3,5"
    assert str(IntRanges.of(range(0, 10, 3), "steps")) == "0,3,6,9"
    assert str(IntRanges.of("8-", "steps")) == "8-"
    with pytest.raises(RangeError, match="steps: -2 is negative"):
        IntRanges.of([-2], "steps")
    with pytest.raises(RangeError, match="ranks: expected numbers, got True"):
        IntRanges.of(True, "ranks")


def test_lists_keep_order_and_repeats():
    assert parse_int_list(" 9, 77 ,9,200", "--seq-lens") == (9, 77, 9, 200)
    with pytest.raises(RangeError, match="--seq-lens: '2-5' is a range; list single numbers here"):
        parse_int_list("1,2-5", "--seq-lens")
    with pytest.raises(RangeError, match="--seq-lens: '10-' is open-ended"):
        parse_int_list("10-", "--seq-lens")
    with pytest.raises(RangeError, match="--seq-lens: 'x' is not a number"):
        parse_int_list("10,x", "--seq-lens")


def _command():
    @click.command()
    @click.option("--request", type=IntRangesParam(), default=None)
    @click.option("--step", type=IntRangesParam(open_ended=False), default=None)
    @click.option("--seq-lens", type=IntListParam(), default="9,77")
    def command(request, step, seq_lens):
        click.echo(f"{request}|{step}|{list(seq_lens)}")

    return command


def test_click_types():
    runner = CliRunner()
    res = runner.invoke(_command(), ["--request", "0-3, 7", "--step", "2"])
    assert res.exit_code == 0 and res.output == "0-3,7|2|[9, 77]\n"
    res = runner.invoke(_command(), ["--request", "3-1"])
    assert res.exit_code == 2
    assert "Error: Invalid value for '--request': range '3-1' ends before it starts" in res.output
    res = runner.invoke(_command(), ["--step", "1-"])
    assert res.exit_code == 2 and "Invalid value for '--step': '1-' is open-ended" in res.output
    res = runner.invoke(_command(), ["--seq-lens", "4,y"])
    assert res.exit_code == 2 and "Invalid value for '--seq-lens': 'y' is not a number" in res.output


def test_importing_the_grammar_needs_no_torch():
    assert run_python("import sys, kvdbg.util.ranges; print('torch' in sys.modules)").strip() == "False"
