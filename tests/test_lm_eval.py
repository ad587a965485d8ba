"""Downstream tasks: ``concept.scoring`` against a per-request teacher-forced reference, the lm-eval backend
through lm-eval's own evaluator and CLI on local tasks, the shipped offline tasks, and ``concept eval --tasks``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from concept_cli.main import cli

import concept
from concept import ComponentRef
from concept.dense import DenseModel
from concept.errors import ConceptError, ConfigError
from concept.scoring import Scorer
from concept.tokens import ByteTokenizer
from tests.conftest import mix_decisions, randomize_new_modules, tiny_config

lm_eval = pytest.importorskip("lm_eval")
from concept.recipes import harness
from concept.tasks import build as task_build

ROOT = Path(__file__).resolve().parent.parent
BYTES = {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 260}  # a tiny backbone that reads bytes
REQUESTS = [("def f(x):", " return x"), ("hello", " world!"), ("", "abc"), ("a  ", "b"),
            ("The quick brown fox", " jumps over"), ("x = [1, 2,", " 3]")]


@pytest.fixture(scope="module")
def streaming():
    cfg = tiny_config()
    cfg.backbone = ComponentRef("tiny-llama", BYTES)
    return mix_decisions(randomize_new_modules(concept.build(cfg))).eval()


def reference(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """One unpadded forward of this request alone: the sum of log p(continuation token k | everything before)."""
    scorer = Scorer(model, tokenizer)
    c, x = scorer.pair(context, continuation)
    with torch.no_grad():
        logp = model(torch.tensor([c + x])).logits[0].float().log_softmax(-1)
    rows = logp[len(c) - 1: len(c) + len(x) - 1]
    target = torch.tensor(x)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


# -- scoring ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["streaming", "dense", "pruned"])
def test_loglikelihood_is_each_requests_teacher_forced_sum_in_any_batch(streaming, kind):
    model = {"streaming": streaming, "dense": DenseModel(streaming.backbone).eval(),
             "pruned": DenseModel(streaming.backbone, removed=(2, 4)).eval()}[kind]
    tok = ByteTokenizer(260)
    expect = [reference(model, tok, c, x) for c, x in REQUESTS]
    for batch in (1, 4, 8):  # right padding and the longest-first order change nothing
        got = Scorer(model, tok, batch_size=batch).loglikelihood(REQUESTS)
        assert [g[1] for g in got] == [e[1] for e in expect]
        torch.testing.assert_close(torch.tensor([g[0] for g in got]), torch.tensor([e[0] for e in expect]),
                                   rtol=1e-5, atol=1e-4)
    # negative control: reading the logits one position late is told apart
    c, x = Scorer(model, tok).pair(*REQUESTS[4])
    with torch.no_grad():
        logp = model(torch.tensor([c + x])).logits[0].log_softmax(-1)
    late = float(logp[len(c): len(c) + len(x)].gather(1, torch.tensor(x)[:, None]).sum())
    assert abs(late - expect[4][0]) > 1e-2


def test_greedy_flag_is_true_exactly_for_the_greedy_continuation(streaming):
    tok = ByteTokenizer(260)
    scorer = Scorer(streaming, tok, batch_size=2)
    context = scorer.encode("import os")
    ids = list(context)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(streaming(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(context):]
    wrong = greedy[:-1] + [(greedy[-1] + 1) % 256]
    got = scorer.loglikelihood_tokens([(context, greedy), (context, wrong)])
    assert got[0][1] is True and got[1][1] is False and got[0][0] > got[1][0]


def test_rolling_loglikelihood_sums_its_windows(streaming):
    tok = ByteTokenizer(260)
    text = "def add(a, b):\n    return a + b\n" * 2
    tokens = tok.encode(text)
    whole = Scorer(streaming, tok, max_length=128).loglikelihood_rolling([text])[0]
    with torch.no_grad():  # one window: everything after end-of-text (id 0 for bytes)
        logp = streaming(torch.tensor([[0] + tokens])).logits[0].log_softmax(-1)
    one = float(logp[:-1].gather(1, torch.tensor(tokens)[:, None]).sum())
    assert whole == pytest.approx(one, abs=1e-3)
    small = Scorer(streaming, tok, max_length=9)  # windows of 8 tokens, each read after the token before it
    expect = 0.0
    for start in range(0, len(tokens), 8):
        prev = [tokens[start - 1]] if start else [0]
        with torch.no_grad():
            lp = streaming(torch.tensor([prev + tokens[start:start + 8]])).logits[0].log_softmax(-1)
        expect += float(lp[:-1].gather(1, torch.tensor(tokens[start:start + 8])[:, None]).sum())
    assert small.loglikelihood_rolling([text, "x"])[0] == pytest.approx(expect, abs=1e-3)
    assert expect != pytest.approx(one, abs=1e-2)  # the windows lose context: the test sees the window size


def test_generate_until_is_the_library_decoding_cut_at_the_stop(streaming):
    tok = ByteTokenizer(260)
    scorer = Scorer(streaming, tok, batch_size=2)
    prompts = ["def f(", "class A"]
    free = concept.generation.generate(streaming, [tok.encode(p) for p in prompts], max_new_tokens=12, tokenizer=tok)
    stop = free.texts[0][3:5]  # a stop string the first text contains
    got = scorer.generate_until([(prompts[0], {"until": [stop], "max_gen_toks": 12}),
                                 (prompts[1], {"until": [], "max_gen_toks": 12, "temperature": 0})])
    assert got[0] == free.texts[0][:free.texts[0].index(stop)] and got[1] == free.texts[1]
    with pytest.raises(ConceptError, match="not supported"):
        scorer.generate_until([("x", {"max_gen_toks": 2, "num_beams": 4})])


def test_planner_scores_the_continuation_given_a_plan_of_the_context():
    from tests.test_planner_executor import built

    model = built()
    tok = ByteTokenizer(256)
    scorer = Scorer(model, tok, batch_size=3)
    requests = [("some context here", " and then"), ("short", " continuation text"), ("x" * 20, " y")]
    got = scorer.loglikelihood(requests)
    for (c, x), (logp, _) in zip(requests, got):
        u, y = scorer.pair(c, x)
        with torch.no_grad():  # the model's own forward on a `continue` row: plan from u, score y given the plan
            model.task, model.context_len = "continue", len(u)
            try:
                out = model(torch.tensor([u + y]))
            finally:
                model.task, model.context_len = "reconstruct", None
        expect = float(out.logits[0].log_softmax(-1).gather(1, torch.tensor(y)[:, None]).sum())
        assert logp == pytest.approx(expect, abs=1e-4)
    # the context matters only through the plan: scoring through the dense path would differ
    flat = Scorer(DenseModel(model.backbone).eval(), tok).loglikelihood(requests[:1])[0][0]
    assert flat != pytest.approx(got[0][0], abs=1e-2)


def test_scorer_refuses_bad_settings(streaming):
    with pytest.raises(ConfigError, match="batch_size"):
        Scorer(streaming, ByteTokenizer(260), batch_size=0)
    with pytest.raises(ConfigError, match="max_length"):
        Scorer(streaming, ByteTokenizer(260), max_length=1)
    with pytest.raises(ConceptError, match="continuation is empty"):
        Scorer(streaming, ByteTokenizer(260)).loglikelihood([("abc", "")])


# -- lm-eval: the backend, local tasks, the shipped tasks ------------------------------------------------
def runner(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval") / "tiny"
    result = runner("build", "--backbone", "tiny-llama", "--split", "2,4,2", "--length-policy", "null", "-o", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """A task of the user's own: a YAML with a local JSON file (the `datasets` json loader, no hub)."""
    folder = tmp_path_factory.mktemp("tasks")
    rows = [{"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}"], "label": 0}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (6, 3)]]
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums.yaml").write_text(
        "task: local_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'sums.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n")
    return folder, rows


def test_lm_eval_evaluates_a_run_by_name_on_a_local_task(tiny_run, local_task):
    folder, rows = local_task
    out = lm_eval.simple_evaluate(model="concept", model_args=f"run={tiny_run},batch_size=4", tasks=["local_sums"],
                                  task_manager=harness.task_manager([folder], defaults=False), log_samples=False,
                                  bootstrap_iters=0)
    scorer = Scorer.from_run(tiny_run)  # the same accuracy computed by hand
    hits = []
    for r in rows:
        scores = [lp for lp, _ in scorer.loglikelihood([(r["question"], c) for c in r["choices"]])]
        hits.append(max(range(len(scores)), key=scores.__getitem__) == r["label"])
    assert out["results"]["local_sums"]["acc,none"] == pytest.approx(sum(hits) / len(hits))


def test_the_shipped_tasks_load_with_their_cards():
    manager = harness.task_manager(defaults=False)
    assert {"concept_cloze", "concept_code_continuation", "concept_docstring_name", "concept_offline"} <= set(
        manager.all_tasks)
    cards = json.loads((harness.TASKS / "data" / "cards.json").read_text())
    tasks = manager.load(["concept_offline"])["tasks"]
    assert sorted(tasks) == sorted(cards["tasks"])
    for name, card in cards["tasks"].items():
        docs = list(tasks[name].test_docs())
        assert len(docs) == card["items"] >= 150
        if "choices" in docs[0]:
            assert all(len(d["choices"]) == 4 and d["choices"][d["label"]] not in d["choices"][:d["label"]]
                       for d in docs)


def test_task_data_is_built_deterministically_and_matches_the_shipped_files():
    a, b = task_build.build(), task_build.build()
    assert {k: task_build.encode(v) for k, v in a.items()} == {k: task_build.encode(v) for k, v in b.items()}
    fresh, shipped = task_build.cards(a), json.loads((harness.TASKS / "data" / "cards.json").read_text())
    if fresh["python"] != shipped["python"]:
        pytest.skip(f"the shipped data was built from Python {shipped['python']}'s standard library, this is "
                    f"{fresh['python']}")
    assert fresh == shipped
    for items in a.values():  # no cloze answer or real continuation leaks into its own context
        for item in items:
            answer = item["target"] if "target" in item else item["choices"][item["label"]]
            assert answer.strip() and not item["context"].endswith(answer)


# -- the command line ------------------------------------------------------------------------------------
def test_concept_eval_tasks_side_by_side_json_and_table(tiny_run, local_task, tmp_path):
    folder, _ = local_task
    dense = tmp_path / "dense"
    assert runner("train", tiny_run, "--data", "stdlib", "--steps", "1", "--seq-len", "32", "--batch", "2",
                  "--baseline", "dense", "--out", dense).exit_code == 0
    before = sorted(p.name for p in tiny_run.iterdir())
    result = runner("eval", tiny_run, dense, "--tasks", "local_sums,concept_docstring_name,concept_cloze",
                    "--include-path", folder, "--limit", "3", "--json")  # (cloze: a bootstrapped stderr, which
    # lm-eval announces on stdout: stdout must stay pure JSON)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data[str(tiny_run)]["model"] == "streaming" and data[str(dense)]["model"] == "dense"
    for run in data.values():
        assert run["tasks"]["local_sums"]["samples"] == 3 and run["tasks"]["concept_docstring_name"]["samples"] == 3
        acc = run["tasks"]["concept_docstring_name"]["acc"]
        assert 0 <= acc["value"] <= 1 and acc["stderr"] is not None
        assert run["tasks"]["concept_cloze"]["perplexity"]["value"] > 1
    table = runner("eval", tiny_run, "--tasks", "local_sums", "--include-path", folder, "--limit", "2")
    assert table.exit_code == 0 and "local_sums" in table.stdout and "±" in table.stdout
    assert sorted(p.name for p in tiny_run.iterdir()) == before  # evaluation writes nothing


def test_tasks_list_puts_the_shipped_tasks_first(local_task):
    folder, _ = local_task
    result = runner("eval", "--tasks", "list", "--include-path", folder)
    assert result.exit_code == 0
    names = result.stdout.split()
    assert names[:4] == ["concept_cloze", "concept_code_continuation", "concept_docstring_name", "concept_offline"]
    assert names[4] == "local_sums" and "hellaswag" in names and "lambada_openai" in names


def test_bad_task_input_is_named_and_writes_nothing(tiny_run, tmp_path):
    before = sorted(p.name for p in tiny_run.iterdir())
    r = runner("eval", tiny_run, "--tasks", "concept_clozee")
    assert r.exit_code == 2 and "concept_clozee: no such task; did you mean concept_cloze" in r.output
    not_run = tmp_path / "empty"
    not_run.mkdir()
    r = runner("eval", not_run, "--tasks", "concept_cloze")
    assert r.exit_code == 2 and "is not a concept run folder" in r.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "gone.yaml").write_text(
        f"task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'missing.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: a\ndoc_to_target: b\n")
    r = runner("eval", tiny_run, "--tasks", "gone", "--include-path", broken)
    assert r.exit_code == 2 and "a task's data could not be loaded" in r.output and "missing.jsonl" in r.output
    for bad in ("0", "-1"):
        r = runner("eval", tiny_run, "--tasks", "concept_cloze", "--limit", bad)
        assert r.exit_code == 2 and "--limit" in r.output
    r = runner("eval", tiny_run, "--tasks", "concept_cloze", "--include-path", tmp_path / "nowhere")
    assert r.exit_code == 2 and "no such folder" in r.output
    r = runner("eval", tiny_run, "--limit", "3")
    assert r.exit_code == 2 and "go with --tasks" in r.output
    assert sorted(p.name for p in tiny_run.iterdir()) == before


def test_lm_evals_own_command_line_evaluates_a_run(tiny_run, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "concept_cli", "lm-eval", "run", "--model", "concept", "--model_args",
                           f"run={tiny_run},batch_size=4", "--tasks", "concept_cloze", "--limit", "3",
                           "--output_path", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "concept_cloze" in proc.stdout and "acc" in proc.stdout
    written = list(out.rglob("results_*.json"))
    assert written and json.loads(written[0].read_text())["results"]["concept_cloze"]["acc,none"] >= 0
