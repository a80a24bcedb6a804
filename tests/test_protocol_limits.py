"""The protocol's parsers on hostile model output: every parser linear in its input and never raising, huge numbers
and deep JSON as call errors, a flood of calls bounded."""

import time

import pytest

from paravt_agent.protocol import (
    MAX_CALLS,
    CallError,
    extract_answer,
    extract_choice,
    is_degenerate,
    parse_span,
    parse_time,
    parse_tool_calls,
    split_think,
    strip_tool_blocks,
    tag_stats,
)

SHAPES = {
    "fence_spaces": lambda n: "<tool_call>```" + " " * n,
    "answer_spaces": lambda n: "<answer>answer" + " " * n + "z</answer>",
    "digits": lambda n: "9" * n,
    "spaced_digits": lambda n: "1 " + " " * n + "- 2",
    "empty_calls": lambda n: "<tool_call></tool_call>" * (n // 23),
    "open_braces": lambda n: "<tool_call>" + "{" * n,
    "open_brackets": lambda n: '<tool_call>{"name": "crop_video", "arguments": ' + "[" * n,
    "nested_json": lambda n: '<tool_call>{"name": "crop_video", "arguments": ' + '{"a": ' * (n // 6) + "1",
    "python_parens": lambda n: "<tool_call>crop_video(" + "(" * n,
    "think_tags": lambda n: "<think>" * (n // 7),
    "unclosed_calls": lambda n: "<tool_call>" * (n // 11),
    "im_start": lambda n: "<|im_start|>" * (n // 12),
    "answer_is": lambda n: "answer is " * (n // 10),
    "colons": lambda n: "1:" * (n // 2),
    "brackets_span": lambda n: "[" + "1, " * (n // 3),
    "words": lambda n: "a " * (n // 2),
}


PARSERS = {
    "parse_tool_calls": parse_tool_calls,
    "extract_answer": extract_answer,
    "extract_choice": lambda t: extract_choice(t, ["a dog", "a cat", "a bird", "z"]),
    "parse_span": parse_span,
    "tag_stats": tag_stats,
    "is_degenerate": is_degenerate,
    "split_think": split_think,
    "strip_tool_blocks": strip_tool_blocks,
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_parser_is_linear_and_never_raises(shape):
    """Every parser over 1k, 10k and 100k characters of each adversarial shape: it returns (no exception on
    model output) within a generous bound, and 10x the input never costs 30x the time
    (each size timed three times, the fastest kept)."""
    for name, parse in PARSERS.items():
        times = []
        for n in (1_000, 10_000, 100_000):
            text = SHAPES[shape](n)
            best = float("inf")
            for _ in range(3):  # the fastest of three: a pause of the (shared, noisy) CI machine is not growth
                t0 = time.perf_counter()
                parse(text)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        assert times[2] < 2.0, f"{name} on {shape}: {times}"
        assert times[2] < 30 * times[1] + 0.05, f"{name} on {shape} grows faster than linear: {times}"


def test_huge_numbers_and_deep_json_are_call_errors():
    for text in (
        '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": ' + "9" * 401 + "}}</tool_call>",
        '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": ' + "9" * 5001 + "}}</tool_call>",
        '<tool_call>{"name": "crop_video", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>",
        "<tool_call>crop_video(1, " + "9" * 5001 + ")</tool_call>",
        "<tool_call>crop_video(" + "(" * 1000 + ")</tool_call>",
    ):
        calls = parse_tool_calls(text)
        assert calls and all(isinstance(c, CallError) or c.ok for c in calls)
    with pytest.raises(ValueError):
        parse_time(10**401)
    with pytest.raises(ValueError):
        parse_time("9" * 500)
    assert parse_time("01:02:03") == 3723.0 and parse_time(" 80.5 s ") == 80.5


def test_a_flood_of_calls_is_bounded():
    calls = parse_tool_calls("<tool_call></tool_call>" * 217_391)
    assert len(calls) == MAX_CALLS + 1 and "not parsed" in calls[-1].message
    many = '<tool_call>[' + ", ".join(['{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 2}}'] *
                                       80_000) + "]</tool_call>"
    [err] = parse_tool_calls(many)  # one block too long to parse: one error slot, never 80,000 calls
    assert isinstance(err, CallError) and "too long" in err.message and len(err.raw) <= 200
    array = "<tool_call>[" + ", ".join(['{"name": "zoom_frame", "arguments": {"time": 1}}'] * 100) + "]</tool_call>"
    calls = parse_tool_calls(array)
    assert len(calls) == MAX_CALLS + 1 and all(c.ok for c in calls[:-1]) and "36 more" in calls[-1].message
