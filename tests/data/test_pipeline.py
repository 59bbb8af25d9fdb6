"""Grain pipeline: template masks, packing isolation, malformed records, resume, seeds, sharding."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from farskip_jax.data import ChatTemplate, DataConfig, MalformedRecordError, build_pipeline

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    """A tiny word-level tokenizer trained in-test; the template's BOS/EOS are special tokens."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(WORDS), "User : Assistant : system hello world Paris is the capital of France ?"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", BOS, EOS]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _conv(i: int, rng: np.random.Generator) -> dict:
    """Conversation i: its words identify it (w<i % 60> leads every turn), lengths vary."""

    def text(n: int) -> str:
        return " ".join([f"w{i % 60}"] + [f"w{x}" for x in rng.integers(0, 60, n)])

    return {
        "messages": [
            {"role": "user", "content": text(int(rng.integers(1, 8)))},
            {"role": "assistant", "content": text(int(rng.integers(1, 12)))},
        ]
    }


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _cfg(paths, tokenizer_path, **kw) -> DataConfig:
    base = dict(paths=paths, tokenizer=tokenizer_path, seq_len=32, batch_size=2, num_epochs=1, read_threads=2)
    base.update(kw)
    return DataConfig(**base)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _all(pipeline) -> list[dict]:
    return list(iter(pipeline))


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("corpus")
    return _write_jsonl(d / "chat.jsonl", [_conv(i, rng) for i in range(120)])


def test_batch_layout_and_document_boundaries(corpus, tokenizer_path):
    batches = _all(build_pipeline(_cfg([corpus], tokenizer_path)))
    assert len(batches) > 5
    for b in batches:
        assert set(b) == {"input_ids", "targets", "loss_mask", "segment_ids", "positions"}
        for v in b.values():
            assert v.dtype == np.int32 and v.shape == (2, 32)
        seg, pos = b["segment_ids"], b["positions"]
        for row in range(2):
            s, p = seg[row], pos[row]
            nz = s[s > 0]
            assert (np.diff(nz) >= 0).all() and nz[0] == 1 and len(np.unique(nz)) == nz.max()  # 1..n in order
            assert (s[len(nz) :] == 0).all()  # padding only at the end
            for d in np.unique(nz):
                np.testing.assert_array_equal(p[s == d], np.arange((s == d).sum()))  # positions restart
            pad = s == 0
            assert (b["loss_mask"][row][pad] == 0).all() and (b["targets"][row][pad] == 0).all()
            # Within a document the target is the next input; at the last token of a document it is that
            # document's own EOS, never the next document's first token.
            same = s[:-1] == s[1:]
            np.testing.assert_array_equal(
                b["targets"][row][:-1][same & ~pad[:-1]], b["input_ids"][row][1:][same & ~pad[:-1]]
            )
            eos_id = Tokenizer.from_file(tokenizer_path).token_to_id(EOS)
            last = np.flatnonzero(np.diff(np.append(s, 0)) != 0)
            last = last[s[last] > 0]
            assert (b["targets"][row][last] == eos_id).all()


def _attention(x: np.ndarray, seg: np.ndarray, use_segments: bool, w: np.ndarray) -> np.ndarray:
    """One causal self-attention head over [S, d] with (optionally) segment-id masking."""
    q, k, v = x @ w[0], x @ w[1], x @ w[2]
    s = q @ k.T / np.sqrt(x.shape[1])
    n = x.shape[0]
    allowed = np.tril(np.ones((n, n), bool))
    if use_segments:
        allowed &= (seg[:, None] == seg[None, :]) & (seg[:, None] > 0)
    s = np.where(allowed, s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_packing_never_mixes_documents_in_attention(corpus, tokenizer_path):
    batches = _all(build_pipeline(_cfg([corpus], tokenizer_path)))
    row = next((b, r) for b in batches for r in range(2) if b["segment_ids"][r].max() >= 2)
    b, r = row
    ids, seg = b["input_ids"][r], b["segment_ids"][r]
    rng = np.random.default_rng(0)
    emb, w = rng.normal(size=(200, 8)), rng.normal(size=(3, 8, 8))
    a_pos, b_pos = seg == 1, seg == 2  # document A precedes document B in the row
    changed = ids.copy()
    changed[a_pos] = (changed[a_pos] + 7) % 60 + 4  # different tokens in document A only
    for use_segments in (True, False):
        out1 = _attention(emb[ids], seg, use_segments, w)
        out2 = _attention(emb[changed], seg, use_segments, w)
        diff_b = np.abs(out1[b_pos] - out2[b_pos]).max()
        if use_segments:
            assert diff_b == 0.0  # B's outputs are untouched by A's tokens
            assert np.abs(out1[a_pos] - out2[a_pos]).max() > 0  # the change did reach A itself
        else:
            assert diff_b > 1e-3  # the check is meaningful: without segment ids A leaks into B


def test_loss_mask_covers_exactly_assistant_tokens(tmp_path, tokenizer_path):
    conv = {
        "messages": [
            {"role": "system", "content": "w1 w2"},
            {"role": "user", "content": "Paris is the capital of France ?"},
            {"role": "assistant", "content": "w3 w4 w5"},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "w6 w7"},
        ]
    }
    path = _write_jsonl(tmp_path / "one.jsonl", [conv])
    tok = Tokenizer.from_file(tokenizer_path)
    (batch,) = _all(build_pipeline(_cfg([path], tokenizer_path, batch_size=1, seq_len=64)))
    tg, lm = batch["targets"][0], batch["loss_mask"][0]
    masked = tg[lm == 1]
    eos = tok.token_to_id(EOS)
    turns = np.split(masked, np.flatnonzero(masked == eos) + 1)[:-1]
    assert [tok.decode(t[:-1].tolist()) for t in turns] == ["w3 w4 w5", "w6 w7"]
    assert all(t[-1] == eos for t in turns)
    # Everything unmasked decodes to the template around them: nothing assistant-authored is left out.
    n_doc = (batch["segment_ids"][0] > 0).sum()
    unmasked = tok.decode(tg[:n_doc][lm[:n_doc] == 0].tolist())
    assert "w3" not in unmasked and "w6" not in unmasked and "Paris" in unmasked and "Assistant" in unmasked
    # Full document = BOS + rendered template (tokenised piecewise).
    full = [int(batch["input_ids"][0][0])] + tg[:n_doc].tolist()
    assert full[0] == tok.token_to_id(BOS)


def test_plain_text_counts_every_token_and_parquet_source(tmp_path, tokenizer_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": ["w1 w2 w3", "w4 w5"]}), path)
    batches = _all(build_pipeline(_cfg([path], tokenizer_path, batch_size=1, shuffle_seed=3)))
    seg = np.concatenate([b["segment_ids"][0] for b in batches])
    lm = np.concatenate([b["loss_mask"][0] for b in batches])
    assert (lm == (seg > 0)).all()  # every real target is trained
    assert (lm == 1).sum() == 3 + 1 + 2 + 1  # text tokens + EOS per document (BOS is input only)

    conv_path = str(tmp_path / "c.parquet")
    msgs = [[{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"}]]
    pq.write_table(pa.table({"messages": msgs}), conv_path)
    (b,) = _all(build_pipeline(_cfg([conv_path], tokenizer_path, batch_size=1)))
    assert b["loss_mask"].sum() == 3


def test_malformed_lines_reported_and_good_lines_kept(tmp_path, tokenizer_path, caplog):
    good = [{"text": f"w{i} w{i}"} for i in range(6)]
    lines = [
        good[0],
        good[1],
        "{not json",
        good[2],
        {"messages": [{"role": "robot", "content": "w1"}]},
        good[3],
        "",
        {"nothing": 1},
        good[4],
        good[5],
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="farskip_jax.data.pipeline"):
        p = build_pipeline(_cfg([path], tokenizer_path, batch_size=1, seq_len=64))
        batches = _all(p)
    assert f"{path}:3" in caplog.text and f"{path}:5" in caplog.text and f"{path}:8" in caplog.text
    assert sorted((f, ln) for f, ln, _ in p.counters.examples) == [(path, 3), (path, 5), (path, 8)]
    assert p.counters.malformed == {"bad_json": 1, "bad_role": 1, "missing_field": 1}
    assert p.counters.records_ok == 6
    tok = Tokenizer.from_file(tokenizer_path)
    docs = set()
    for b in batches:
        for d in range(1, b["segment_ids"][0].max() + 1):
            docs.add(tok.decode(b["targets"][0][b["segment_ids"][0] == d][:-1].tolist()))
    assert docs == {g["text"] for g in good}

    with pytest.raises(MalformedRecordError, match=r"mixed\.jsonl:(3|5|8): "):
        _all(build_pipeline(_cfg([path], tokenizer_path, batch_size=1, on_malformed="stop", shuffle_seed=0)))


def test_resume_from_iterator_state(corpus, tokenizer_path):
    cfg = _cfg([corpus], tokenizer_path, num_epochs=None)
    it = iter(build_pipeline(cfg))
    first = _take(it, 5)
    state = it.get_state()
    expected = _take(it, 50)  # 46 batches per epoch: crosses into the reshuffled second epoch
    fresh = iter(build_pipeline(cfg))
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 50), expected)
    # Not vacuous: a fresh iterator without the state starts over instead.
    _assert_batches_equal(_take(iter(build_pipeline(cfg)), 5), first)
    assert not np.array_equal(first[0]["input_ids"], expected[0]["input_ids"])


def test_long_documents_are_truncated(tmp_path, tokenizer_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"text": " ".join(WORDS[:20])}, {"text": "w1"}])
    p = build_pipeline(_cfg([path], tokenizer_path, seq_len=8, batch_size=1))
    batches = _all(p)
    assert p.counters.truncated == 1 and p.counters.records_ok == 2
    assert sorted(int(b["loss_mask"].sum()) for b in batches) == [2, 8]


def test_seed_determinism_and_difference(corpus, tokenizer_path):
    a = _all(build_pipeline(_cfg([corpus], tokenizer_path, shuffle_seed=1)))
    b = _all(build_pipeline(_cfg([corpus], tokenizer_path, shuffle_seed=1)))
    c = _all(build_pipeline(_cfg([corpus], tokenizer_path, shuffle_seed=2)))
    _assert_batches_equal(a, b)
    n = min(len(a), len(c))
    assert any(not np.array_equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(n))


def _doc_keys(batches) -> list[tuple[int, ...]]:
    keys = []
    for b in batches:
        for r in range(b["segment_ids"].shape[0]):
            seg = b["segment_ids"][r]
            for d in range(1, seg.max() + 1):
                keys.append(tuple(b["input_ids"][r][seg == d].tolist()))
    return keys


def test_process_sharding_is_disjoint_and_covering(tmp_path, tokenizer_path):
    # Every document unique (its words spell its index) so documents can be matched across shards.
    recs = [{"text": " ".join(f"w{int(c) + 10 * k}" for k, c in enumerate(f"{i:03d}"))} for i in range(50)]
    paths = [_write_jsonl(tmp_path / "a.jsonl", recs[:20]), _write_jsonl(tmp_path / "b.jsonl", recs[20:])]
    kw = dict(batch_size=1, drop_remainder=False)
    whole = _doc_keys(_all(build_pipeline(_cfg(paths, tokenizer_path, **kw))))
    assert len(whole) == len(set(whole)) == 50
    shards = [
        _doc_keys(_all(build_pipeline(_cfg(paths, tokenizer_path, **kw), process_index=i, process_count=3)))
        for i in range(3)
    ]
    sets = [set(s) for s in shards]
    assert sum(len(s) for s in shards) == 50
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert set().union(*sets) == set(whole)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(format="csv"), "format"),
        (dict(on_malformed="ignore"), "on_malformed"),
        (dict(seq_len=1), "seq_len"),
        (dict(batch_size=0), "batch_size"),
        (dict(shuffle_seed=-1), "shuffle_seed"),
        (dict(num_epochs=0), "num_epochs"),
        (dict(paths=[]), "paths"),
    ],
)
def test_config_validation_names_field(kw, field):
    base = dict(paths=["x.jsonl"], tokenizer="t.json")
    base.update(kw)
    with pytest.raises(ValueError, match=field):
        DataConfig(**base)


def test_template_tokens_must_exist(corpus, tokenizer_path):
    with pytest.raises(ValueError, match="template.eos"):
        build_pipeline(_cfg([corpus], tokenizer_path, template=ChatTemplate(eos="<|im_end|>")))
