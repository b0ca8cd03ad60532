import json
from importlib import resources

import pytest

from specdec_cli.bench.prompts import Prompt, builtin_suite, load_prompts, select
from specdec_cli.errors import SpecdecError

CATEGORIES = {"multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code"}


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_spec_bench_format(tmp_path):
    path = write_lines(
        tmp_path / "question.jsonl",
        [
            json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}),
            "",
            json.dumps({"question_id": "tr-1", "category": "translation", "turns": ["Say hi in French."]}),
        ],
    )
    assert load_prompts(path) == [
        Prompt("81", "writing", ("Write a poem.", "Shorter.")),
        Prompt("tr-1", "translation", ("Say hi in French.",)),
    ]


def test_prompt_jsonl_format(tmp_path):
    path = write_lines(
        tmp_path / "mine.jsonl",
        [
            json.dumps({"prompt": "Hello there"}),
            json.dumps({"prompt": "Add 2 and 2", "category": "math", "id": "sum"}),
        ],
    )
    assert load_prompts(path) == [
        Prompt("1", "default", ("Hello there",)),
        Prompt("sum", "math", ("Add 2 and 2",)),
    ]


def test_plain_text_format(tmp_path):
    path = write_lines(tmp_path / "prompts.txt", ["First prompt", "", "   ", "  Second prompt  "])
    assert load_prompts(path) == [
        Prompt("1", "default", ("First prompt",)),
        Prompt("4", "default", ("Second prompt",)),
    ]


def test_format_sniffed_without_known_extension(tmp_path):
    jsonl = write_lines(tmp_path / "a.data", ["", json.dumps({"prompt": "x"})])
    text = write_lines(tmp_path / "b.data", ["just text"])
    assert load_prompts(jsonl) == [Prompt("2", "default", ("x",))]
    assert load_prompts(text) == [Prompt("1", "default", ("just text",))]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "unterminated', "malformed JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"text": "no prompt field"}', "missing field 'prompt'"),
        ('{"category": "qa", "turns": ["q"]}', "missing field 'question_id'"),
        ('{"question_id": 1, "turns": ["q"]}', "missing field 'category'"),
        ('{"question_id": 1, "category": "qa", "turns": "q"}', "non-empty list"),
        ('{"question_id": 1, "category": "qa", "turns": []}', "non-empty list"),
        ('{"question_id": 1, "category": "qa", "turns": ["ok", 3]}', "must be a string, got int"),
        ('{"prompt": 5}', "must be a string"),
        ('{"prompt": "   "}', "empty prompt text"),
        ('{"prompt": "x", "id": [1]}', "id must be"),
        ('{"prompt": "x", "category": ""}', "category must be"),
        ('{"prompt": "again", "id": "1"}', "duplicate prompt id '1'"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "first", "id": "1"}', "", bad_line])
    with pytest.raises(SpecdecError) as info:
        load_prompts(path)
    text = str(info.value)
    assert text.startswith(f"{path}:3: ")
    assert message in text
    assert "\n" not in text
    assert info.value.exit_code == 2


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(SpecdecError, match="prompt file .* not found") as info:
        load_prompts(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name, content", [("e.jsonl", "\n  \n"), ("e.txt", ""), ("e.other", "\n")])
def test_file_without_prompts(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecdecError, match="no prompts found"):
        load_prompts(path)


def test_builtin_suite_has_all_categories():
    suite = builtin_suite()
    assert len(suite) == 28
    assert {p.category for p in suite} == CATEGORIES
    for category in CATEGORIES:
        assert sum(p.category == category for p in suite) == 4
    assert all(len(p.turns) == 2 for p in suite if p.category == "multi_turn")
    assert all(len(p.turns) == 1 for p in suite if p.category != "multi_turn")
    assert [p.id for p in suite if p.category == "translation"] == ["tr-1", "tr-2", "tr-3", "tr-4"]


def test_select_by_category_and_limit():
    suite = builtin_suite()
    assert [p.id for p in select(suite, "qa", None)] == ["qa-1", "qa-2", "qa-3", "qa-4"]
    assert [p.id for p in select(suite, "code", 2)] == ["code-1", "code-2"]
    one_each = select(suite, None, 1)
    assert len(one_each) == 7
    assert {p.category for p in one_each} == CATEGORIES
    assert all(p.id.endswith("-1") for p in one_each)
    assert select(suite, None, None) == suite


def test_select_errors():
    suite = builtin_suite()
    with pytest.raises(SpecdecError, match="unknown category 'poetry'; known: code, math_reasoning"):
        select(suite, "poetry", None)
    with pytest.raises(SpecdecError, match="at least 1"):
        select(suite, None, 0)


def test_training_prompts_disjoint_from_benchmark():
    data = resources.files("specdec_cli.bench") / "data" / "training_prompts.txt"
    training = [line.strip().casefold() for line in data.read_text(encoding="utf-8").splitlines()]
    training = [t for t in training if t]
    benchmark = [turn.strip().casefold() for p in builtin_suite() for turn in p.turns]
    assert len(training) >= 50
    assert len(set(training)) == len(training)
    for t in training:
        for b in benchmark:
            assert t not in b and b not in t, (t, b)


# SPEED-Bench's columns (its qualitative config): what specdec reads and what it leaves alone
SPEED_BENCH_ROWS = [
    {
        "question_id": "coding-3",
        "category": "coding",
        "sub_category": "debugging",
        "turns": ["Why does this loop never end?", "Fix it without a flag."],
        "source": "synthetic",
        "difficulty": "medium",
        "multiturn": True,
    },
    {
        "question_id": "qa-1",
        "category": "qa",
        "sub_category": "facts",
        "turns": ["What is a KV cache?"],
        "source": "synthetic",
        "difficulty": "easy",
        "multiturn": False,
    },
]


def write_parquet(path, rows):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def test_speed_bench_parquet_rows(tmp_path):
    path = write_parquet(tmp_path / "qualitative.parquet", SPEED_BENCH_ROWS)
    assert load_prompts(path) == [
        Prompt("coding-3", "coding", ("Why does this loop never end?", "Fix it without a flag.")),
        Prompt("qa-1", "qa", ("What is a KV cache?",)),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"turns": []}, "row 2: 'turns' must be a non-empty list of strings"),
        ({"question_id": "coding-3"}, "row 2: duplicate prompt id 'coding-3'"),
        ({"category": ""}, "row 2: category must be a non-empty string"),
    ],
)
def test_parquet_errors_name_file_and_row(tmp_path, change, message):
    rows = [SPEED_BENCH_ROWS[0], {**SPEED_BENCH_ROWS[1], **change}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(SpecdecError, match=message):
        load_prompts(path)


def test_a_file_that_is_not_parquet_is_one_clear_error(tmp_path):
    path = write_lines(tmp_path / "prompts.parquet", ["not parquet at all"])
    with pytest.raises(SpecdecError, match=r"prompts.parquet: not a readable Parquet file"):
        load_prompts(path)
