"""Table-driven tests of the text protocol on real-looking model outputs."""

import pytest

from paravt_agent.protocol import (
    CallError,
    ToolCall,
    extract_answer,
    extract_choice,
    format_time,
    is_degenerate,
    parse_span,
    parse_time,
    parse_tool_calls,
    render_tool_call,
    split_think,
    tag_stats,
)
from tools import ToolRegistry

SIGNATURES = ToolRegistry.default().signatures()
E = "ERROR"  # a call slot that must be a CallError

# (response, expected calls as (name, arguments) or E, expected extract_answer)
CASES = [
    # --- the paper's Appendix D examples
    (
        '<think>The question asks about... I should examine\nthe segment from 01:20 to 02:30 more closely.</think>\n'
        '<tool_call>crop_video("video.mp4", 80, 150)</tool_call>\n'
        '<tool_call>crop_video("video.mp4", 200, 280)</tool_call>',
        [("crop_video", {"video_path": "video.mp4", "start_time": 80, "end_time": 150}),
         ("crop_video", {"video_path": "video.mp4", "start_time": 200, "end_time": 280})],
        None,
    ),
    (
        "<think>Looking at the video, I can see...\nthe man walks to the door\n"
        '<tool_code>python\n# Reverts to a non-native tool prior from pretraining\n'
        'crop_video("video.mp4", start=80, end=150)\n</tool_code>',
        [("crop_video", {"video_path": "video.mp4", "start": 80, "end": 150})],
        "the man walks to the door",
    ),
    (
        "<think>The question requires temporal localization.\nWith only 8 overview frames, I need to crop specific\n"
        "segments for detail.</think>\n"
        '<tool_call>crop_video("video.mp4", 75, 155)</tool_call>\n'
        '<tool_call>crop_video("video.mp4", 195, 285)</tool_call>',
        [("crop_video", {"video_path": "video.mp4", "start_time": 75, "end_time": 155}),
         ("crop_video", {"video_path": "video.mp4", "start_time": 195, "end_time": 285})],
        None,
    ),
    ("<think>Evidence gathered.</think>\n<answer>The person picks up the cup at 01:45.</answer>", [],
     "The person picks up the cup at 01:45."),
    # --- Qwen / Hermes JSON
    ('<think>need two windows</think>\n<tool_call>\n'
     '{"name": "crop_video", "arguments": {"video_path": "v.mp4", "start_time": 10, "end_time": 20}}\n</tool_call>',
     [("crop_video", {"video_path": "v.mp4", "start_time": 10, "end_time": 20})], None),
    ('<tool_call>{"name": "crop_video", "arguments": "{\\"start_time\\": 3.5, \\"end_time\\": 9}"}</tool_call>',
     [("crop_video", {"start_time": 3.5, "end_time": 9})], None),
    ('<tool_call>{"name": "crop_video", "arguments": {"start_time": "01:20", "end_time": "02:30"}}</tool_call>',
     [("crop_video", {"start_time": "01:20", "end_time": "02:30"})], None),
    ('<tool_call>{"name":"crop_video","arguments":{"start_time":"1:02:03","end_time":"1:02:33"}}</tool_call>',
     [("crop_video", {"start_time": "1:02:03", "end_time": "1:02:33"})], None),
    ('<tool_call>{"name": "crop_video", "parameters": {"start_time": 1, "end_time": 2}}</tool_call>',
     [("crop_video", {"start_time": 1, "end_time": 2})], None),
    ('<tool_call>{"type": "function", "function": {"name": "crop_video", '
     '"arguments": {"start_time": 4, "end_time": 8}}}</tool_call>',
     [("crop_video", {"start_time": 4, "end_time": 8})], None),
    ('<tool_call>```json\n{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 30}}\n```</tool_call>',
     [("crop_video", {"start_time": 0, "end_time": 30})], None),
    ('<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 30}}\n'
     '{"name": "crop_video", "arguments": {"start_time": 60, "end_time": 90}}</tool_call>',
     [("crop_video", {"start_time": 0, "end_time": 30}), ("crop_video", {"start_time": 60, "end_time": 90})], None),
    ('<tool_call>[{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 5}}, '
     '{"name": "crop_video", "arguments": {"start_time": 9, "end_time": 12}}]</tool_call>',
     [("crop_video", {"start_time": 0, "end_time": 5}), ("crop_video", {"start_time": 9, "end_time": 12})], None),
    ("<tool_call>{'name': 'crop_video', 'arguments': {'start_time': 5, 'end_time': 7}}</tool_call>",
     [("crop_video", {"start_time": 5, "end_time": 7})], None),
    # --- flat {"tool_name": ...}
    ('<tool_call>{"tool_name": "crop_video", "start_time": 12, "end_time": 30}</tool_call>',
     [("crop_video", {"start_time": 12, "end_time": 30})], None),
    ('<tool_code>{"tool_name": "crop_video", "video_path": "a.mp4", "start_time": "00:05", "end_time": "00:15"}'
     '</tool_code>',
     [("crop_video", {"video_path": "a.mp4", "start_time": "00:05", "end_time": "00:15"})], None),
    # --- python style
    ("<tool_call>crop_video(80, 150)</tool_call>", [("crop_video", {"start_time": 80, "end_time": 150})], None),
    ('<tool_call>crop_video("01:20", "02:30")</tool_call>',
     [("crop_video", {"start_time": "01:20", "end_time": "02:30"})], None),
    ("<tool_call>crop_video(start_time=10, end_time=25)</tool_call>",
     [("crop_video", {"start_time": 10, "end_time": 25})], None),
    ('<tool_code>print(crop_video("v.mp4", 30, 45))</tool_code>',
     [("crop_video", {"video_path": "v.mp4", "start_time": 30, "end_time": 45})], None),
    ('<tool_code>\n```python\ncrop_video(video_path="v.mp4", start_time=1.5, end_time=4)\n```\n</tool_code>',
     [("crop_video", {"video_path": "v.mp4", "start_time": 1.5, "end_time": 4})], None),
    ("<tool_code>crop_video(10, 20)\ncrop_video(40, 50)</tool_code>",
     [("crop_video", {"start_time": 10, "end_time": 20}), ("crop_video", {"start_time": 40, "end_time": 50})], None),
    ("<tool_call>tools.crop_video(start=3, end=9)</tool_call>", [("crop_video", {"start": 3, "end": 9})], None),
    ("<tool_call>zoom_frame(12.5, 0.1, 0.2, 0.5, 0.6)</tool_call>",
     [("zoom_frame", {"time": 12.5, "x1": 0.1, "y1": 0.2, "x2": 0.5, "y2": 0.6})], None),
    # --- unclosed final block
    ('<think>check the start</think>\n'
     '<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 10}}',
     [("crop_video", {"start_time": 0, "end_time": 10})], None),
    ('<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 10}}</tool_call>\n'
     '<tool_call>crop_video(20, 30)',
     [("crop_video", {"start_time": 0, "end_time": 10}), ("crop_video", {"start_time": 20, "end_time": 30})], None),
    # --- errors never hide good calls
    ('<tool_call>{"name": "crop_video", "arguments": {"start_time": 0, "end_time": 10}</tool_call>\n'
     '<tool_call>crop_video(20, 30)</tool_call>',
     [E, ("crop_video", {"start_time": 20, "end_time": 30})], None),
    ("<tool_call></tool_call><tool_call>crop_video(1, 2)</tool_call>",
     [E, ("crop_video", {"start_time": 1, "end_time": 2})], None),
    ('<tool_call>{"arguments": {"start_time": 1, "end_time": 2}}</tool_call>', [E], None),
    ('<tool_call>{"name": "crop_video", "arguments": "{start_time: 1"}</tool_call>', [E], None),
    ('<tool_call>{"name": "crop_video", "arguments": [1, 2]}</tool_call>', [E], None),
    ("<tool_call>I will crop the video from 10 to 20</tool_call>", [E], None),
    ("<tool_call>crop_video(a, b)</tool_call>", [E], None),
    ("<tool_call>42</tool_call>", [E], None),
    ('<tool_call>"crop_video"</tool_call>', [E], None),
    ("<tool_call>crop_video(1, 2, 3, 4)</tool_call>", [E], None),
    ('<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 2}}}}</tool_call>',
     [("crop_video", {"start_time": 1, "end_time": 2}), E], None),
    # --- answers and the three-level fallback
    ("<think>The third segment is blue.</think>\n<answer>B</answer>", [], "B"),
    ("<think>x</think><answer>\n(C) a red ball\n</answer>", [], "(C) a red ball"),
    ("<think>Reasoning here.</think>\nThe answer is A.", [], "The answer is A."),
    ('<think>Reasoning here.</think>\n<tool_call>crop_video(1, 5)</tool_call>\nSo it is D.',
     [("crop_video", {"start_time": 1, "end_time": 5})], "So it is D."),
    ("I think the cup is red.\nFinal: red", [], "Final: red"),
    ("<think>no closing tag, rambling on\nand on\nanswer maybe B", [], "answer maybe B"),
    ("<think>a</think><answer>first</answer> then <answer>second</answer>", [], "second"),
    ("<think>looking</think><answer>12.5 - 20 seconds", [], "12.5 - 20 seconds"),
    ("<think>The event spans</think>\n<answer>[12.0, 18.5]</answer>", [], "[12.0, 18.5]"),
    ("", [], ""),
    ("\n\n  \n", [], ""),
    ("<think>\n</think>\n\n<answer></answer>\nfallback line", [], "fallback line"),
    ("<tool_response>\nWindow 1: red\n</tool_response>\n<think>so red</think>", [], "so red"),
    ("<think>count</think>\n<answer>3</answer><|im_end|>", [], "3"),
    ("<think>Segment 00:40-00:48 shows yellow.</think>\n<answer>yellow</answer>", [], "yellow"),
    ('<think>Let me check both halves.</think>\n<tool_call>\n'
     '{"name": "crop_video", "arguments": {"video_path": "/data/v/ep1.mp4", "start_time": 0, "end_time": 600}}\n'
     '</tool_call>\n<tool_call>\n'
     '{"name": "crop_video", "arguments": {"video_path": "/data/v/ep1.mp4", "start_time": 600, "end_time": 1200}}\n'
     '</tool_call>',
     [("crop_video", {"video_path": "/data/v/ep1.mp4", "start_time": 0, "end_time": 600}),
      ("crop_video", {"video_path": "/data/v/ep1.mp4", "start_time": 600, "end_time": 1200})], None),
    ("<think>I need subtitles.</think><tool_call>get_subtitles(start_time=0, end_time=60)</tool_call>",
     [("get_subtitles", {"start_time": 0, "end_time": 60})], None),
]


def _expected_calls(got, want):
    assert len(got) == len(want), [str(g) for g in got]
    for g, w in zip(got, want, strict=True):
        if w == E:
            assert isinstance(g, CallError) and not g.ok and g.message
        else:
            assert isinstance(g, ToolCall) and g.ok, g
            assert (g.name, g.arguments) == w


@pytest.mark.parametrize("text,calls,answer", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_outputs(text, calls, answer):
    _expected_calls(parse_tool_calls(text, signatures=SIGNATURES), calls)
    if answer is not None:
        assert extract_answer(text) == answer


def test_call_metadata():
    calls = parse_tool_calls('<tool_code>crop_video(1, 2)</tool_code><tool_call>{"name": "x", "arguments": {}}')
    assert calls[0].tag == "tool_code" and calls[0].style == "python" and calls[0].closed
    assert calls[1].tag == "tool_call" and calls[1].style == "json" and not calls[1].closed


def test_custom_signatures():
    calls = parse_tool_calls("<tool_call>ocr(3.0, 'eng')</tool_call>", signatures={"ocr": ["time", "lang"]})
    assert calls[0].arguments == {"time": 3.0, "lang": "eng"}


def test_render_roundtrip():
    text = render_tool_call("crop_video", {"start_time": 1, "end_time": 2})
    assert parse_tool_calls(text)[0].arguments == {"start_time": 1, "end_time": 2}


@pytest.mark.parametrize(
    "value,seconds",
    [(80, 80.0), (12.5, 12.5), ("80", 80.0), ("80.5s", 80.5), (" 7 seconds", 7.0), ("01:20", 80.0),
     ("1:02:03", 3723.0), ("00:00:05.5", 5.5), ("2:05", 125.0)],
)
def test_parse_time(value, seconds):
    assert parse_time(value) == seconds


@pytest.mark.parametrize("bad", ["abc", "", "1:2:3:4", None, True, float("nan"), [1]])
def test_parse_time_rejects(bad):
    with pytest.raises(ValueError):
        parse_time(bad)


def test_format_time():
    assert format_time(80) == "01:20" and format_time(3723) == "1:02:03" and format_time(0.4) == "00:00"


@pytest.mark.parametrize(
    "text,letter",
    [("B", "B"), ("(C)", "C"), ("D.", "D"), ("A) a red car", "A"), ("Answer: E", "E"), ("The answer is (B).", "B"),
     ("the final answer is C", "C"), ("I choose option D", "D"), ("**A**", "A"), ("J: the last one", "J"),
     ("(B) the man opens the door", "B"), ("a cat", None), ("I am not sure", None), ("", None)],
)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_an_english_article_is_not_a_choice():
    opts = ["a dog", "a cat", "a bird"]
    assert extract_choice("The answer is a cat", opts) == "B"  # the option's text, not the article
    assert extract_choice("I think it is a bird.", opts) == "C"
    assert extract_choice("answer: b", opts) == "B" and extract_choice("The answer is (a).", opts) == "A"
    assert extract_choice("It is a mystery", ["x", "y"]) is None


def test_labelled_options_one_letter_table():
    from paravt_agent.protocol import LETTERS, labelled_options, option_body

    assert labelled_options(["red", "B. blue", "(C) green"]) == ["A. red", "B. blue", "(C) green"]
    assert option_body("B. a cat") == "a cat" and LETTERS[:4] == "ABCD"
    with pytest.raises(ValueError):
        labelled_options([str(i) for i in range(11)])


def test_extract_choice_with_options():
    opts = ["A. red", "B. green", "C. blue"]
    assert extract_choice("blue", opts) == "C"
    assert extract_choice("It is green.", opts) == "B"
    assert extract_choice("E", opts) is None  # only A-C exist


@pytest.mark.parametrize(
    "text,span",
    [("[12.5, 20]", (12.5, 20.0)), ("12 - 18", (12.0, 18.0)), ("from 3 to 9 seconds", (3.0, 9.0)),
     ("The event happens from 00:40 to 01:10.", (40.0, 70.0)), ("between 5s and 11s", (5.0, 11.0)),
     ("(4.0, 6.5)", (4.0, 6.5)), ("10 to 14", (10.0, 14.0)), ("30s-45s", (30.0, 45.0)),
     ("[20, 10]", None), ("no span here", None), ("", None), ("at 12 seconds", None)],
)
def test_parse_span(text, span):
    assert parse_span(text) == span


def test_tag_stats():
    st = tag_stats("<think>a</think><tool_call>x</tool_call><tool_call>y<answer>z</answer>")
    assert st["think"].balanced and st["think"].first_closed
    assert st["tool_call"].opened == 2 and st["tool_call"].closed == 1 and not st["tool_call"].balanced
    assert st["answer"].balanced and not st["tool_code"].present
    unclosed = tag_stats("<think>\nrambling")["think"]
    assert unclosed.opened == 1 and not unclosed.first_closed and not unclosed.balanced
    stray = tag_stats("</think><think>a</think>")["think"]
    assert not stray.balanced and stray.first_closed


def test_split_think():
    assert split_think("<think>\nplan</think>\nrest") == ("plan", "\nrest")
    assert split_think("<think>open") == ("open", "")
    assert split_think("no think") == ("", "no think")


def test_degenerate():
    loop = "<|im_start|>assistant\n" * 5
    assert is_degenerate(loop)
    assert not is_degenerate("<|im_start|>" * 4)
    spread = ("<|im_start|>" + "x" * 100) * 5
    assert not is_degenerate(spread)
    assert is_degenerate("normal text " * 50 + "<|im_start|>" * 6)


def test_split_options_trailing_or_anywhere():
    from paravt_agent.protocol import split_options

    assert split_options("Which?\nA. red\nB) blue") == ("Which?", ["red", "blue"])
    assert split_options("Which?\nOptions:\n(A) red\n(B) blue") == ("Which?", ["red", "blue"])
    prompt = "Select the best answer.\nWhich?\nA. red\nB. blue\nC. green\nAnswer with the option's letter."
    assert split_options(prompt) == (prompt, None)  # the API's rule: trailing lines only
    assert split_options(prompt, anywhere=True) == (
        "Select the best answer.\nWhich?\nAnswer with the option's letter.", ["red", "blue", "green"])
    assert split_options("Is A. the first?\nA. only one")[1] is None  # one option is no MCQ
    assert split_options("Which?\nA. red\nC. blue", anywhere=True)[1] is None  # letters out of order
