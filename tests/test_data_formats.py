"""User data through `--data`: every supported format loads, labels cover assistant tokens only
(built-in and subword tokenizers), the overlong policy, text-only records, tokenizer errors.

Expectations are derived from the records' own text and the documented templates, never from
running the code under test. Everything is written under tmp_path; no network, CPU only.
"""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fixtures_data import conv
from mmpipe.config import ConfigError
from mmpipe.data.dataset import prepare
from mmpipe.data.export import FORMATS, export_shapes
from mmpipe.data.packing import sample_rowset
from mmpipe.data.records import BadRecord
from mmpipe.data.text import ConversationEncoder
from mmpipe.data.tokenizer import MOONDREAM_TEMPLATE, builtin_tokenizer, load_tokenizer
from mmpipe.model import IGNORE_INDEX
from mmpipe.model.rows import IMAGE_SLOT
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

N = 12
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<pad>"]
# a hand-built multi-turn conversation (human / gpt / human / gpt), every word in the shapes vocabulary
MULTI_TURN = [{"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"},
              {"from": "human", "value": "how many shapes are there"}, {"from": "gpt", "value": "two"}]


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path, monkeypatch):
    """`datasets.load_dataset` caches what it builds: keep that cache inside the test's tmp_path."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.disable_progress_bars()


# ---- helpers --------------------------------------------------------------------------------------

def load(tmp_path, data, *flags):
    """--data DATA [flags] -> (RunConfig, samples), the way `mmpipe train` resolves and prepares."""
    args = TrainArgs.from_argv(["--data", str(data), "--output-dir", str(tmp_path / "run"), *flags])
    run = resolve(args, 2)
    return run, prepare(run.data, run.model, args.output_dir, seed=0, verbose=False)


def entry_tokens(samples, n):
    ix = samples.index
    sl = slice(ix.offsets[n], ix.offsets[n + 1])
    return ix.tokens[sl], ix.target[sl]


def item_of_row(run, samples, row: int) -> dict:
    """The training row (one sample per row) of the stream position whose record is source row `row` (epoch 0)."""
    ts = sample_rowset(samples, run.model, run.data.text_len)
    pos = [samples.row(p) for p in range(len(samples.index))].index(row)
    return ts[pos]


def builtin_expected(messages: list[tuple[str, str]]) -> tuple[list[str], list[bool]]:
    """Tokens and target mask by the built-in template, as documented in mmpipe.data.tokenizer:
    [BOS] question: <question words> <answer words> [EOS] ...; loss on answer words + [EOS]."""
    vocab = builtin_tokenizer().get_vocab()
    words = lambda text: [w if w in vocab else "[UNK]" for w in text.replace("<image>", " ").split()]  # noqa: E731
    toks, mask = ["[BOS]"], [False]
    for role, text in messages:
        if role in ("human", "user"):
            add = ["question:"] + words(text)
            mask += [False] * len(add)
        else:
            add = words(text) + ["[EOS]"]
            mask += [True] * len(add)
        toks += add
    return toks, mask


def check_labels(item: dict, ids: np.ndarray, target: np.ndarray, n_img: int):
    """The row [BOS, the image's n_img IMAGE_SLOT positions (none for a text-only sample), text ...]:
    labels[k + j - 1] == ids[j] for every answer token j >= 1 (k: the image's positions), IGNORE_INDEX
    everywhere else."""
    k = n_img if item["has_image"][0] else 0
    labels = np.asarray(item["labels"])
    want = np.full_like(labels, IGNORE_INDEX)
    for j in np.nonzero(target)[0]:
        assert j >= 1
        want[k + j - 1] = ids[j]
    assert labels.tolist() == want.tolist()
    assert np.asarray(item["input_ids"])[:k + len(ids)].tolist() == [ids[0]] + [IMAGE_SLOT] * k + list(ids[1:])


def source_messages(fmt: str, path, row: int) -> list[tuple[str, str]]:
    """Record `row` of an exported file, read straight from the file (not through mmpipe)."""
    if fmt == "llava-jsonl":
        conv = json.loads(path.read_text().splitlines()[row])["conversations"]
    elif fmt == "llava-json":
        conv = json.loads(path.read_text())[row]["conversations"]
    elif fmt == "parquet":
        import pyarrow.parquet as pq
        conv = pq.read_table(path).to_pylist()[row]["conversations"]
    elif fmt == "hf-disk":
        import datasets
        conv = datasets.load_from_disk(str(path))[row]["conversations"]
    elif fmt == "pairs-csv":
        with open(path, newline="") as f:
            rec = list(csv.DictReader(f))[row]
        return [("user", "Describe the image."), ("assistant", rec["text"])]
    else:
        rec = json.loads(path.read_text().splitlines()[row])
        return [("user", "Describe the image."), ("assistant", rec["text"])]
    return [(t["from"], t["value"]) for t in conv]


def expected_pixels(png, vision) -> torch.Tensor:
    """A 64 x 64 RGB file needs neither padding nor resizing: the tensor is its normalised pixels."""
    x = np.asarray(Image.open(png).convert("RGB"), dtype=np.float32) / 255.0
    x = (x - np.array(vision.mean, dtype=np.float32)) / np.array(vision.std, dtype=np.float32)
    return torch.from_numpy(x).permute(2, 0, 1)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- 1. every format loads through --data ---------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_each_export_format_loads_through_data(tmp_path, fmt):
    path = export_shapes(tmp_path / "export", fmt, N)
    run, samples = load(tmp_path, path)
    stats = samples.index.stats
    assert (stats["records"], stats["good"], stats["bad"], stats["with_image"]) == (N, N, 0, N)
    assert sorted(samples.index.rows.tolist()) == list(range(N))
    tok = run.data.tokenizer
    for n, row in enumerate(samples.index.rows.tolist()):  # every record, the first one included
        ids, target = entry_tokens(samples, n)
        want_toks, want_mask = builtin_expected(source_messages(fmt, path, row))
        assert tok.convert_ids_to_tokens(ids.tolist()) == want_toks, (fmt, row)
        assert target.tolist() == want_mask, (fmt, row)
    # the first record: its question and answer come back, its image is the one it names
    q_and_a = source_messages(fmt, path, 0)
    ids, target = entry_tokens(samples, samples.index.rows.tolist().index(0))
    assert tok.decode(ids[target], skip_special_tokens=True).split() == q_and_a[1][1].split()
    if fmt.startswith(("llava", "parquet", "hf")):
        question = q_and_a[0][1].replace("<image>", "").split()
        assert tok.decode(ids[~target], skip_special_tokens=True).split() == ["question:"] + question
    item = item_of_row(run, samples, 0)
    assert item["has_image"].tolist() == [1]
    assert tuple(item["pixels"].shape) == (1, 3, 64, 64)
    want = expected_pixels(tmp_path / "export/images/00000.png", run.model.vision)
    torch.testing.assert_close(item["pixels"][0], want, atol=1e-5, rtol=0)
    check_labels(item, ids, target, run.model.vision.n_tokens)


def test_image_folder_with_metadata_loads_as_pairs(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    Image.new("RGB", (64, 64), (250, 85, 85)).save(folder / "a.png")
    write_jsonl(folder / "metadata.jsonl", [{"file_name": "a.png", "text": "red circle"}])
    run, samples = load(tmp_path, folder)
    assert run.data.spec.format == "hf" and run.data.spec.builder == "imagefolder"
    assert (samples.index.stats["good"], samples.index.stats["with_image"]) == (1, 1)
    ids, target = entry_tokens(samples, 0)
    want_toks, want_mask = builtin_expected([("user", "Describe the image."), ("assistant", "red circle")])
    assert run.data.tokenizer.convert_ids_to_tokens(ids.tolist()) == want_toks
    assert target.tolist() == want_mask
    item = item_of_row(run, samples, 0)
    assert item["has_image"].tolist() == [1]
    torch.testing.assert_close(item["pixels"][0], expected_pixels(folder / "a.png", run.model.vision), atol=1e-5,
                               rtol=0)


def test_data_config_renames_columns_and_sets_prompt(tmp_path):
    export_shapes(tmp_path, "pairs-csv", 3)  # images/ only; the csv below uses other column names
    captions = ["red circle", "blue square green cross", "cyan diamond"]
    with open(tmp_path / "x.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["caption", "img"])
        w.writerows([c, f"images/{i:05d}.png"] for i, c in enumerate(captions))
    cfg = tmp_path / "data.json"
    cfg.write_text(json.dumps({"format": "pairs", "path": "x.csv", "columns": {"image": "img", "text": "caption"},
                               "prompt": "what shape is"}))
    run, samples = load(tmp_path, cfg)
    assert samples.index.stats["good"] == 3 and samples.index.stats["with_image"] == 3
    tok = run.data.tokenizer
    for n, row in enumerate(samples.index.rows.tolist()):
        ids, target = entry_tokens(samples, n)
        want_toks, want_mask = builtin_expected([("user", "what shape is"), ("assistant", captions[row])])
        assert tok.convert_ids_to_tokens(ids.tolist()) == want_toks
        assert target.tolist() == want_mask
    item = item_of_row(run, samples, 1)
    torch.testing.assert_close(item["pixels"][0], expected_pixels(tmp_path / "images/00001.png", run.model.vision),
                               atol=1e-5, rtol=0)


def test_documented_hf_json_config_with_renamed_conversations(tmp_path):
    """docs/data.md's config, as written: an hf json builder over two files whose conversations are in
    a `messages` column. Naming "conversations" as a column must not make the config look like LLaVA data."""
    export_shapes(tmp_path, "pairs-csv", 3)  # images/ only
    qa = [("what shape is red", "circle"), ("how many shapes are there", "two"), ("what shape is blue", "cross")]
    recs = [{"image": f"images/{i:05d}.png", "messages": conv(q, a)} for i, (q, a) in enumerate(qa)]
    write_jsonl(tmp_path / "part-0.jsonl", recs[:2])
    write_jsonl(tmp_path / "part-1.jsonl", recs[2:])
    cfg = tmp_path / "data.json"
    cfg.write_text(json.dumps({"format": "hf", "builder": "json", "data_files": ["part-0.jsonl", "part-1.jsonl"],
                               "columns": {"conversations": "messages"}}))
    run, samples = load(tmp_path, cfg)
    assert (run.data.spec.format, run.data.spec.builder) == ("hf", "json")
    assert (samples.index.stats["good"], samples.index.stats["with_image"]) == (3, 3)
    for n, row in enumerate(samples.index.rows.tolist()):
        ids, target = entry_tokens(samples, n)
        want_toks, want_mask = builtin_expected([("human", qa[row][0]), ("gpt", qa[row][1])])
        assert run.data.tokenizer.convert_ids_to_tokens(ids.tolist()) == want_toks
        assert target.tolist() == want_mask
    # a config whose JSON breaks is still read as a config, and says where it breaks
    cfg.write_text('{"format": "hf", "builder": "json",\n "columns": {"conversations": "messages"}')
    with pytest.raises(ConfigError, match=r"data.json is not valid JSON"):
        load(tmp_path, cfg)


# ---- 2. labels cover assistant tokens exactly ------------------------------------------------------

@pytest.fixture
def multi_turn_jsonl(tmp_path):
    export_shapes(tmp_path, "pairs-csv", 1)  # for images/00000.png
    return write_jsonl(tmp_path / "multi.jsonl", [{"image": "images/00000.png", "conversations": MULTI_TURN}])


def test_multi_turn_labels_builtin_tokenizer(tmp_path, multi_turn_jsonl):
    run, samples = load(tmp_path, multi_turn_jsonl)
    tok = run.data.tokenizer
    ids, target = entry_tokens(samples, 0)
    # written out by hand from the built-in template: answers and their [EOS] are the only targets
    want = [("[BOS]", 0), ("question:", 0), ("what", 0), ("shape", 0), ("is", 0), ("red", 0), ("circle", 1),
            ("[EOS]", 1), ("question:", 0), ("how", 0), ("many", 0), ("shapes", 0), ("are", 0), ("there", 0),
            ("two", 1), ("[EOS]", 1)]
    assert list(zip(tok.convert_ids_to_tokens(ids.tolist()), target.astype(int).tolist())) == want
    check_labels(item_of_row(run, samples, 0), ids, target, run.model.vision.n_tokens)


def make_bpe(out_dir, *, chat_template: str | None = CHATML, pad: str | None = "<pad>"):
    """A small byte-level BPE trained here, saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["what shape is red", "what colour is the circle", "how many shapes are there", "two shapes",
            "the answer is a blue square", "user assistant", "Describe the image."]
    bpe.train_from_iterator(text * 5, trainer)
    kw = {"pad_token": pad} if pad else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", **kw)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return out_dir


def test_multi_turn_labels_subword_chatml_tokenizer(tmp_path, multi_turn_jsonl):
    tok_dir = make_bpe(tmp_path / "bpe")
    tok = load_tokenizer(str(tok_dir))
    assert tok.is_fast and tok.bos_token_id is None and tok.chat_template == CHATML
    assert tok.pad_token == "<pad>"
    end = "<|im_end|>"

    def pieces(text):
        return tok(text, add_special_tokens=False).input_ids

    # text.py: a reply's span runs from after the generation prompt (`<|im_start|>assistant\n`) to
    # the end of the conversation rendered up to and including that reply, trailing whitespace
    # excluded, i.e. the reply and its <|im_end|>; the template's "\n" after it is context.
    # No BOS: the sequence starts with EOS.
    want_ids, want_target, spans = [tok.eos_token_id], [False], []
    for t in MULTI_TURN:
        content = t["value"].replace("<image>", "").strip()
        if t["from"] == "human":
            p = pieces(f"<|im_start|>user\n{content}{end}\n")
            want_ids += p
            want_target += [False] * len(p)
        else:
            header, reply, newline = pieces("<|im_start|>assistant\n"), pieces(f"{content}{end}"), pieces("\n")
            want_ids += header + reply + newline
            want_target += [False] * len(header) + [True] * len(reply) + [False] * len(newline)
            spans.append(f"{content}{end}")
    assert tok.convert_ids_to_tokens([tok.eos_token_id]) == [end]

    # the encoder itself, on the conversation as a Record holds it
    enc = ConversationEncoder(tok, 200).encode(
        [("user" if t["from"] == "human" else "assistant", t["value"]) for t in MULTI_TURN])
    assert enc.ids.tolist() == want_ids
    assert enc.target.tolist() == want_target
    # targets decode to exactly the assistant replies with their end-of-turn, turn by turn
    runs, cur = [], []
    for i, is_t in zip(enc.ids.tolist(), enc.target.tolist()):
        if is_t:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    assert [tok.decode(r) for r in runs] == spans
    assert not any("user" in tok.decode([i]) or "assistant" in tok.decode([i]) for i in enc.ids[enc.target])

    # end to end: --data + --tokenizer DIR, then the training item's labels
    run, samples = load(tmp_path, multi_turn_jsonl, "--tokenizer", str(tok_dir))
    assert run.model.text.vocab_size >= len(tok)
    ids, target = entry_tokens(samples, 0)
    assert ids.tolist() == want_ids and target.tolist() == want_target
    item = item_of_row(run, samples, 0)
    check_labels(item, ids, target, run.model.vision.n_tokens)
    assert (np.asarray(item["input_ids"])[run.model.vision.n_tokens + len(ids):] == tok.pad_token_id).all()


def test_tokenizer_without_template_or_pad_gets_moondream_format_and_eos_pad(tmp_path):
    tok = load_tokenizer(str(make_bpe(tmp_path / "bare", chat_template=None, pad=None)))
    assert tok.chat_template == MOONDREAM_TEMPLATE
    assert tok.pad_token_id is not None and tok.pad_token_id == tok.eos_token_id
    # moondream's prompt format, as documented: "\n\nQuestion: ...\n\nAnswer: ..." then EOS
    msgs = [{"role": "user", "content": "what shape is red"}, {"role": "assistant", "content": "circle"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "\n\nQuestion: what shape is red\n\nAnswer: circle<|im_end|>"
    enc = ConversationEncoder(tok, 100).encode([("user", "<image>\nwhat shape is red"), ("assistant", "circle")])
    assert enc.ids[0] == tok.eos_token_id  # no BOS: the sequence starts with EOS
    assert tok.decode(enc.ids[enc.target]).strip() == "circle<|im_end|>"
    assert tok.decode(enc.ids[1:][~enc.target[1:]]) == "\n\nQuestion: what shape is red\n\nAnswer:"


# ---- 3. overlong text ----------------------------------------------------------------------------

MULTI_MESSAGES = [("user" if t["from"] == "human" else "assistant", t["value"]) for t in MULTI_TURN]


def test_overlong_skip_and_truncate_policies():
    tok = builtin_tokenizer()
    want_toks, want_mask = builtin_expected(MULTI_MESSAGES)
    want_ids = tok.convert_tokens_to_ids(want_toks)
    n, first = len(want_toks), want_mask.index(True)
    assert first + 1 < n - 1  # the cases below are distinct

    fits = ConversationEncoder(tok, n, "skip").encode(MULTI_MESSAGES)
    assert fits.ids.tolist() == want_ids and not fits.truncated

    with pytest.raises(BadRecord) as e:
        ConversationEncoder(tok, n - 1, "skip").encode(MULTI_MESSAGES)
    assert e.value.kind == "too_long"

    for text_len in (n - 1, first + 1):  # cut, with the first answer token still inside
        enc = ConversationEncoder(tok, text_len, "truncate").encode(MULTI_MESSAGES)
        assert enc.truncated
        assert enc.ids.tolist() == want_ids[:text_len]
        assert enc.target.tolist() == want_mask[:text_len]
        assert enc.target.any()

    with pytest.raises(BadRecord) as e:  # even the first answer token would be cut
        ConversationEncoder(tok, first, "truncate").encode(MULTI_MESSAGES)
    assert e.value.kind == "too_long"


def test_overlong_policy_through_data(tmp_path):
    export_shapes(tmp_path, "pairs-csv", 1)
    short = [{"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"image": "images/00000.png", "conversations": short},       # fits
        {"image": "images/00000.png", "conversations": MULTI_TURN},  # longer: truncated
        {"image": "images/00000.png", "conversations":               # answer starts past text_len
         [{"from": "human", "value": "<image>\nhow many shapes are there how many shapes are there"},
          {"from": "gpt", "value": "one"}]}])
    text_len = len(builtin_expected([(t["from"], t["value"]) for t in short])[0]) + 1
    for policy, good, truncated in (("skip", [0], 0), ("truncate", [0, 1], 1)):
        run, samples = load(tmp_path / policy, path, "--text-len", str(text_len), "--overlong", policy)
        stats = samples.index.stats
        assert sorted(samples.index.rows.tolist()) == good, policy
        assert stats["truncated"] == truncated
        assert stats["bad_by_kind"] == {"too_long": 3 - len(good)}
        bad = [json.loads(line) for line in (tmp_path / policy / "run/data/bad_records.jsonl").read_text().splitlines()]
        assert [b["kind"] for b in bad] == ["too_long"] * (3 - len(good))
        assert bad[-1]["where"].endswith("mixed.jsonl:3")
        for n in range(len(samples.index)):
            ids, target = entry_tokens(samples, n)
            assert len(ids) <= text_len and target.any()
            item = item_of_row(run, samples, int(samples.index.rows[n]))
            assert len(item["input_ids"]) == run.model.vision.n_tokens + text_len
            check_labels(item, ids, target, run.model.vision.n_tokens)


# ---- 4. text-only records ------------------------------------------------------------------------

def test_text_only_llava_records(tmp_path):
    export_shapes(tmp_path, "pairs-csv", 1)
    text_only = [{"from": "human", "value": "what shape is red"}, {"from": "gpt", "value": "circle"}]
    path = write_jsonl(tmp_path / "text.jsonl", [
        {"id": "t", "conversations": text_only},
        {"id": "i", "image": "images/00000.png", "conversations": MULTI_TURN[:2]}])
    run, samples = load(tmp_path, path)
    assert samples.index.stats["good"] == 2 and samples.index.stats["with_image"] == 1
    size = run.model.vision.image_size
    item = item_of_row(run, samples, 0)
    assert item["has_image"].tolist() == [0]
    assert torch.equal(item["pixels"], torch.zeros(1, 3, size, size))
    n = samples.index.rows.tolist().index(0)
    ids, target = entry_tokens(samples, n)
    want_toks, want_mask = builtin_expected([(t["from"], t["value"]) for t in text_only])
    assert run.data.tokenizer.convert_ids_to_tokens(ids.tolist()) == want_toks
    assert target.tolist() == want_mask
    check_labels(item, ids, target, run.model.vision.n_tokens)
    with_image = item_of_row(run, samples, 1)
    assert with_image["has_image"].tolist() == [1] and with_image["pixels"].abs().sum() > 0


def test_video_records_are_bad_records_for_image_families(tmp_path):
    """A record carrying a video (a 'video' / 'videos' field or a <video> marker) is refused for a family that
    reads images only (all but the Qwen2-VL and Qwen3-VL families: Family.media), counted and listed with its
    reason: before, its text trained silently without the clip. In a LLaVA conversation and in an image-text pair
    (a video caption), for the moondream and LLaVA families."""
    export_shapes(tmp_path, "pairs-csv", 1)
    text_only = [{"from": "human", "value": "what shape is red"}, {"from": "gpt", "value": "circle"}]
    with_marker = [{"from": "human", "value": "<video>\nwhat happens"}, {"from": "gpt", "value": "circle"}]
    path = write_jsonl(tmp_path / "video.jsonl", [
        {"id": "t", "conversations": text_only},
        {"id": "v", "video": "clips/a.mp4", "conversations": text_only},
        {"id": "m", "conversations": with_marker},
        {"id": "i", "image": "images/00000.png", "videos": ["clips/b.mp4"], "conversations": MULTI_TURN[:2]}])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"image": "images/00000.png", "text": "circle"},
                                                  {"video": "clips/a.mp4", "text": "a red circle moves"}])
    for preset, data, good, refused in (("small", path, [0], [2, 3, 4]), ("llava-tiny", path, [0], [2, 3, 4]),
                                        ("small", pairs, [0], [2])):
        run, samples = load(tmp_path / preset / data.stem, data, "--preset", preset)
        assert samples.index.rows.tolist() == good, (preset, data.name)
        assert samples.index.stats["bad_by_kind"] == {"unsupported_media": len(refused)}
        bad = [json.loads(line) for line in
               (tmp_path / preset / data.stem / "run/data/bad_records.jsonl").read_text().splitlines()]
        assert [int(b["where"].rsplit(":", 1)[1]) for b in bad] == refused
        family = run.model.family
        assert all(b["kind"] == "unsupported_media" and f"the {family} family reads image only" in b["reason"]
                   for b in bad), bad
        assert "a <video> marker" in bad[1]["reason"] if data == path else "'video' field" in bad[0]["reason"]


# ---- 5. tokenizer directory errors ---------------------------------------------------------------

@pytest.mark.parametrize("case", ["file", "missing", "empty_dir", "garbage_dir"])
def test_load_tokenizer_errors_are_one_line(tmp_path, case):
    path = tmp_path / "tok"
    if case == "file":
        path.write_text("{}")
    elif case == "empty_dir":
        path.mkdir()
    elif case == "garbage_dir":
        path.mkdir()
        (path / "tokenizer.json").write_text("not json {")
        (path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--tokenizer:") and str(path) in msg
    # and through the front door's checks, as one of its one-line problems
    export_shapes(tmp_path / "d", "llava-jsonl", 1)
    with pytest.raises(ConfigError) as e:
        resolve(TrainArgs.from_argv(["--data", str(tmp_path / "d/train.jsonl"), "--tokenizer", str(path),
                              "--output-dir", str(tmp_path / "run")]), 2)
    assert msg in str(e.value).splitlines()
