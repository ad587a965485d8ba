"""Data at scale: start-up time and peak memory of opening a corpus for training, flat in its size.

A synthetic ``.jsonl`` corpus at 1x, 4x and 16x (``BASE_DOCS`` documents of ``DOC_CHARS`` characters each,
times the scale). For each size, what ``concept train`` does before its first step: open the train and
held-out splits and read the first batch, timed and traced (``tracemalloc``: numpy's arrays included, the
memory-mapped shard's pages not, since they are the OS's page cache, not the process's heap):

* **first**: the first run, which tokenises the corpus into a token shard (concept.shards);
* **cached**: every later run, which finds the shard by its source key and memory-maps it;
* **in memory**: the reference, the pre-shard path (``read_documents`` + ``PackedSequences(documents)``),
  which reads and packs the whole corpus in RAM on every run.

Run: ``.venv/bin/python -m pytest benchmarks/test_data_scale.py -s -p no:cacheprovider`` (the table is
printed; docs/benchmarks.md, "Data at scale"); ``CONCEPT_BENCH_DATA_DOCS=256`` for a 4x larger 1x. The cached start-up's time and peak memory must stay flat
(16x within 2x of 1x) while the in-memory path's peak grows with the corpus (the measure's negative control).
"""
from __future__ import annotations

import json
import os
import time
import tracemalloc

import numpy as np
import pytest

from concept.data import ByteTokenizer, PackedSequences, open_tokens, read_documents

SCALES = (1, 4, 16)
BASE_DOCS = int(os.environ.get("CONCEPT_BENCH_DATA_DOCS", 64))  # 1x: 64 documents, 0.5 MB of text (0.5 M byte tokens)
DOC_CHARS = 8192
SEQ_LEN, BATCH = 256, 8


class EosBytes(ByteTokenizer):
    eos_token_id = 256


def write_corpus(path, docs: int) -> None:
    rng = np.random.default_rng(0)
    words = np.array(["data", "token", "shard", "memory", "concept", "stream", "corpus", "cache", "row", "batch"])
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(words[rng.integers(0, len(words), DOC_CHARS // 6)])[:DOC_CHARS]
            f.write(json.dumps({"text": f"document {i}: {text}"}) + "\n")


def start_shards(path, cache) -> int:
    tok = EosBytes(257)
    train = PackedSequences(open_tokens(str(path), "train", tok, cache_dir=cache), None, SEQ_LEN)
    PackedSequences(open_tokens(str(path), "heldout", tok, cache_dir=cache), None, SEQ_LEN)
    return int(train.batch(0, BATCH)["input_ids"].sum())


def start_in_memory(path, cache) -> int:
    tok = EosBytes(257)
    train = PackedSequences(read_documents(path, "train"), tok, SEQ_LEN)
    PackedSequences(read_documents(path, "heldout"), tok, SEQ_LEN)
    return int(train.batch(0, BATCH)["input_ids"].sum())


def timed(fn, *args) -> tuple[float, float, int]:
    """(seconds, peak traced MB, result) of one call (timed without tracing, then traced)."""
    start = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        fn(*args)
        peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()
    return seconds, peak, out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data-scale")
    out = {}
    for scale in SCALES:
        path = folder / f"corpus-{scale}x.jsonl"
        write_corpus(path, BASE_DOCS * scale)
        out[scale] = path
    return folder, out


def test_start_up_time_and_memory_are_flat_in_corpus_size(benchmark, corpora):
    folder, paths = corpora
    cache = folder / "cache"
    rows = []
    for scale in SCALES:
        path = paths[scale]
        start = time.perf_counter()
        first_out = start_shards(path, cache)  # builds the shard
        first_s = time.perf_counter() - start
        cached_s, cached_mb, cached_out = timed(start_shards, path, cache)
        memory_s, memory_mb, memory_out = timed(start_in_memory, path, cache)
        assert first_out == cached_out == memory_out  # the same first batch, whichever way it is read
        rows.append({"scale": scale, "MB_text": path.stat().st_size / 2 ** 20, "first_s": first_s,
                     "cached_s": cached_s, "cached_peak_MB": cached_mb, "in_memory_s": memory_s,
                     "in_memory_peak_MB": memory_mb})
    benchmark.extra_info["rows"] = rows
    benchmark.pedantic(start_shards, args=(paths[SCALES[-1]], cache), rounds=3, iterations=1)
    print("\n| corpus | text MB | first run s (tokenise) | cached start-up s | cached peak MB "
          "| in-memory start-up s | in-memory peak MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scale']}x | {r['MB_text']:.1f} | {r['first_s']:.3f} | {r['cached_s']:.3f} | "
              f"{r['cached_peak_MB']:.2f} | {r['in_memory_s']:.3f} | {r['in_memory_peak_MB']:.1f} |")
    small, large = rows[0], rows[-1]
    assert large["cached_peak_MB"] < 2 * small["cached_peak_MB"] + 1.0, rows  # flat memory
    assert large["in_memory_peak_MB"] > 6 * small["in_memory_peak_MB"], rows  # the measure sees growth
    assert large["cached_s"] < 2 * small["cached_s"] + 0.05, rows  # flat time (0.05 s: a shared machine's noise)
