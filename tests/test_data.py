"""The data pipeline: reading sources, deterministic splits, packing, batches, bad input."""
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from concept.data import (DEFAULT_CORPUS, ByteTokenizer, Document, PackedSequences, read_documents,
                          tokenizer_for)
from concept.errors import ConceptError
from concept.tokens import tokenize_documents

STDLIB_DIR = Path(warnings.__file__).parent


class EosBytes(ByteTokenizer):
    """Bytes plus an end-of-document id, like a real tokenizer."""

    eos_token_id = 256


class CountingTokenizer:
    """A Hugging Face-like tokenizer (not bytes, so it is cached) that counts its batch calls."""

    name_or_path = "counting"
    eos_token_id = 0

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 300

    def __call__(self, texts, **kwargs):
        self.calls += 1
        return {"input_ids": [[b + 1 for b in t.encode()] for t in texts]}


def docs(*texts):
    return [Document(f"d{i:02d}.txt", t) for i, t in enumerate(texts)]


def many_docs(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [Document(f"doc{i:03d}.txt", f"<{i}>" + "x" * int(rng.integers(1, 60))) for i in range(n)]


# -- reading ---------------------------------------------------------------------------------
def test_folder_with_text_and_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee\n")
    (tmp_path / "sub" / "a.md").write_text("ay")
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n{"text": ""}\n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("secret")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "blob.dat").write_bytes(b"abc\0def")
    got = read_documents(tmp_path)
    assert [(d.name, d.text) for d in got] == [
        ("b.txt", "bee\n"), ("c.jsonl:1", "one"), ("c.jsonl:3", "two"), ("sub/a.md", "ay")]
    # a file on its own: one document, or one per JSONL line (BOM dropped)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
    assert read_documents(tmp_path / "bom.txt") == [Document("bom.txt", "hello")]
    assert [d.name for d in read_documents(str(tmp_path / "c.jsonl"))] == ["c.jsonl:1", "c.jsonl:3"]
    (tmp_path / "f.jsonl").write_text('{"body": "x"}\n')
    assert read_documents(tmp_path / "f.jsonl", text_field="body") == [Document("f.jsonl:1", "x")]


def test_jsonl_lines_sort_numerically_and_keep_unicode_separators(tmp_path):
    lines = [json.dumps({"text": f"t{i}\u2028end"}, ensure_ascii=False) for i in range(12)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = read_documents(tmp_path / "d.jsonl")
    assert [d.name for d in got] == [f"d.jsonl:{i}" for i in range(1, 13)]
    assert got[0].text == "t0\u2028end"


def test_split_is_deterministic_disjoint_and_order_free(tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(400)))
    train = read_documents(tmp_path, "train", heldout_fraction=0.1)
    held = read_documents(tmp_path, "heldout", heldout_fraction=0.1)
    everything = read_documents(tmp_path, "all")
    assert {d.name for d in train}.isdisjoint(d.name for d in held)
    assert sorted(train + held, key=lambda d: int(d.name.split(":")[1])) == everything
    assert 20 <= len(held) <= 60
    assert read_documents(tmp_path, "heldout", heldout_fraction=0.1) == held
    # the split depends on names only: a different folder listing gives the same membership
    (tmp_path / "data.jsonl").rename(tmp_path / "tmp")
    (tmp_path / "more").mkdir()
    (tmp_path / "tmp").rename(tmp_path / "data.jsonl")
    (tmp_path / "more" / "z.txt").write_text("another document")
    held2 = {d.name for d in read_documents(tmp_path, "heldout", heldout_fraction=0.1)} - {"more/z.txt"}
    assert held2 == {d.name for d in held}


def test_single_document_is_train_and_heldout_error(tmp_path):
    f = tmp_path / "only.txt"
    f.write_text("just one document")
    assert read_documents(f, "train") == [Document("only.txt", "just one document")]
    with pytest.raises(ConceptError, match=r"held-out split .* is empty.*separate --data"):
        read_documents(f, "heldout")
    # every document hashing to held-out still leaves them all for training
    assert len(read_documents(f, "train", heldout_fraction=0.999999)) == 1


def test_stdlib_corpus_splits():
    train = read_documents(None, "train")
    held = read_documents(DEFAULT_CORPUS, "heldout")
    assert train and held
    names = {d.name for d in train}
    assert names.isdisjoint(d.name for d in held)
    assert "json/decoder.py" in names | {d.name for d in held}
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for d in train + held for part in d.name.split("/")[:-1])
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.09
    assert [d.name for d in read_documents(None, "heldout")] == [d.name for d in held]
    assert not any(d.name.startswith("pydoc_data/") for d in train + held)  # prose: the `pydoc` corpus


def test_pydoc_prose_corpus_and_aliases(tmp_path, monkeypatch):
    import pydoc_data.topics

    train, held = read_documents("pydoc", "train"), read_documents("pydoc", "heldout")
    assert train and held and {d.name for d in train}.isdisjoint(d.name for d in held)
    assert len(train) + len(held) == sum(1 for v in pydoc_data.topics.topics.values() if v.strip())
    assert all(d.name.startswith("pydoc_data/topics:") for d in train + held)
    assert [d.name for d in train] == sorted(d.name for d in train)
    assert read_documents("prose", "heldout") == held  # aliases
    assert [d.name for d in read_documents("code", "heldout")] == [d.name for d in read_documents(None, "heldout")]
    topics = {d.name.split(":", 1)[1]: d.text for d in train + held}
    assert topics["assert"] == pydoc_data.topics.topics["assert"] and "assert" in topics["assert"]
    # a folder named like a corpus alias is ambiguous; ./NAME reads the folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "a.txt").write_text("some text")
    with pytest.raises(ConceptError, match=r"ambiguous.*\./prose"):
        read_documents("prose")
    assert read_documents("./prose") == [Document("a.txt", "some text")]


def test_eval_reports_each_domain(tmp_path):
    """`concept eval --data A --data B`: one table per domain, and a per-domain JSON object."""
    from click.testing import CliRunner

    from concept_cli.main import cli
    from tests.test_cli_train import TINY

    run = lambda *a: CliRunner().invoke(cli, [str(x) for x in a], catch_exceptions=False)  # noqa: E731
    model = tmp_path / "m"
    assert run("build", *TINY, "-o", model).exit_code == 0
    code = tmp_path / "code.txt"
    code.write_text((STDLIB_DIR / "heapq.py").read_text())
    common = ["--seq-len", 32, "--batches", 1, "--batch", 2, "--no-controls"]
    r = run("eval", model, "--data", code, "--data", "pydoc", *common, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert list(report) == [str(code), "pydoc"]
    for result in report.values():
        assert result["bits_per_token"] > 0 and 0 <= result["ratio"] <= 1
    single = json.loads(run("eval", model, "--data", code, *common, "--json").stdout)
    assert single["bits_per_token"] == report[str(code)]["bits_per_token"]  # the single-domain format
    r = run("eval", model, "--data", code, "--data", "prose", *common)
    assert r.exit_code == 0, r.output
    assert "by domain" in r.stdout and "held-out evaluation: prose" in r.stdout and "concepts / token" in r.stdout


# -- tokenizers ------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_vocab_check():
    tok = ByteTokenizer(300)
    out = tok(["héllo", "€"])["input_ids"]
    assert out == [list("héllo".encode()), [0xE2, 0x82, 0xAC]]
    assert tok.decode(torch.tensor(out[0])) == "héllo"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"
    assert tok.decode([104, 299, 105]) == "h\ufffdi"
    assert tok.eos_token_id is None
    with pytest.raises(ConceptError, match="at least 256 ids.*97"):
        ByteTokenizer(97)


def test_tokenizer_for_uses_model_tokenizer_else_bytes():
    class Cfg:
        vocab_size = 512

    class Backbone:
        config = Cfg()

    class Model:
        backbone = Backbone()
        tokenizer = None

    assert isinstance(tokenizer_for(Model()), ByteTokenizer)
    m = Model()
    m.tokenizer = sentinel = object()
    assert tokenizer_for(m) is sentinel


def test_token_cache_is_reused_and_keyed_on_content(tmp_path):
    documents = many_docs(10)
    tok = CountingTokenizer()
    first = PackedSequences(documents, tok, 16, cache_dir=tmp_path)
    calls = tok.calls
    assert calls >= 1 and not first.cache_hit and first.cache_path.is_file()
    again = PackedSequences(documents, tok, 16, cache_dir=tmp_path)
    assert tok.calls == calls and again.cache_hit
    assert torch.equal(first.batch(0, 4)["input_ids"], again.batch(0, 4)["input_ids"])
    changed = documents[:-1] + [Document(documents[-1].name, documents[-1].text + "!")]
    PackedSequences(changed, tok, 16, cache_dir=tmp_path)
    assert tok.calls > calls
    assert not list(tmp_path.glob(".*"))  # no temp files left behind
    # a corrupt cache is ignored and rewritten
    first.cache_path.write_bytes(b"garbage")
    assert not tokenize_documents(documents, tok, tmp_path).cache_hit
    assert tokenize_documents(documents, tok, tmp_path).cache_hit


# -- packing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tok", [ByteTokenizer(), EosBytes()], ids=["bytes", "eos"])
def test_packing_is_the_token_stream_with_document_boundaries(tok):
    documents = many_docs(30)
    T = 24
    ds = PackedSequences(documents, tok, T, seed=3)
    assert sorted(ds.order.tolist()) == list(range(30)) and ds.order.tolist() != list(range(30))
    stream, owner = [], []
    for j in ds.order:
        ids = tok([documents[j].text])["input_ids"][0] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        stream += ids
        owner += [j] * len(ids)
    assert ds.num_tokens == len(stream) and len(ds) == len(stream) // T
    rows = ds.rows(range(len(ds)))
    assert rows["input_ids"].flatten().tolist() == stream[: len(ds) * T]
    assert rows["attention_mask"].eq(1).all()
    owner = torch.tensor(owner[: len(ds) * T]).view(-1, T)
    doc = rows["document_ids"]
    assert doc[:, 0].eq(0).all()
    assert torch.equal(doc[:, 1:] != doc[:, :-1], owner[:, 1:] != owner[:, :-1])
    assert doc.diff(dim=1).ge(0).all() and doc.diff(dim=1).le(1).all()
    if tok.eos_token_id is not None:  # every document ends with eos, right before the boundary
        flat, owner_flat = rows["input_ids"].flatten(), owner.flatten()
        boundary = (owner_flat[1:] != owner_flat[:-1]).nonzero().flatten()
        assert flat[boundary].eq(256).all()


def test_batches_are_a_pure_function_of_step():
    ds = PackedSequences(many_docs(), ByteTokenizer(), 16, seed=7)
    B = 3
    uninterrupted = [ds.batch(s, B) for s in range(6)]
    resumed = PackedSequences(many_docs(), ByteTokenizer(), 16, seed=7)
    for s in (3, 4, 5):
        for key, value in resumed.batch(s, B).items():
            assert torch.equal(value, uninterrupted[s][key])
    assert torch.equal(ds.batch(4, B)["input_ids"], uninterrupted[4]["input_ids"])
    other = PackedSequences(many_docs(), ByteTokenizer(), 16, seed=8)
    assert not torch.equal(other.batch(0, B)["input_ids"], uninterrupted[0]["input_ids"])


def test_epochs_cover_every_row_once_and_reshuffle():
    ds = PackedSequences(many_docs(), ByteTokenizer(), 16, seed=1)
    n = len(ds)
    all_rows = ds.rows(range(n))["input_ids"]
    key = lambda t: [tuple(r) for r in t.tolist()]  # noqa: E731
    epoch0 = torch.cat([ds.batch(s, 1)["input_ids"] for s in range(n)])
    epoch1 = torch.cat([ds.batch(s, 1)["input_ids"] for s in range(n, 2 * n)])
    assert sorted(key(epoch0)) == sorted(key(all_rows)) == sorted(key(epoch1))
    assert not torch.equal(epoch0, epoch1)
    # a batch straddling the epoch boundary takes the tail of one epoch and the head of the next
    B = n // 2 + 1
    straddle = ds.batch(1, B)["input_ids"]
    assert torch.equal(straddle[: n - B], epoch0[B:]) and torch.equal(straddle[n - B:], epoch1[: 2 * B - n])
    assert ds.epoch_of(0, 4) == 0 and ds.epoch_of(n, 2) == 2.0


def test_documents_continue_across_rows():
    ds = PackedSequences([Document("long", "a" * 50), Document("short", "b" * 10)], ByteTokenizer(), 20, seed=0)
    rows = ds.rows(range(len(ds)))
    assert len(ds) == 3 and ds.num_tokens == 60
    text = "".join(chr(c) for c in rows["input_ids"].flatten().tolist())
    assert sorted([text[:50], text[50:]] if text[0] == "a" else [text[10:], text[:10]]) == ["a" * 50, "b" * 10]


# -- bad input --------------------------------------------------------------------------------
def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(ConceptError, match="does not exist"):
        read_documents(tmp_path / "nope")
    with pytest.raises(ConceptError, match="no readable documents.*no files"):
        read_documents(tmp_path)
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(ConceptError, match="e.txt holds no documents"):
        read_documents(tmp_path / "e.txt")
    with pytest.raises(ConceptError, match="all empty or binary"):
        read_documents(tmp_path)
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ConceptError, match="every line is blank"):
        read_documents(tmp_path / "e.jsonl")
    (tmp_path / "bin").write_bytes(b"\x00\x01")
    with pytest.raises(ConceptError, match="binary file.*offset 0"):
        read_documents(tmp_path / "bin")
    with pytest.raises(ConceptError, match="unknown split"):
        read_documents(tmp_path, split="test")


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "locked.txt"
    f.write_text("secret")
    f.chmod(0)
    if os.access(f, os.R_OK):  # root reads anything: simulate the denial
        monkeypatch.setattr(type(f), "read_bytes", lambda self: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(ConceptError, match="cannot read .*locked.txt: permission denied"):
        read_documents(tmp_path)


def test_bad_jsonl(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ConceptError, match=r"bad.jsonl line 2: invalid JSON"):
        read_documents(f)
    f.write_text('{"text": "ok"}\n\n{"body": "x", "id": 3}\n')
    with pytest.raises(ConceptError, match=r"bad.jsonl line 3 has no 'text' field \(fields: 'body', 'id'\).*--text-field body"):
        read_documents(f)
    f.write_text('["text"]\n')
    with pytest.raises(ConceptError, match="line 1: expected a JSON object"):
        read_documents(f)
    f.write_text('{"text": 5}\n')
    with pytest.raises(ConceptError, match="line 1: field 'text' is a JSON int, expected a string"):
        read_documents(f)


def test_non_utf8(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes(b"abc\ncaf\xe9")
    with pytest.raises(ConceptError, match=r"latin.txt is not valid UTF-8: byte 0xe9 at offset 7 \(line 2\).*--encoding-errors replace"):
        read_documents(tmp_path)
    assert read_documents(f, encoding_errors="replace") == [Document("latin.txt", "abc\ncaf\ufffd")]
    with pytest.raises(ConceptError, match="unknown encoding error handler"):
        read_documents(f, encoding_errors="bogus")


def test_too_little_data_and_bad_arguments():
    with pytest.raises(ConceptError, match=r"data has 5 tokens, fewer than one sequence of seq_len=8; lower --seq-len"):
        PackedSequences(docs("hello"), ByteTokenizer(), 8)
    with pytest.raises(ConceptError, match="data has 6 tokens"):  # eos counts
        PackedSequences(docs("hello"), EosBytes(), 8)
    with pytest.raises(ConceptError, match="no documents"):
        PackedSequences([], ByteTokenizer(), 8)
    with pytest.raises(ConceptError, match="seq_len must be a positive integer"):
        PackedSequences(docs("hello"), ByteTokenizer(), 0)
    with pytest.raises(ConceptError, match="batch size"):
        PackedSequences(docs("hello"), ByteTokenizer(), 2).batch(0, 0)
