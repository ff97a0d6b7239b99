"""Preprocessing throughput and the indexed reader's resident memory, on synthetic corpora.

Corpora: deterministic pseudo-English JSONL (``{"text": ...}`` a line), ``--sizes`` MB of it (10 and
200): words drawn with Zipf-like frequencies from a fixed vocabulary of 20,000 syllable-built words,
in sentences (capitalised, full stops) of 4-24 words, documents of 30-800 words. A byte-level BPE
of ``--vocab`` (8,192) ids is trained (``train_bpe``) on the first 4 MB of the smallest corpus.

Throughput: ``meshtron.data.preprocess.preprocess`` of each corpus with 1 and 2 workers (``--workers``),
one run each: MB/s of JSONL read and tokens/s written (the tokenizer's own Rust threads are on in
every case). Resident memory: a fresh subprocess per corpus opens the result with ``TokenWindows``
(seq_len 1024), reads 20,000 samples (``--samples``) in training order, then walks every document in
file order; its peak resident set (``VmHWM``) is reported against the same process's peak before it
opened the dataset. A second run reads the same samples as slices of the ``.bin`` memory map instead
of meshtron's positioned reads, to show what that would cost.

    .venv/bin/python benchmarks/preprocess.py [--sizes 10,200] [--workers 1,2] [--samples 20000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
import numpy as np

from meshtron.data.preprocess import preprocess
from meshtron.data.tokenizers import train_bpe

SEED = 14
WORDS = 20_000
SEQ_LEN = 1024
BPE_SLICE = 4_000_000  # bytes of text the tokenizer is trained on
READS = {"pread": "pread (meshtron)", "memmap": "memmap slices"}

RSS_PROBE = r"""
import json, sys, time
from meshtron.data.samples import TokenWindows

def peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

prefix, samples, seq_len, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
before = peak_kb()
start = time.perf_counter()
windows = TokenWindows(prefix, seq_len=seq_len, seed=0, holdout_fraction=0.0, num_samples=samples)
if mode == "memmap":  # slices of the memory map instead of positioned reads
    tokens = windows.dataset.tokens
    windows.dataset.read = lambda first, count: tokens[first : first + count]
opened = time.perf_counter() - start
checksum = 0
start = time.perf_counter()
for i in range(samples):
    checksum += int(windows.sample(i)[0])
sampled = time.perf_counter() - start
after_samples = peak_kb()
start = time.perf_counter()
walked = 0
for document in windows.dataset.documents():
    walked += len(document)
walk = time.perf_counter() - start
assert walked == windows.dataset.total_tokens
print(json.dumps({"baseline_kb": before, "after_samples_kb": after_samples, "after_walk_kb": peak_kb(),
                  "open_s": opened, "samples_s": sampled, "walk_s": walk, "epochs": samples / windows.samples_per_epoch,
                  "tokens": windows.dataset.total_tokens, "documents": windows.dataset.num_documents,
                  "bin_bytes": windows.dataset.total_tokens * windows.dataset.dtype.itemsize}))
"""


def vocabulary(rng: np.random.Generator) -> np.ndarray:
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "cl", "st",
              "th", "tr", "sh", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
    words: dict[str, None] = {}
    while len(words) < WORDS:
        syllables = rng.integers(1, 4, endpoint=True)
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))
        words.setdefault(word, None)
    return np.array(list(words))


def write_corpus(path: Path, megabytes: int, seed: int) -> int:
    """JSONL of pseudo-English documents until ``megabytes`` MB; returns the document count."""
    rng = np.random.default_rng(seed)
    lower = vocabulary(np.random.default_rng(SEED))
    forms = np.concatenate([lower, np.char.capitalize(lower), np.char.add(lower, ".")])
    weights = 1.0 / (np.arange(WORDS) + 2.7)
    weights /= weights.sum()
    target, written, documents = megabytes * 1_000_000, 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            lengths = rng.integers(30, 800, size=256)
            words = rng.choice(WORDS, size=int(lengths.sum()), p=weights)
            # sentence ends every 4-24 words: a full stop there, a capital after it
            ends = np.zeros(len(words), bool)
            positions = np.cumsum(rng.integers(4, 25, size=len(words) // 4 + 1))
            ends[positions[positions < len(words)]] = True
            starts = np.roll(ends, 1)
            kind = np.where(ends, 2, np.where(starts, 1, 0))
            text = forms[words + kind * WORDS].tolist()
            position = 0
            for n in lengths.tolist():
                line = json.dumps({"text": " ".join(text[position : position + n])}) + "\n"
                position += n
                f.write(line)
                written += len(line)
                documents += 1
                if written >= target:
                    break
    return documents


def rss_probe(prefix: Path, samples: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(prefix), str(samples), str(SEQ_LEN), mode],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,200", help="corpus sizes in MB")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=20_000)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="meshtron-bench-preprocess-"))
    try:
        corpora = {}
        for size in sizes:
            start = time.perf_counter()
            path = root / f"corpus{size}.jsonl"
            documents = write_corpus(path, size, seed=size)
            corpora[size] = {"path": path, "bytes": path.stat().st_size, "documents": documents,
                             "generate_s": time.perf_counter() - start}
            print(f"generated {size} MB corpus: {documents:,} documents in {corpora[size]['generate_s']:.1f} s",
                  flush=True)
        smallest = corpora[min(sizes)]["path"]
        with smallest.open("rb") as f:
            bpe_text = b"".join(json.loads(line)["text"].encode() + b"\n" for line in f.readlines(BPE_SLICE))
        (root / "bpe.txt").write_bytes(bpe_text)
        start = time.perf_counter()
        tokenizer = train_bpe([root / "bpe.txt"], args.vocab, root / "tokenizer.json")
        train_s = time.perf_counter() - start
        print(f"trained a {tokenizer.vocab_size}-id BPE in {train_s:.1f} s", flush=True)

        runs, probes = [], []
        for size in sizes:
            for count in workers:
                prefix = root / f"corpus{size}_w{count}"
                stats = preprocess([corpora[size]["path"]], tokenizer, prefix, workers=count, progress=False)
                runs.append({"corpus_mb": size, **stats.as_dict()})
                print(f"  {stats.summary()}", flush=True)
            first = root / f"corpus{size}_w{workers[0]}"
            for other in workers[1:]:  # the same bytes, whatever the worker count
                for suffix in (".bin", ".idx"):
                    same = (root / f"corpus{size}_w{other}{suffix}").read_bytes() == first.with_suffix(suffix).read_bytes()
                    assert same, f"{size} MB: {other} workers wrote other bytes than {workers[0]}"
            for mode in READS:
                probes.append({"corpus_mb": size, "reads": mode, **rss_probe(first, args.samples, mode)})
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\npreprocessing (BPE {tokenizer.vocab_size} ids, MB = 10^6 bytes of JSONL)")
    _common.print_table(["corpus", "documents", "workers", "seconds", "MB/s", "tokens", "tokens/s"],
                        [[f"{r['corpus_mb']} MB", f"{r['documents']:,}", r["workers"], f"{r['seconds']:.1f}",
                          f"{r['mb_per_s']:.2f}", f"{r['tokens']:,}", f"{r['tokens_per_s']:,.0f}"] for r in runs])
    print(f"\nreader peak RSS (VmHWM, MB): TokenWindows seq_len {SEQ_LEN}, {args.samples:,} samples, then every document")
    _common.print_table(["corpus", ".bin MB", "token reads", "before open", "after samples", "after walk", "growth",
                         "open s", "samples s", "walk s"],
                        [[f"{p['corpus_mb']} MB", f"{p['bin_bytes'] / 1e6:.1f}", READS[p["reads"]],
                          f"{p['baseline_kb'] / 1024:.1f}", f"{p['after_samples_kb'] / 1024:.1f}",
                          f"{p['after_walk_kb'] / 1024:.1f}", f"{(p['after_walk_kb'] - p['baseline_kb']) / 1024:.1f}",
                          f"{p['open_s']:.2f}", f"{p['samples_s']:.2f}", f"{p['walk_s']:.2f}"] for p in probes])
    peak = {p["corpus_mb"]: p["after_walk_kb"] for p in probes if p["reads"] == "pread"}
    ratio = peak[max(sizes)] / peak[min(sizes)]
    print(f"peak RSS, {max(sizes)} MB corpus / {min(sizes)} MB corpus (meshtron's reads): {ratio:.3f}")
    path = _common.write_results("preprocess", {
        "corpora": {size: {k: v for k, v in c.items() if k != "path"} for size, c in corpora.items()},
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "trained_on_bytes": len(bpe_text), "train_s": train_s},
        "preprocess": runs, "reader_rss": probes, "seq_len": SEQ_LEN, "samples": args.samples,
        "peak_rss_ratio_largest_to_smallest": ratio})
    plot(runs, probes, sizes, args.samples)
    print(f"wrote {path}")


def plot(runs: list[dict], probes: list[dict], sizes: list[int], samples: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    workers = sorted({r["workers"] for r in runs})
    x = np.arange(len(sizes))
    width = 0.8 / len(workers)
    for i, count in enumerate(workers):
        values = [next(r["mb_per_s"] for r in runs if r["corpus_mb"] == s and r["workers"] == count) for s in sizes]
        left.bar(x + i * width, values, width, label=f"{count} worker(s)")
    left.set_xticks(x + 0.4 - width / 2, [f"{s} MB" for s in sizes])
    left.set_ylabel("MB/s of JSONL")
    left.set_title("preprocess throughput")
    left.legend(fontsize=8, loc="lower right")
    for i, mode in enumerate(READS):
        values = [next(p["after_walk_kb"] / 1024 for p in probes if p["corpus_mb"] == s and p["reads"] == mode)
                  for s in sizes]
        right.bar(x + i * 0.4, values, 0.4, label=READS[mode])
    base = [next(p["baseline_kb"] / 1024 for p in probes if p["corpus_mb"] == s and p["reads"] == "pread")
            for s in sizes]
    right.plot(x + 0.2, base, "k_", markersize=30, label="before opening")
    right.set_xticks(x + 0.2, [f"{s} MB" for s in sizes])
    right.set_ylabel("peak RSS (MB)")
    right.set_title(f"reader: {samples:,} samples, then every document")
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "preprocess.png", dpi=120)


if __name__ == "__main__":
    main()
