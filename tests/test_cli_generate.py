"""`concept generate` as a user runs it (tiny backbone, byte tokenizer)."""
import json

import pytest

from tests.test_cli_train import FAST, TINY, run
from tests.test_training import corpus  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    root = tmp_path_factory.mktemp("gen")
    built, trained, dense = root / "m", root / "m-train", root / "m-dense"
    assert run("build", *TINY, "-o", built).exit_code == 0
    for extra, out in (([], trained), (["--baseline"], dense)):
        r = run("train", built, *extra, "--data", corpus, "--steps", 2, *FAST, "--out", out)
        assert r.exit_code == 0, r.output
    return built, trained, dense


def test_generate_streams_text_and_reports_kv(runs):
    _, trained, _ = runs
    r = run("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 12)
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith("\n") and "never trained" not in r.stderr
    assert "KV" in r.stderr and "new tokens/s" in r.stderr
    again = run("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 12, "--json")
    assert r.stdout[:-1] == json.loads(again.stdout)["text"]  # the streamed text is the final text


def test_generate_json_lines_from_a_prompt_file(runs, tmp_path):
    _, trained, _ = runs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\nclass A:\n")
    r = run("generate", trained, "--prompt-file", prompts, "--max-new-tokens", 10, "--json", "--batch-size", 1)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["import os", "class A:"]
    for row in rows:
        assert row["new_tokens"] == len(row["tokens"]) == 10 and row["finish_reason"] == "length"
        total = row["prompt_tokens"] + row["new_tokens"]
        assert all(0 <= t < total - 1 for t in row["concept_positions"])
        kv = row["kv"]
        assert kv["tokens"] == total - 1 and kv["concepts"] == len(row["concept_positions"])
        assert kv["bytes"] > 0 and kv["dense_bytes"] > 0
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('"import os"\n{"prompt": "class A:"}\n')
    r2 = run("generate", trained, "--prompt-file", jsonl, "--max-new-tokens", 10, "--json")
    assert [json.loads(line)["text"] for line in r2.stdout.splitlines()] == [row["text"] for row in rows]


def test_sampling_is_reproducible_and_stop_strings_cut(runs):
    _, trained, _ = runs
    args = ("generate", trained, "-p", "x = ", "--max-new-tokens", 16, "--json")
    a = json.loads(run(*args, "--temperature", 1.2, "--top-p", 0.9, "--seed", 3).stdout)
    b = json.loads(run(*args, "--temperature", 1.2, "--top-p", 0.9, "--seed", 3).stdout)
    assert a["tokens"] == b["tokens"]
    greedy = json.loads(run(*args).stdout)
    text = greedy["text"]
    stop = next(c for c in text[3:] if c.isprintable() and c != "\ufffd")
    cut = json.loads(run(*args, "--stop", stop).stdout)
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    streamed = run("generate", trained, "-p", "x = ", "--max-new-tokens", 16, "--stop", stop)
    assert streamed.stdout == cut["text"] + "\n"


def test_show_concepts_dense_baseline_and_untrained_warning(runs):
    built, trained, dense = runs
    r = run("generate", trained, "-p", "hello", "--max-new-tokens", 6, "--show-concepts")
    assert r.exit_code == 0 and "token emitted a concept" in r.stdout
    r = run("generate", dense, "-p", "hello", "--max-new-tokens", 6, "--json")
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)
    assert row["concept_positions"] is None and row["kv"]["bytes"] == row["kv"]["dense_bytes"]
    r = run("generate", built, "-p", "hello", "--max-new-tokens", 4)
    assert r.exit_code == 0 and "never trained" in r.stderr


@pytest.mark.parametrize("args, message", [
    ((), "give a prompt"),
    (("-p", ""), "prompt 1 is empty"),
    (("-p", "a", "--max-new-tokens", 0), "max_new_tokens: must be >= 1"),
    (("-p", "a", "--temperature", 0, "--top-k", 5), "--temperature 0 means greedy"),
    (("-p", "a", "--top-p", 1.5), "top_p: must be in (0, 1]"),
    (("-p", "a", "--temperature", -1), "--temperature: must be >= 0"),
    (("-p", "a", "--batch", 0), "--batch: must be >= 1"),
    (("--prompt-file", "/nonexistent/prompts.txt"), "no such file"),
    (("-p", "a" * 5000), "context limit is 4096"),
])
def test_generate_bad_input(runs, args, message):
    _, trained, _ = runs
    r = run("generate", trained, *args)
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output


def test_stop_string_escapes():
    from concept_cli.generate_cmd import unescape

    assert unescape(r"\n\ndef") == "\n\ndef" and unescape(r"a\tb") == "a\tb" and unescape(r"\\n") == "\\n"
    assert unescape("é→") == "é→"


def test_generate_bad_prompt_file_and_run_folder(runs, tmp_path):
    _, trained, _ = runs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    r = run("generate", trained, "--prompt-file", bad)
    assert r.exit_code == 1 and "line 2: not JSON" in r.stderr
    r = run("generate", tmp_path, "-p", "a")
    assert r.exit_code != 0 and "Traceback" not in r.output


def test_generate_on_a_device_this_machine_lacks(runs):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, trained, _ = runs
    r = run("generate", trained, "-p", "a", "--device", "cuda")
    assert r.exit_code == 1 and "no CUDA device is available" in r.stderr and "Traceback" not in r.output


def test_generate_mtp_verify_equals_greedy_and_refuses_runs_without_heads(runs, corpus, tmp_path):  # noqa: F811
    _, trained, _ = runs
    r = run("generate", trained, "-p", "def f(x):", "--max-new-tokens", 6, "--mtp", "verify")
    assert r.exit_code != 0 and "no MTP heads" in r.stderr and "--length-policy mtp" in r.stderr
    built, mtp_run = tmp_path / "mtp", tmp_path / "mtp-train"
    assert run("build", *TINY, "--length-policy", "mtp", "--set", "length_policy.heads=3", "-o", built).exit_code == 0
    t = run("train", built, "--data", corpus, "--steps", 2, *FAST, "--out", mtp_run)
    assert t.exit_code == 0, t.output
    args = ("generate", mtp_run, "-p", "def f(x):", "--max-new-tokens", 12, "--json")
    greedy = json.loads(run(*args).stdout)
    verify = run(*args, "--mtp", "verify")
    assert verify.exit_code == 0, verify.output
    row = json.loads(verify.stdout)
    assert row["tokens"] == greedy["tokens"] and 1 <= row["forwards"] <= 12
    lossy = json.loads(run(*args, "--mtp", "confadapt", "--mtp-tau", "1e-6").stdout)
    assert lossy["new_tokens"] == 12 and lossy["forwards"] < 12  # every draft "confident": several per forward
