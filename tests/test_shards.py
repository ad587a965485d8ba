"""Data at scale: token shards (tokenised once, memory-mapped, cached by content), hub dataset ids, --eval-data.

Every fast path is checked against the reference: ``PackedSequences(read_documents(...))``, which reads the
documents and packs them in memory."""
import json
import multiprocessing
import os

import numpy as np
import pytest

from concept import data, fingerprint
from concept.data import ByteTokenizer, PackedSequences, open_tokens, read_documents
from concept.errors import ConceptError
from concept.shards import shards_root


class EosBytes(ByteTokenizer):
    eos_token_id = 256


class CountingTokenizer(EosBytes):
    """Bytes + eos that count their batch calls (the ``_tokenize`` path of real tokenizers)."""

    encode_array = None
    calls = 0

    def __call__(self, texts, **kw):
        type(self).calls += 1
        return super().__call__(texts)


def corpus(folder, n=60, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(f"<{i}> " + "abcdefgh é\n" * int(rng.integers(1, 30)))
    return folder


def all_rows(packed):
    return packed.rows(np.arange(len(packed)))


def same_batches(a, b):
    ra, rb = all_rows(a), all_rows(b)
    return all(bool((ra[k] == rb[k]).all()) for k in ra) and len(a) == len(b)


@pytest.mark.parametrize("tok", [ByteTokenizer(), EosBytes(257)], ids=["bytes", "eos"])
def test_shard_batches_equal_the_in_memory_reference(tmp_path, tok):
    src = corpus(tmp_path / "src")
    for split in ("train", "heldout", "all"):
        tokens = open_tokens(str(src), split, tok, cache_dir=tmp_path / "cache")
        assert isinstance(tokens.ids, np.memmap) and tokens.ids.dtype == np.uint16
        fast = PackedSequences(tokens, None, 16, seed=3)
        ref = PackedSequences(read_documents(src, split), tok, 16, seed=3)
        assert same_batches(fast, ref) and fast.num_tokens == ref.num_tokens
        for step in (0, 7, 31):  # across epochs
            b, r = fast.batch(step, 4), ref.batch(step, 4)
            assert all(bool((b[k] == r[k]).all()) for k in b)
    # the data fingerprint a checkpoint records is the one of the documents
    tokens = open_tokens(str(src), "train", tok, cache_dir=tmp_path / "cache")
    assert fingerprint.of_digests(tokens.digest, tokens.heldout_digest) == fingerprint.of_documents(
        read_documents(src, "train"), read_documents(src, "heldout"))
    # negative control: another seed is another order, so the comparison can fail
    assert not same_batches(PackedSequences(tokens, None, 16, seed=4),
                            PackedSequences(read_documents(src, "train"), tok, 16, seed=3))


def test_splits_stay_disjoint_and_as_defined(tmp_path):
    src = corpus(tmp_path / "src", n=80)
    tok = EosBytes(257)
    train = open_tokens(str(src), "train", tok, cache_dir=tmp_path / "c")
    held = open_tokens(str(src), "heldout", tok, cache_dir=tmp_path / "c")
    assert train.num_documents == len(read_documents(src, "train")) and held.num_documents == len(
        read_documents(src, "heldout")) > 0
    assert not set(train.starts.tolist()) & set(held.starts.tolist())  # no held-out document is trained on


def test_cached_once_keyed_on_content_and_rebuilt_when_damaged(tmp_path, caplog):
    src = corpus(tmp_path / "src")
    tok, cache = CountingTokenizer(257), tmp_path / "cache"
    first = open_tokens(str(src), "train", tok, cache_dir=cache)
    calls = CountingTokenizer.calls
    assert calls > 0 and not first.cache_hit
    again = open_tokens(str(src), "train", tok, cache_dir=cache)
    assert again.cache_hit and CountingTokenizer.calls == calls and again.path == first.path
    # touched, same content: the same shard (by content), no tokenisation
    os.utime(src / "doc000.txt", ns=(1, 1))
    touched = open_tokens(str(src), "train", tok, cache_dir=cache)
    assert touched.path == first.path and CountingTokenizer.calls == calls
    # changed content: a new shard
    (src / "doc001.txt").write_text("new text " * 20)
    changed = open_tokens(str(src), "all", tok, cache_dir=cache)
    assert changed.path != first.path and not changed.cache_hit
    ref = PackedSequences(read_documents(src, "all"), tok, 8, seed=0)
    assert same_batches(PackedSequences(changed, None, 8), ref)
    # damage: truncated tokens, flipped bytes, a missing file -> a warning and a rebuild, never a wrong corpus
    for damage in ("truncate", "flip", "remove"):
        tokens_bin = changed.path / "tokens.bin"
        if damage == "truncate":
            with open(tokens_bin, "r+b") as f:
                f.truncate(tokens_bin.stat().st_size - 2)
        elif damage == "flip":
            raw = bytearray(tokens_bin.read_bytes())
            raw[:8] = b"\xff" * 8
            tokens_bin.write_bytes(bytes(raw))
        else:
            (changed.path / "lengths.npy").unlink()
        caplog.clear()
        rebuilt = open_tokens(str(src), "all", tok, cache_dir=cache)
        assert "damaged" in caplog.text and not rebuilt.cache_hit
        assert same_batches(PackedSequences(rebuilt, None, 8), ref)


def _open_in_child(args):
    src, cache = args
    tokens = open_tokens(src, "all", EosBytes(257), cache_dir=cache)
    return str(tokens.path), int(np.asarray(tokens.ids, dtype=np.int64).sum())


def test_two_processes_build_one_shard(tmp_path):
    src = corpus(tmp_path / "src", n=200)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_open_in_child, [(str(src), str(tmp_path / "c"))] * 2)
    assert results[0] == results[1]
    root = tmp_path / "c" / "shards"
    assert len([p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 1
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_where_the_shards_live(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CONCEPT_DATA_CACHE", raising=False)
    assert shards_root() == tmp_path / "cache" / "shards"
    monkeypatch.setenv("CONCEPT_DATA_CACHE", str(tmp_path / "big-disk"))
    assert shards_root() == tmp_path / "big-disk"
    tokens = open_tokens(str(corpus(tmp_path / "src", n=5)), "all", EosBytes(257))
    assert tokens.path.parent == tmp_path / "big-disk"


def test_large_vocabularies_use_uint32(tmp_path):
    src = corpus(tmp_path / "src", n=10)

    class Big(EosBytes):
        eos_token_id = 70_000

    tokens = open_tokens(str(src), "all", Big(70_001), cache_dir=tmp_path / "c")
    assert tokens.ids.dtype == np.uint32 and int(tokens.ids[tokens.starts[0] + tokens.lengths[0] - 1]) == 70_000


# -- Hugging Face datasets through `datasets.load_dataset` -------------------------------------------
@pytest.fixture
def hub_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    for split, n in (("train", 50), ("test", 8)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"content": f"{split} row {i} " + "words " * (i % 7 + 1)}) + "\n")
    return folder


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
def test_hub_dataset_id_with_split_and_streaming(hub_folder, tmp_path, streaming):
    source = f"hf:{hub_folder}"
    tok = EosBytes(257)
    docs = read_documents(source, "all", text_field="content", data_split="test")
    assert [d.name for d in docs][:2] == ["test#0", "test#1"] and docs[0].text.startswith("test row 0")
    tokens = open_tokens(source, "all", tok, text_field="content", data_split="test", streaming=streaming,
                         cache_dir=tmp_path / "c")
    assert same_batches(PackedSequences(tokens, None, 8), PackedSequences(docs, tok, 8))
    train = open_tokens(source, "train", tok, text_field="content", streaming=streaming, cache_dir=tmp_path / "c")
    assert train.num_documents == len(read_documents(source, "train", text_field="content"))
    with pytest.raises(ConceptError, match="no 'text' column"):
        open_tokens(source, "all", tok, streaming=streaming, cache_dir=tmp_path / "c2")


def test_a_name_that_is_neither_a_path_nor_loadable(hub_folder, tmp_path):
    with pytest.raises(ConceptError, match="does not exist.*load_dataset"):
        open_tokens("no-such-org/no-such-dataset", "train", EosBytes(257), cache_dir=tmp_path / "c")
    assert data.hub_name("./data.txt") is None and data.hub_name(str(hub_folder)) is None  # paths stay paths
    assert data.hub_name("stdlib") is None and data.hub_name("org/name") == "org/name"
    with pytest.raises(ConceptError, match="does not exist"):
        open_tokens(str(tmp_path / "missing"), "train", EosBytes(257), cache_dir=tmp_path / "c")
    with pytest.raises(ConceptError, match="--streaming is for a --data dataset id"):
        open_tokens(str(hub_folder), "train", EosBytes(257), streaming=True, cache_dir=tmp_path / "c")


# -- the CLI: a hub dataset to train on, --eval-data for the periodic and the later evaluation --------------
@pytest.mark.slow  # about a minute on 2 shared cores (build, train, four evaluations)
def test_train_on_a_dataset_id_with_eval_data_then_eval_defaults_to_it(hub_folder, tmp_path, monkeypatch):
    from tests.test_cli_train import FAST, TINY, run

    monkeypatch.setenv("CONCEPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CONCEPT_DATA_CACHE", raising=False)
    built = tmp_path / "m"
    assert run("build", *TINY, "-o", built).exit_code == 0
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"content": f"held-out prose {i} " * 9}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    r = run("train", built, "--data", f"hf:{hub_folder}", "--data-split", "train", "--text-field", "content",
            "--eval-data", held, "--steps", 2, *FAST, "--eval-every", 2, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    trained = json.loads(r.stdout)["eval"]["nll"]
    saved = json.loads((out / "train.json").read_text())
    saved = saved.get("config", saved)
    assert saved["eval_data"] == str(held) and saved["data"] == f"hf:{hub_folder}"
    assert (tmp_path / "cache" / "shards").is_dir()  # the shards live in $CONCEPT_CACHE

    def nll(*data):
        r = run("eval", out, *data, "--batches", 1, "--batch", 2, "--no-controls", "--json")
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["nll"]

    assert nll() == pytest.approx(trained, abs=1e-5) == nll("--data", held)
    assert nll("--data", f"hf:{hub_folder}") != pytest.approx(trained, abs=1e-5)  # negative control: other data
    # eval's own --data-split / --streaming: the test split, loaded or streamed alike, is not the train split
    test_split = nll("--data", f"hf:{hub_folder}", "--data-split", "test")
    assert test_split == pytest.approx(nll("--data", f"hf:{hub_folder}", "--data-split", "test", "--streaming"), abs=1e-6)
    assert test_split != pytest.approx(nll("--data", f"hf:{hub_folder}"), abs=1e-5)
