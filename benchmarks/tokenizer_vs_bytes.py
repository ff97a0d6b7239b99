"""A BPE tokenizer against bytes, at the same compute: held-out loss per byte of text.

The built-in corpus is cut into documents (paragraph groups of about 2 KB, as JSON lines); a
byte-level BPE is trained on the training documents only (``meshtron tokenizer train``); the
documents are preprocessed twice with ``meshtron preprocess`` -- bytes and BPE -- into Megatron
indexed datasets, whose held-out split is the same last 10% of documents; the default model (cpu8:
GPT, mesh 2x2x2, interleaved) trains on each. The BPE run's larger vocabulary costs more model
FLOPs per token (the embedding and head), so the byte run gets proportionally more steps: the two
runs spend the same model FLOPs (6N + 12·l·h·s per token, :func:`meshtron.megatron.model_flops_per_token`).
Held-out loss is compared in nats per byte of text: nats/token divided by the held-out bytes per token.

    .venv/bin/python benchmarks/tokenizer_vs_bytes.py [--steps 300] [--vocab 1024]

Prints a table, writes ``benchmarks/results/tokenizer_vs_bytes.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import RESULTS, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]


def documents(text: str, size: int = 2000) -> list[str]:
    docs, current = [], []
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        if sum(len(p) for p in current) >= size:
            docs.append("\n\n".join(current))
            current = []
    if current:
        docs.append("\n\n".join(current))
    return docs


def cli(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "meshtron.cli", *args], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    if run.returncode != 0:
        sys.exit(f"meshtron {' '.join(args)} failed:\n{run.stderr[-3000:]}")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of the BPE run (default 300)")
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (default 1024)")
    args = parser.parse_args()

    from meshtron.config import load_config
    from meshtron.data import builtin_text
    from meshtron.data.preprocess import preprocess
    from meshtron.megatron import model_flops_per_token

    work = Path(tempfile.mkdtemp(prefix="meshtron-tok-"))
    docs = documents(builtin_text())
    holdout = 0.1
    train_docs = docs[: len(docs) - max(1, round(len(docs) * holdout))]
    (work / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (work / "train.txt").write_text("\n\n".join(train_docs))
    cli("tokenizer", "train", "--input", str(work / "train.txt"), "--vocab-size", str(args.vocab),
        "--output", str(work / "tokenizer.json"))
    prep = {}
    for name, tok in (("bytes", "bytes"), ("bpe", str(work / "tokenizer.json"))):
        prep[name] = preprocess([str(work / "docs.jsonl")], tok, str(work / name), workers=1, progress=False)

    cfg = load_config("cpu8")
    m = cfg.model
    def gpt_params(vocab: int) -> int:  # Megatron's eq. 2: blocks, then the (tied) embedding and positions
        return 12 * m.layers * m.hidden**2 + 13 * m.layers * m.hidden + (vocab + m.seq_len) * m.hidden

    flops = {v: model_flops_per_token(gpt_params(v), m.layers, m.hidden, m.seq_len) for v in (256, args.vocab)}
    steps = {"bpe": args.steps, "bytes": round(args.steps * flops[args.vocab] / flops[256])}
    rows, results = [], {}
    for name, vocab in (("bytes", 256), ("bpe", args.vocab)):
        metrics = work / f"{name}.jsonl"
        tok = "bytes" if name == "bytes" else str(work / "tokenizer.json")
        cli("train", "--config", "cpu8", f"data.path={work / name}", f"data.tokenizer={tok}",
            f"data.holdout_fraction={holdout}", f"model.vocab_size={vocab}", f"train.steps={steps[name]}",
            "train.eval_every=50", "--metrics", str(metrics))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        final = [r for r in records if "heldout_loss" in r][-1]
        per_token = final["heldout_loss"]
        per_byte = final.get("heldout_loss_per_byte", per_token)
        tokens = steps[name] * cfg.train.batch_size * m.seq_len
        results[name] = {"vocab": vocab, "steps": steps[name], "model_flops_per_token": flops[vocab],
                         "model_flops": flops[vocab] * tokens, "tokens": tokens,
                         "bytes_per_token": per_token / per_byte, "heldout_nats_per_token": per_token,
                         "heldout_nats_per_byte": per_byte, "curve": [(r["step"], r["heldout_loss"],
                                                                       r.get("heldout_loss_per_byte"))
                                                                      for r in records if "heldout_loss" in r],
                         "preprocess": prep[name].__dict__ if hasattr(prep[name], "__dict__") else str(prep[name])}
        rows.append([name, vocab, steps[name], f"{flops[vocab] * tokens:.3e}", f"{per_token / per_byte:.2f}",
                     f"{per_token:.4f}", f"{per_byte:.4f}"])
    print_table(["tokens", "vocab", "steps", "model FLOPs", "bytes/token", "held-out nats/token",
                 "held-out nats/byte"], rows)
    ratio = results["bpe"]["heldout_nats_per_byte"] / results["bytes"]["heldout_nats_per_byte"]
    print(f"BPE / bytes, held-out nats per byte: {ratio:.3f}")
    path = write_results("tokenizer_vs_bytes", {"runs": results, "bpe_over_bytes_per_byte": ratio,
                                                "documents": len(docs), "heldout_documents": len(docs) - len(train_docs)})
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in results.items():
        per_step = r["model_flops"] / r["steps"]
        ax.plot([s * per_step for s, _, b in r["curve"]], [b if b is not None else t for s, t, b in r["curve"]], "o-",
                label=f"{name} (vocab {r['vocab']})")
    ax.set_xlabel("model FLOPs")
    ax.set_ylabel("held-out loss (nats per byte of text)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "tokenizer_vs_bytes.png", dpi=120)
    print(f"wrote {RESULTS / 'tokenizer_vs_bytes.png'}")


if __name__ == "__main__":
    main()
