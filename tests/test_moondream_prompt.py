"""moondream2's tokenizer and prompt format (issue 17, item 5).

The expected ids are written out by hand from moondream's own TokenizerConfig and query()/caption()
(vikhyat/moondream at MOONDREAM_COMMIT, moondream/torch/config.py and moondream.py):
    bos_id = eos_id = 0, answer_id = 3
    query   prefix [1, 15381, 2], suffix [3]; query() without reasoning sends
            prefix + question + suffix and then appends the suffix again: ... question, 3, 3
    caption "normal" [1, 32708, 2, 6382, 3]
    decoding: the first answer token from the prompt's logits unmasked; every later step sets the
            logit of answer_id to -inf; generation ends at eos_id.
The real tokenizer (starmie-v1) cannot be downloaded here, so the tests build a word-level tokenizer
with the same special ids (<|endoftext|> = 0; 1, 2, 3 special; "query" at 15381 and "caption" at
32708) and save it as a directory holding only tokenizer.json, as a local copy of starmie-v1 is.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import ROOT
from mmpipe.cli import main
from mmpipe.config import ConfigError, load_preset
from mmpipe.data.args import DataArgs
from mmpipe.data.dataset import prepare_eval, resolve_data
from mmpipe.data.packing import FixedBlocks, RowShape, sample_sequence
from mmpipe.data.records import BadRecord
from mmpipe.data.text import ConversationEncoder, answer_id_of
from mmpipe.data.tokenizer import MOONDREAM, MOONDREAM_COMMIT, MOONDREAM_TEMPLATE, load_tokenizer, uses_moondream_ids
from mmpipe.hf.moondream import export_moondream
from mmpipe.inference import generate as gen_mod
from mmpipe.inference.generate import generate, generate_batch
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel
from mmpipe.model.rows import IMAGE_SLOT
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from moondream_ref import MOONDREAM_COMMIT as RECORDED_COMMIT

VOCAB = 32768
WORDS = {"what": 40, "colour": 41, "red": 42, "is": 43, "it": 44, "a": 45, "circle": 46, "blue": 47,
         "normal": 6382, "short": 12492, "long": 4059, "query": 15381, "caption": 32708}
Q, A = "what colour is it", "red"
Q_IDS, A_IDS = [40, 41, 43, 44], [42]
# moondream's query() ids for Q, by hand: BOS, prefix 1 15381 2, the question, suffix 3, suffix 3 again
QUERY = [0, 1, 15381, 2, *Q_IDS, 3, 3]
CAPTION = [0, 1, 32708, 2, 6382, 3]  # BOS, caption "normal"


def write_tokenizer(d: Path, eos: int | None = None) -> Path:
    """A starmie-like tokenizer directory: tokenizer.json only (eos None), or saved by transformers with
    eos_token at id `eos` (as the older moondream2 snapshots' GPT-2 tokenizer names its EOS 50256)."""
    names = [f"<|w{i}|>" for i in range(VOCAB)]
    names[0], names[VOCAB - 1] = "<|endoftext|>", "<unk>"
    for i in (1, 2, 3):
        names[i] = f"<|md{i}|>"
    for w, i in WORDS.items():
        names[i] = w
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(names[i], special=True) for i in (0, 1, 2, 3)])  # ids kept
    d.mkdir(parents=True, exist_ok=True)
    if eos is None:
        tok.save(str(d / "tokenizer.json"))
    else:
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=names[eos]).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("starmie"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(str(tok_dir), prompt_format="moondream")


def test_facts_are_the_recorded_commits():
    assert MOONDREAM_COMMIT == RECORDED_COMMIT == "44146f139242dacdf7c02b799e68097424a31036"
    assert (MOONDREAM.bos_id, MOONDREAM.eos_id, MOONDREAM.answer_id) == (0, 0, 3)
    assert (MOONDREAM.query_prefix, MOONDREAM.query_suffix) == ((1, 15381, 2), (3,))
    assert MOONDREAM.caption_normal == (1, 32708, 2, 6382, 3)


def test_query_sample_ids_and_labels_are_moondreams(tok):
    assert uses_moondream_ids(tok) and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 0, 0)
    enc = ConversationEncoder(tok, 40).encode([("user", "<image>\n" + Q), ("assistant", A)])
    assert enc.ids.tolist() == QUERY + A_IDS + [0]
    assert enc.target.tolist() == [False] * len(QUERY) + [True] * (len(A_IDS) + 1)  # the answer and EOS only
    assert ConversationEncoder(tok, 40).prompt_ids([("user", Q)]) == QUERY  # what generation continues from
    # in the row: image after BOS (16 positions for tiny), text token j predicted from n_img + j - 1
    input_ids, labels = sample_sequence(enc, 1, RowShape(1, 40, FixedBlocks(16, IMAGE_SLOT)))
    assert input_ids.tolist() == enc.ids[:1].tolist() + [IMAGE_SLOT] * 16 + enc.ids[1:].tolist()
    assert {int(p): int(v) for p, v in enumerate(labels) if v != -100} == {16 + 10 - 1: 42, 16 + 11 - 1: 0}


def test_caption_template_without_question_and_one_turn_only(tok):
    enc = ConversationEncoder(tok, 40).encode([("user", "<image>"), ("assistant", "a red circle")])
    assert enc.ids.tolist() == CAPTION + [45, 42, 46, 0]
    assert enc.target.tolist() == [False] * 6 + [True] * 4
    assert ConversationEncoder(tok, 40).prompt_ids([("user", "")]) == CAPTION
    with pytest.raises(BadRecord) as e:
        ConversationEncoder(tok, 40).encode([("user", Q), ("assistant", A), ("user", Q), ("assistant", "blue")])
    assert e.value.kind == "bad_turns" and "one question" in e.value.reason
    with pytest.raises(BadRecord) as e:  # 12 tokens do not fit 10
        ConversationEncoder(tok, 10).encode([("user", Q), ("assistant", A)])
    assert e.value.kind == "too_long"
    cut = ConversationEncoder(tok, 11, "truncate").encode([("user", Q), ("assistant", "red red")])
    assert cut.truncated and cut.ids.tolist() == QUERY + [42]


def test_tokenizer_loading_and_refusals(tok_dir, tmp_path):
    with pytest.raises(ConfigError, match="has no eos_token"):  # no format asked: a bare tokenizer.json names no EOS
        load_tokenizer(str(tok_dir))
    saved = tmp_path / "saved"
    load_tokenizer(str(tok_dir), "moondream").save_pretrained(saved)
    again = load_tokenizer(str(saved))  # the format travels with the saved tokenizer
    assert uses_moondream_ids(again) and answer_id_of(again) == 3
    chat = load_tokenizer(str(saved), "chat")  # asked for a chat template: the text fallback
    assert not uses_moondream_ids(chat) and chat.chat_template == MOONDREAM_TEMPLATE and answer_id_of(chat) is None
    with pytest.raises(Exception, match="token-id templates"):  # the marker is never rendered as text
        again.apply_chat_template([{"role": "user", "content": Q}], tokenize=False)
    with pytest.raises(ConfigError, match="EOS is id 7, but moondream's prompt format needs its starmie-v1"):
        load_tokenizer(str(write_tokenizer(tmp_path / "gpt2", eos=7)), "moondream")
    with pytest.raises(ConfigError, match="needs moondream's own tokenizer"):
        load_tokenizer(None, "moondream")
    small = tmp_path / "small"
    small.mkdir()
    t = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "x": 1}, unk_token="<|endoftext|>"))
    t.save(str(small / "tokenizer.json"))
    with pytest.raises(ConfigError, match="2 tokens, but moondream's prompt templates use ids up to 32708"):
        load_tokenizer(str(small), "moondream")


# ---- decoding: moondream's answer-id mask ---------------------------------------------------------

def _model(seed: int = 3) -> ReferenceModel:
    """tiny, moondream-family, with moondream's vocabulary room; its head prefers the answer marker 3 by
    far and then "circle" (46), so greedy decoding shows exactly where the mask applies."""
    model = ReferenceModel(load_preset("tiny").with_vocab(VOCAB), seed=seed)
    with torch.no_grad():
        model[-1].linear.bias[MOONDREAM.answer_id] = 100.0
        model[-1].linear.bias[WORDS["circle"]] = 50.0
    return model.eval()


def test_answer_id_is_masked_after_the_first_token():
    model, px = _model(), torch.zeros(1, 3, 32, 32)
    free = generate(model, px, QUERY, Sampling(eos_id=0, max_new_tokens=4))
    assert free == [3, 3, 3, 3]  # unmasked, the marker wins every step
    with_mask = Sampling(eos_id=0, max_new_tokens=4, answer_id=3)
    for use_cache in (True, False):  # moondream: the prompt's pick as it is, then never 3 again
        got = generate(model, px, QUERY, with_mask, use_cache=use_cache)
        assert got == [3, 46, 46, 46]
    # batched rows and sampling keep the mask (a sampled row never draws 3 after its first token)
    assert generate_batch(model, px.repeat(2, 1, 1, 1), [QUERY, CAPTION], with_mask) == [[3, 46, 46, 46]] * 2
    kw = dict(eos_id=0, max_new_tokens=8, temperature=50.0, top_k=3, seed=1)  # 3 likely, not certain
    free, masked = generate(model, px, QUERY, Sampling(**kw)), generate(model, px, QUERY, Sampling(answer_id=3, **kw))
    assert 3 in free[1:] and 3 not in masked[1:] and len(masked) == 8
    assert masked[0] == free[0]  # the first draw sees the same (unmasked) logits


# ---- the run: import --tokenizer, then generate, eval and --init-from use it ------------------------

def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tok_dir):
    d = tmp_path_factory.mktemp("md-run")
    model = _model()
    save_file(export_moondream(model, "current"), str(d / "md.safetensors"))
    (d / "tiny.json").write_text(json.dumps(model.cfg.to_dict()))
    rc, out, err = _cli("import", "--moondream", str(d / "md.safetensors"), "--preset", str(d / "tiny.json"),
                        "--tokenizer", str(tok_dir), "--out", str(d / "run"))
    assert rc == 0, err
    assert "tokenizer saved" in out
    Image.new("RGB", (40, 30), (200, 30, 30)).save(d / "red.png")
    (d / "recs.jsonl").write_text(json.dumps({"image": "red.png", "conversations": [
        {"from": "human", "value": "<image>\n" + Q}, {"from": "gpt", "value": A}]}) + "\n")
    return d


def test_import_keeps_the_tokenizer_and_generate_feeds_the_template(imported, monkeypatch):
    run = imported / "run"
    assert uses_moondream_ids(load_tokenizer(str(run / "tokenizer")))
    seen = []
    real = gen_mod._decode_rows

    def spy(model, pixels, ids, has_image, sampling, **kw):
        seen.append((ids.tolist(), sampling.answer_id))
        return real(model, pixels, ids, has_image, sampling, **kw)

    monkeypatch.setattr(gen_mod, "_decode_rows", spy)
    rc, out, err = _cli("generate", "--checkpoint", str(run), "--image", str(imported / "red.png"), "--prompt", Q,
                        "--max-new-tokens", "4")
    assert rc == 0, err
    assert seen == [([QUERY], 3)]  # the template's ids, and moondream's answer-id mask
    assert out.strip() == "circle circle circle"  # [3, 46, 46, 46]: the special 3 is not printed


def test_eval_and_init_from_use_the_runs_format(imported):
    run, answers = imported / "run", imported / "eval" / "answers.jsonl"
    rc, out, err = _cli("eval", "--checkpoint", str(run), "--data", str(imported / "recs.jsonl"), "--out", str(answers),
                        "--max-new-tokens", "3")
    assert rc == 0, err
    line = json.loads(answers.read_text().splitlines()[0])
    assert (line["reference"], line["answer"]) == ("red", "circle circle")  # masked after the first token (3)
    ds = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
    cfg = resolve(TrainArgs.from_argv(["--init-from", str(run), "--data", str(imported / "recs.jsonl")]),
                  world_size=2, ds_config=ds)
    enc = ConversationEncoder(cfg.data.tokenizer, cfg.data.text_len).encode([("user", Q), ("assistant", A)])
    assert enc.ids.tolist() == QUERY + A_IDS + [0]


def test_prompt_format_flag_on_the_data_path(imported, tok_dir):
    """--prompt-format moondream on a plain tokenizer directory: the index holds the template's ids."""
    args = DataArgs(data=str(imported / "recs.jsonl"), tokenizer=str(tok_dir), prompt_format="moondream")
    opts = resolve_data(args, _model().cfg)
    enc, has_image = prepare_eval(opts, _model().cfg, imported / "flag", seed=0, shapes=0, verbose=False).tokens(0)
    assert has_image and enc.ids.tolist() == QUERY + A_IDS + [0]
    with pytest.raises(ConfigError, match="--prompt-format moondream: the built-in shapes set"):
        resolve_data(DataArgs(prompt_format="moondream"), _model().cfg)


def test_import_refusals_write_nothing(imported, tmp_path):
    d = imported
    rc, _, err = _cli("import", "--moondream", str(d / "md.safetensors"), "--preset", str(d / "tiny.json"),
                      "--tokenizer", str(write_tokenizer(tmp_path / "gpt2", eos=7)), "--out", str(tmp_path / "r1"))
    assert rc == 2 and err.startswith("mmpipe: error: --tokenizer:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r1").exists()
    rc, _, err = _cli("import", "--hf", str(tmp_path), "--tokenizer", str(d), "--out", str(tmp_path / "r2"))
    assert rc == 2 and "--tokenizer: only with --moondream" in err
