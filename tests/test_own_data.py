"""A user's own conversations through the whole pipeline on the CI pair: a chat file and a
ShareGPT file each split -> distill (turn by turn, from a real OpenAI-compatible server) ->
train -> merge -> bench, the bench reporting a table per set."""

import json

import pytest

from pipeline.teacher import load_all_answers
from tests.conftest import CI
from tests.fake_openai import FakeOpenAI

SYSTEM = "You are a terse assistant."


def chat_line(i: int) -> dict:
    return {
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": f"Write a function that returns {i}."},
            {"role": "assistant", "content": f"def f(): return {i}"},
            {"role": "user", "content": f"Now make it return {i} + 1."},
        ],
    }


def sharegpt_line(i: int) -> dict:
    return {
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": f"What is {i} squared?"},
            {"from": "gpt", "value": f"{i * i}"},
            {"from": "human", "value": "And cubed?"},
        ]
    }


@pytest.mark.parametrize("shape,line", [("chat", chat_line), ("sharegpt", sharegpt_line)])
def test_a_conversation_file_runs_every_stage(tmp_path, cli, shape, line):
    source = tmp_path / f"mine.{shape}.jsonl"
    source.write_text("".join(json.dumps(line(i)) + "\n" for i in range(12)))
    art = tmp_path / "art"
    with FakeOpenAI() as fake:
        sets = [f"data.source={source}", "data.train_size=8", "data.test_size=4"]
        args = [*CI, "--artifacts", str(art), *(x for s in sets for x in ("--set", s))]
        with_teacher = ["--set", f"teacher.url={fake.url}", "--set", "teacher.model=fake"]
        r = cli("split", *args)
        assert r.returncode == 0 and f"format {shape}" in r.log, r.log
        r = cli("distill", *args, *with_teacher, "--set", "teacher.max_tokens=16")
        assert r.returncode == 0, r.log
    answers = load_all_answers(art / "teacher" / "answers.jsonl")
    assert sorted({t for _, t, _ in answers}) == [0, 1]  # both user turns answered
    assert all(a["messages"][0] == {"role": "system", "content": SYSTEM} for a in answers.values())
    for stage in ("train", "merge"):
        r = cli(stage, *args, "--set", "train.max_steps=2", "--set", "publish.target=none")
        assert r.returncode == 0, r.log
    bench = [f"bench.sets=[heldout,{source}]", "bench.prompts=2", "bench.max_new_tokens=8",
             "bench.fixed_arms=[2]", "bench.warmup_requests=0"]  # fmt: skip
    r = cli("bench", *args, *(x for s in bench for x in ("--set", s)))
    assert r.returncode == 0, r.log
    results = json.loads((art / "bench" / "results.json").read_text())
    assert list(results["sets"]) == ["heldout", str(source)] and results["lossless"] is True
    report = (art / "bench" / "report.md").read_text()
    assert "### heldout (2 prompts" in report and f"### {source} (2 prompts" in report


def test_a_rerun_with_more_data_keeps_every_answer_and_asks_only_for_new_ones(tmp_path, cli):
    """Grow the file, split and distill again: the answers already written stay (none asked
    again, none duplicated), the new conversations are answered, and no conversation that
    trained before is held out now."""
    source = tmp_path / "mine.jsonl"
    art = tmp_path / "art"
    sets = [f"data.source={source}", "data.train_size=0.75", "data.test_size=0.25"]
    args = [*CI, "--artifacts", str(art), *(x for s in sets for x in ("--set", s))]
    with FakeOpenAI() as fake:
        teacher = ["--set", f"teacher.url={fake.url}", "--set", "teacher.model=fake"]
        trained = set()
        for n in (8, 16):
            source.write_text("".join(json.dumps(chat_line(i)) + "\n" for i in range(n)))
            assert cli("split", *args).returncode == 0
            before = len(fake.chat_bodies)
            assert cli("distill", *args, *teacher).returncode == 0
            train = [json.loads(x) for x in (art / "data" / "train.jsonl").read_text().splitlines()]
            test = [json.loads(x) for x in (art / "data" / "test.jsonl").read_text().splitlines()]
            ids = {r["task_id"] for r in train}
            assert not trained & {r["task_id"] for r in test}  # nothing that trained is held out
            asked = len(fake.chat_bodies) - before
            assert asked == 2 * len(ids - trained)  # two user turns per new conversation only
            trained |= ids
    lines = (art / "teacher" / "answers.jsonl").read_text().splitlines()
    keys = [(r["task_id"], r["turn"]) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)) == 2 * len(trained)
