"""`--data` from Hugging Face `datasets`: save_to_disk folders (Dataset, DatasetDict), .parquet and .arrow."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
import pyarrow.feather as feather  # noqa: E402  (a dependency of datasets)

from concept.data import _is_heldout, read_documents  # noqa: E402
from concept.errors import ConceptError  # noqa: E402
from tests.test_cli_train import FAST, TINY, run  # noqa: E402
from tests.test_training import corpus  # noqa: E402,F401  (fixture)

TEXTS = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(40)]
TEXTS[5] = "   "  # blank texts are skipped, as in JSONL


@pytest.fixture(autouse=True)
def quiet_datasets():
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def table(**extra):
    return datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS))), **extra})


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def tree(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def texts(docs):
    return [d.text for d in docs]


def test_same_documents_as_jsonl(tmp_path):
    jsonl = read_documents(write_jsonl(tmp_path / "docs.jsonl", TEXTS))
    saved = tmp_path / "saved"
    table().save_to_disk(saved)
    table().to_parquet(tmp_path / "docs.parquet")
    feather.write_feather(table().data.table, tmp_path / "docs.arrow")  # Arrow IPC file format
    before = tree(tmp_path)
    sources = {saved: "saved", tmp_path / "docs.parquet": "docs.parquet", tmp_path / "docs.arrow": "docs.arrow",
               saved / "data-00000-of-00001.arrow": "data-00000-of-00001.arrow"}  # Arrow IPC stream format
    for source, name in sources.items():
        docs = read_documents(source)
        assert texts(docs) == texts(jsonl) == [t for t in TEXTS if t.strip()]
        assert [d.name for d in docs] == [f"{name}#{i}" for i, t in enumerate(TEXTS) if t.strip()]
        assert read_documents(str(source)) == docs
    assert tree(tmp_path) == before  # nothing written next to the data


@pytest.mark.parametrize("fraction", [0.3, 0.05])
def test_split_rule_is_the_jsonl_one(tmp_path, fraction):
    saved = tmp_path / "saved"
    table().save_to_disk(saved)
    for source in (saved, write_jsonl(tmp_path / "docs.jsonl", TEXTS)):
        every = read_documents(source)
        train = read_documents(source, "train", heldout_fraction=fraction)
        held = read_documents(source, "heldout", heldout_fraction=fraction)
        assert held == [d for d in every if _is_heldout(d.name, fraction)]  # the hash of the document name
        assert train == [d for d in every if not _is_heldout(d.name, fraction)]
        assert held and train and len(held) + len(train) == len(every)
        assert read_documents(source, "heldout", heldout_fraction=fraction) == held  # deterministic


def test_text_field(tmp_path):
    data = datasets.Dataset.from_dict({"content": ["first text", "second text"], "n": [1, 2]})
    data.save_to_disk(tmp_path / "saved")
    data.to_parquet(tmp_path / "one.parquet")
    for source in (tmp_path / "saved", tmp_path / "one.parquet"):
        assert texts(read_documents(source, text_field="content")) == ["first text", "second text"]
        with pytest.raises(ConceptError) as err:
            read_documents(source)
        message = str(err.value)
        assert "no 'text' column" in message and "'content', 'n'" in message and "--text-field content" in message
        assert str(source) in message


def test_missing_field_many_string_columns(tmp_path):
    table(title=[f"t{i}" for i in range(len(TEXTS))]).save_to_disk(tmp_path / "saved")
    with pytest.raises(ConceptError, match=r"no 'body' column \(columns: 'text', 'id', 'title'\); choose one with "
                                           r"--text-field NAME \(string columns: 'text', 'title'\)"):
        read_documents(tmp_path / "saved", text_field="body")


def test_non_string_field(tmp_path):
    table().save_to_disk(tmp_path / "saved")
    with pytest.raises(ConceptError) as err:
        read_documents(tmp_path / "saved", text_field="id")
    message = str(err.value)
    assert "column 'id' holds Value('int64'), expected strings" in message and "--text-field text" in message
    datasets.Dataset.from_dict({"text": ["fine", None, "x"]}).to_parquet(tmp_path / "nulls.parquet")
    with pytest.raises(ConceptError, match=r"nulls.parquet row 1: column 'text' is null .*expected a string"):
        read_documents(tmp_path / "nulls.parquet")


def test_dataset_dict(tmp_path):
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": table(), "test": table().select(range(3))}).save_to_disk(dd)
    train = read_documents(dd)
    assert texts(train) == [t for t in TEXTS if t.strip()] and train[0].name == "train#0"
    test = read_documents(f"{dd}:test")
    assert texts(test) == TEXTS[:3] and read_documents(dd / "test") == test  # PATH:SPLIT == PATH/SPLIT
    assert read_documents(dd, "heldout", heldout_fraction=0.3) == [d for d in train if _is_heldout(d.name, 0.3)]
    with pytest.raises(ConceptError, match=r"has no split 'dev' \(splits: 'train', 'test'\); pass --data .*:SPLIT"):
        read_documents(f"{dd}:dev")
    with pytest.raises(ConceptError, match=r"single Hugging Face Dataset, not a DatasetDict"):
        read_documents(f"{dd / 'test'}:train")

    no_train = tmp_path / "nt"
    datasets.DatasetDict({"validation": table(), "test": table()}).save_to_disk(no_train)
    with pytest.raises(ConceptError) as err:
        read_documents(no_train)
    message = str(err.value)
    assert "without a 'train' split" in message and "'validation', 'test'" in message
    assert f"--data {no_train}:validation" in message
    assert texts(read_documents(f"{no_train}:validation")) == texts(train)


def test_parquet_folder(tmp_path):
    folder = tmp_path / "pq"
    (folder / "more").mkdir(parents=True)
    table().select(range(20)).to_parquet(folder / "a.parquet")
    table().select(range(20, 40)).to_parquet(folder / "more" / "b.parquet")
    (folder / "notes.txt").write_text("a plain text document")
    datasets.DatasetDict({"train": table().select(range(2))}).save_to_disk(folder / "nested")
    before = tree(folder)
    docs = read_documents(folder)
    assert [d.name for d in docs][:2] == ["a.parquet#0", "a.parquet#1"]
    by_source = {}
    for d in docs:
        by_source.setdefault(d.name.split("#")[0], []).append(d.text)
    assert by_source == {"a.parquet": [t for t in TEXTS[:20] if t.strip()], "more/b.parquet": TEXTS[20:],
                         "nested/train": TEXTS[:2], "notes.txt": ["a plain text document"]}
    assert tree(folder) == before
    with pytest.raises(ConceptError, match=r"a.parquet has no 'body' column.*--text-field"):
        read_documents(folder, text_field="body")


def test_other_folders_keep_their_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConceptError, match="holds no readable documents \\(no files"):
        read_documents(tmp_path / "empty")
    with pytest.raises(ConceptError, match="does not exist"):
        read_documents(f"{tmp_path / 'missing'}:train")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConceptError, match="cannot read .*broken.parquet as a parquet table"):
        read_documents(tmp_path / "broken.parquet")


def test_datasets_is_imported_lazily(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    code = ("import sys, concept.data, concept_cli.main; concept.data.read_documents(sys.argv[1]); "
            "print('datasets' in sys.modules, 'pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(source)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split() == ["False", "False"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-datasets") / "m"
    assert run("build", *TINY, "-o", out).exit_code == 0
    return out


def test_train_and_eval_from_save_to_disk(built, corpus, tmp_path):  # noqa: F811
    rows = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"content": rows}).save_to_disk(saved)
    before = tree(saved)
    out = tmp_path / "run"
    r = run("train", built, "--data", saved, "--text-field", "content", "--steps", 2, *FAST, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 2
    assert json.loads((out / "train.json").read_text())["data"] == str(saved)

    r = run("eval", out, "--batches", 1, "--batch", 2, "--no-controls", "--json")  # the run's held-out split
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bits_per_token"] > 0
    r = run("eval", out, "--data", saved, "--batches", 1, "--batch", 2, "--no-controls", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bits_per_token"] > 0
    assert tree(saved) == before

    r = run("train", built, "--data", saved, "--steps", 1, *FAST, "--out", tmp_path / "bad")
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "no 'text' column" in r.stderr and "--text-field content" in r.stderr
