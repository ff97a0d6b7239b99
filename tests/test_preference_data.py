"""Preference data: ``meshtron preprocess --preference`` renders pairs with the chat template (the answers
alone counted), writes them as one indexed dataset with its loss mask, refuses a bad line in one line
without writing anything, and serves pairs whole, chosen beside rejected."""

import json

import numpy as np
import pytest

from meshtron.cli import main
from meshtron.data.indexed import IndexedDataset, meta_path
from meshtron.data.preference import PreferencePairs, is_preference, preprocess_preference
from meshtron.data.sft import ChatTemplate, mask_prefix
from meshtron.data.sources import PairStream
from meshtron.data.tokenizers import load_tokenizer
from meshtron.errors import ConfigError

BYTES = load_tokenizer("bytes")


def pairs(n: int) -> list[dict]:
    out = []
    for i in range(n):
        word = "abcdef"[: 2 + i % 4] + "xyz"[i % 3] * (i // 3)
        if i % 2:
            out.append({"prompt": f"reverse {word}", "chosen": word[::-1], "rejected": word})
        else:
            out.append({"prompt": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                   {"role": "user", "content": f"reverse {word}"}],
                        "chosen": [{"role": "assistant", "content": word[::-1]}],
                        "rejected": [{"role": "assistant", "content": word + "x"}]})
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_pairs_are_two_documents_with_the_answers_alone_counted(tmp_path):
    records = pairs(6)
    src = write_jsonl(tmp_path / "p.jsonl", records)
    main(["preprocess", "--preference", "--input", src, "--tokenizer", "bytes", "--output", str(tmp_path / "p")])
    tokens, masks = IndexedDataset(tmp_path / "p"), IndexedDataset(mask_prefix(tmp_path / "p"))
    assert tokens.num_documents == masks.num_documents == 12
    assert is_preference(tmp_path / "p")
    assert json.loads(meta_path(str(tmp_path / "p")).read_text())["documents"] == 12
    template = ChatTemplate(BYTES)
    for k, record in enumerate(records):
        for side, name in enumerate(("chosen", "rejected")):
            ids, mask = tokens.document(2 * k + side), masks.document(2 * k + side)
            answer = record[name] if isinstance(record[name], str) else record[name][0]["content"]
            assert bytes(ids[mask == 1].tolist()).decode() == answer + "<|end|>"  # the earlier "hello" is not
            prompt = record["prompt"] if isinstance(record["prompt"], list) else [
                {"role": "user", "content": record["prompt"]}]
            conversation = [*prompt, {"role": "assistant", "content": answer}]
            np.testing.assert_array_equal(ids, template.render(conversation)[0])  # what --sft renders


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "chosen": "b"}', r"p.jsonl:2 has no 'rejected' \(prompt, chosen\); write one"),
    ('{"prompt": 3, "chosen": "b", "rejected": "c"}', r"p.jsonl:2: 'prompt' must be a string or a non-empty list"),
    ('{"prompt": "a", "chosen": " ", "rejected": "c"}', r"p.jsonl:2: 'chosen' is empty, so the pair compares"),
    ('{"prompt": "a", "chosen": "b", "rejected": [{"role": "user", "content": "c"}]}',
     r"p.jsonl:2: 'rejected'\[0\] must be \{\"role\": one of assistant"),
    ("[1, 2]", r"p.jsonl:2 is a JSON list, not an object"),
    ("{oops", r"p.jsonl:2 is not a UTF-8 JSON object"),
])
def test_a_bad_line_is_one_line_naming_it_and_nothing_is_written(tmp_path, line, message):
    good = json.dumps(pairs(1)[0])
    (tmp_path / "p.jsonl").write_text(good + "\n" + line + "\n")
    (tmp_path / "p.bin").write_bytes(b"old")
    with pytest.raises(ConfigError, match=message):
        preprocess_preference(tmp_path / "p.jsonl", "bytes", tmp_path / "p", progress=False)
    assert (tmp_path / "p.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.bin", "p.jsonl"]


def test_a_batch_holds_whole_pairs_chosen_beside_rejected(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", pairs(10))
    main(["preprocess", "--preference", "--input", src, "--tokenizer", "bytes", "--output", str(tmp_path / "p")])
    train = PreferencePairs(tmp_path / "p", seq_len=127, seed=0, holdout_fraction=0.2)
    assert train.num_pairs == 8 and len(train) == 8
    seen = {tuple(train.sample(i)[0, :, 0]) for i in range(8)}
    assert len(seen) == 8  # every training pair once an epoch
    stream = PairStream(train, pairs=4)
    batch = stream.global_batch(0)
    assert batch.shape == (8, 128, 3)
    for k in range(4):
        np.testing.assert_array_equal(batch[2 * k : 2 * k + 2], train.sample(k))
        chosen, rejected = batch[2 * k], batch[2 * k + 1]
        prompt = chosen[:, 2].argmax()
        np.testing.assert_array_equal(chosen[:prompt, 0], rejected[:prompt, 0])  # the same prompt
    np.testing.assert_array_equal(stream.rows(0, slice(2, 6)), batch[2:6])
    with pytest.raises(ConfigError, match=r"pairs of .* lose an answer at model.seq_len=8"):
        PreferencePairs(tmp_path / "p", seq_len=8, seed=0).check()
