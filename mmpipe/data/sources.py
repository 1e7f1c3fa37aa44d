"""Reading user data into Records: LLaVA conversations, image-text pairs, local HF datasets.

`--data` is a path or a data config (a JSON object with a "format" key). A source knows how
many raw records it has and turns raw record i into a Record or raises BadRecord; it never
decodes images (that is mmpipe.data.images' job) and never touches the network.

    llava   .json (array) or .jsonl: {"image": "rel/path.jpg", "conversations":
            [{"from": "human", "value": "<image>\\nQuestion"}, {"from": "gpt", "value": "Answer"}, ...]}
            "image" may be a list of paths: several images, one `<image>` marker each over the user
            turns, image k at the k-th marker (Record.images)
    pairs   .csv or .jsonl with an image column and a text column (captioning: the user turn is the
            record's prompt column if there is one, else the config's "prompt")
    hf      load_dataset("json" | "csv" | "parquet" | "imagefolder", data_files=...) or
            load_from_disk(dir); rows in either shape above, columns renamed by "columns"
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError
from .records import MEDIA_FIELDS, MEDIA_MARKERS, BadRecord, Record, VideoRef, carried_media, refuse_unread_media
from .text import IMAGE_MARKER

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
DEFAULT_PROMPT = "Describe the image."
DEFAULT_COLUMNS = {"image": "image", "conversations": "conversations", "text": "text", "prompt": "prompt"}
HF_BUILDERS = ("json", "csv", "parquet", "imagefolder")


@dataclass
class DataSpec:
    """What --data (and the flags beside it) name, resolved to absolute paths."""
    format: str                      # llava | pairs | hf
    path: str = ""                   # the data file (llava/pairs) or the dataset directory (load_from_disk)
    image_root: str = ""             # relative image paths start here (default: the data file's folder)
    builder: str = ""                # hf: json | csv | parquet | imagefolder; "" = load_from_disk(path)
    data_files: list[str] = field(default_factory=list)
    split: str = "train"
    columns: dict = field(default_factory=lambda: dict(DEFAULT_COLUMNS))
    prompt: str = DEFAULT_PROMPT

    def files(self) -> list[str]:
        """Every file whose content defines the data (for the index fingerprint)."""
        if self.data_files:
            return list(self.data_files)
        p = Path(self.path)
        return sorted(str(f) for f in p.rglob("*") if f.is_file()) if p.is_dir() else [self.path]


def _sniff_json_format(path: Path) -> str:
    """llava if the first parseable record has "conversations", else pairs."""
    with open(path, "rb") as f:
        head = f.read(1 << 20).decode("utf-8", errors="replace")
    if head.lstrip().startswith("["):
        return "llava" if '"conversations"' in head else "pairs"
    for line in head.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return "llava" if "conversations" in rec else "pairs"
    return "llava"


def data_spec(data: str, image_root: str | None = None) -> DataSpec:
    """--data PATH | CONFIG.json -> DataSpec, or ConfigError naming the problem."""
    p = Path(data)
    if not p.exists():
        raise ConfigError(f"--data: '{data}' is neither 'shapes' nor an existing file or directory")
    base = p.parent if p.is_file() else p
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            spec = DataSpec("hf", path=str(p.resolve()))
        else:
            spec = DataSpec("hf", builder="imagefolder", data_files=[str(p.resolve() / "**")])
    elif p.suffix == ".json" and _is_data_config(p):
        spec = _from_config(p)
    elif p.suffix == ".csv":
        spec = DataSpec("pairs", path=str(p.resolve()))
    elif p.suffix in (".json", ".jsonl"):
        spec = DataSpec(_sniff_json_format(p), path=str(p.resolve()))
    elif p.suffix == ".parquet":
        spec = DataSpec("hf", builder="parquet", data_files=[str(p.resolve())])
    else:
        raise ConfigError(f"--data: cannot tell the format of '{data}' (valid: .json/.jsonl LLaVA conversations or "
                          f"pairs, .csv pairs, .parquet, a saved HF dataset directory, an image folder, "
                          f"or a data config JSON with a \"format\" key)")
    if image_root:
        spec.image_root = str(Path(image_root).resolve())
    elif not spec.image_root:
        spec.image_root = str(base.resolve())
    if not Path(spec.image_root).is_dir():
        raise ConfigError(f"--image-root: {spec.image_root} is not a directory")
    return spec


CONFIG_MAX_BYTES = 1 << 20  # a data config is a few lines; a larger .json is data


def _is_data_config(p: Path) -> bool:
    """One JSON object with a top-level "format" key. Data is an array (LLaVA .json) or one object per
    line (.jsonl-style .json); the config's own values (columns {"conversations": ...}) never decide."""
    with open(p, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{") or b'"format"' not in head or p.stat().st_size > CONFIG_MAX_BYTES:
        return False
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        obj, end = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return True  # meant as a config: _from_config says where the JSON breaks
    return isinstance(obj, dict) and "format" in obj and not text.lstrip()[end:].strip()


def _from_config(p: Path) -> DataSpec:
    try:
        cfg = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--data: {p} is not valid JSON ({e})") from None
    base = p.parent.resolve()
    known = {"format", "path", "image_root", "builder", "data_files", "split", "columns", "prompt"}
    unknown = sorted(set(cfg) - known - {"_comment"})
    if unknown:
        raise ConfigError(f"--data: {p}: unknown key(s) {unknown} (valid: {', '.join(sorted(known))})")
    fmt = cfg.get("format")
    if fmt not in ("llava", "pairs", "hf"):
        raise ConfigError(f"--data: {p}: format {fmt!r} is not one of llava, pairs, hf")
    cols = cfg.get("columns", {})
    if not isinstance(cols, dict) or set(cols) - set(DEFAULT_COLUMNS):
        raise ConfigError(f"--data: {p}: columns must map some of {list(DEFAULT_COLUMNS)} to column names")
    builder = cfg.get("builder", "")
    if builder and builder not in HF_BUILDERS:
        raise ConfigError(f"--data: {p}: builder {builder!r} is not one of {', '.join(HF_BUILDERS)}")
    files = cfg.get("data_files", [])
    files = [files] if isinstance(files, str) else files
    path = str((base / cfg["path"]).resolve()) if cfg.get("path") else ""
    if fmt == "hf" and not (builder and files) and not path:
        raise ConfigError(f"--data: {p}: an hf source needs \"builder\" + \"data_files\", or \"path\" of a "
                          f"dataset saved with save_to_disk")
    if fmt != "hf" and not path:
        raise ConfigError(f"--data: {p}: format {fmt} needs \"path\"")
    for f in [path] if path else []:
        if not Path(f).exists():
            raise ConfigError(f"--data: {p}: path {f} does not exist")
    image_root = str((base / cfg["image_root"]).resolve()) if cfg.get("image_root") else ""
    return DataSpec(fmt, path=path, image_root=image_root,
                    builder=builder, data_files=[str((base / f).resolve()) for f in files],
                    split=cfg.get("split", "train"), columns={**DEFAULT_COLUMNS, **cols},
                    prompt=cfg.get("prompt", DEFAULT_PROMPT))


# ---- raw records -> Record --------------------------------------------------------------------

def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise BadRecord("missing_field", f"{what} is {'missing' if value is None else type(value).__name__}, not text")
    if any("\udc80" <= ch <= "\udcff" for ch in value):  # bytes decoded with surrogateescape
        raise BadRecord("bad_encoding", f"{what} is not valid UTF-8")
    return value


def conversation_record(where: str, raw: dict, images: list, columns: dict) -> Record:
    turns = raw.get(columns["conversations"])
    if not isinstance(turns, list) or not turns:
        raise BadRecord("missing_field", f"'{columns['conversations']}' is missing or not a non-empty list")
    messages = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRecord("missing_field", f"turn {k} is not an object")
        role_name = t.get("from", t.get("role"))
        if role_name is None:
            raise BadRecord("missing_field", f"turn {k} has no 'from' (or 'role')")
        role = ROLES.get(role_name)
        if role is None:
            raise BadRecord("unknown_role", f"turn {k} has role {role_name!r} (valid: {', '.join(ROLES)})")
        text = _text(t.get("value", t.get("content")), f"turn {k}'s 'value'")
        if role == "assistant" and not text.strip():
            raise BadRecord("empty_answer", f"turn {k} (assistant) is empty")
        messages.append((role, text))
    roles = [r for r, _ in messages]
    if roles[0] != "user" or any(a == b for a, b in zip(roles, roles[1:])) or "assistant" not in roles:
        raise BadRecord("bad_turns", f"turn roles {roles} do not alternate user/assistant from a user turn")
    while messages[-1][0] == "user":  # a trailing question without answer teaches nothing
        messages = messages[:-1]
    for k, (role, text) in enumerate(messages):
        if role == "assistant" and IMAGE_MARKER in text:  # it would be a placeholder inside an answer's labels
            raise BadRecord("image_marker", f"turn {k} (assistant) holds an {IMAGE_MARKER} marker; images go in "
                                            f"user turns")
    markers = sum(t.count(IMAGE_MARKER) for _, t in messages)
    if markers != len(images):
        raise BadRecord("image_marker", f"the record has {len(images)} image(s) but {markers} {IMAGE_MARKER} "
                                        f"marker(s) in its user turns (need one per image)")
    return Record(where, messages, images)


def with_videos(raw: dict, columns: dict, images: list, videos: list) -> tuple[dict, list]:
    """A conversation's clips among its images: (raw with each <video> marker made an <image> one, the media in the
    order of their markers, a clip a VideoRef), so the encoder, the index and the rows place a clip where its marker
    is, as an image. BadRecord video_marker where the <video> markers and the clips disagree in number, or a marker
    is in an answer."""
    turns = raw.get(columns["conversations"])
    if not isinstance(turns, list):
        return raw, images  # conversation_record says what is wrong
    video, image = MEDIA_MARKERS["video"], MEDIA_MARKERS["image"]
    order, new_turns = [], []
    for k, t in enumerate(turns):
        text = t.get("value", t.get("content")) if isinstance(t, dict) else None
        if not isinstance(text, str):
            new_turns.append(t)
            continue
        if video in text and ROLES.get(t.get("from", t.get("role"))) == "assistant":
            raise BadRecord("video_marker", f"turn {k} (assistant) holds a {video} marker; videos go in user turns")
        at = 0
        while (i := min((j for j in (text.find(image, at), text.find(video, at)) if j >= 0), default=-1)) >= 0:
            order.append("video" if text.startswith(video, i) else "image")
            at = i + 1
        key = "value" if "value" in t else "content"
        new_turns.append({**t, key: text.replace(video, image)})
    if order.count("video") != len(videos):
        raise BadRecord("video_marker", f"the record has {len(videos)} video(s) but {order.count('video')} {video} "
                                        f"marker(s) in its user turns (need one per video)")
    pending_images, pending_videos, media = list(images), [VideoRef(v) for v in videos], []
    for kind in order:
        pool = pending_videos if kind == "video" else pending_images
        if pool:
            media.append(pool.pop(0))
    # images beyond their markers stay (conversation_record counts them against the markers and refuses)
    return {**raw, columns["conversations"]: new_turns}, media + pending_images


def image_list(value, what: str) -> list:
    """A record's image field -> its image references: none ("" / null / []), one, or a list of several."""
    if value in ("", None):
        return []
    if not isinstance(value, list):
        return [_text(value, what) if isinstance(value, str) else value]
    for k, v in enumerate(value):
        if v in ("", None):
            raise BadRecord("missing_field", f"{what}[{k}] is empty")
        if isinstance(v, str):
            _text(v, f"{what}[{k}]")
    return list(value)


def pair_record(where: str, raw: dict, images: list, columns: dict, default_prompt: str) -> Record:
    caption = _text(raw.get(columns["text"]), f"'{columns['text']}'")
    if not caption.strip():
        raise BadRecord("empty_answer", f"'{columns['text']}' (the caption) is empty")
    prompt = raw.get(columns["prompt"])
    prompt = default_prompt if prompt in (None, "") else _text(prompt, f"'{columns['prompt']}'")
    if not images:
        raise BadRecord("missing_field", f"'{columns['image']}' is missing: an image-text pair needs an image")
    if len(images) > 1:
        raise BadRecord("missing_field", f"'{columns['image']}' lists {len(images)} images: an image-text pair takes "
                                         f"one (several images need a conversation with one {IMAGE_MARKER} each)")
    return Record(where, [("user", prompt), ("assistant", caption)], images)


class Source:
    """Raw records by number; record(i) -> Record or BadRecord. Subclasses fill self.where/raw."""
    spec: DataSpec

    def __len__(self) -> int:
        raise NotImplementedError

    def raw(self, i: int) -> tuple[str, dict]:
        raise NotImplementedError

    def record(self, i: int, media: tuple[str, ...] | None = None, family: str = "") -> Record:
        """media: what the model family reads (Family.media), checked where the index is built; None (a record
        the index already took) checks nothing more."""
        where, raw = self.raw(i)
        try:
            if not isinstance(raw, dict):
                raise BadRecord("missing_field", f"record is a {type(raw).__name__}, not an object")
            if media is not None:
                refuse_unread_media(raw, self.spec.columns, media, family)
            images = image_list(raw.get(self.spec.columns["image"]), f"'{self.spec.columns['image']}'")
            has_conv = self.spec.columns["conversations"] in raw
            conversation = self.spec.format == "llava" or (self.spec.format == "hf" and has_conv)
            if media is None or "video" in media:  # a family that reads clips (refused above for the others)
                names = (self.spec.columns.get("video", MEDIA_FIELDS["video"][0]), *MEDIA_FIELDS["video"][1:])
                videos = [v for n in names for v in image_list(raw.get(n), f"'{n}'")]
                if videos and not conversation:
                    raise BadRecord("unsupported_media", "a video in an image-text pair is not read yet: give it as a "
                                                         "conversation with a <video> marker")
                if videos or (conversation and "video" in carried_media(raw, self.spec.columns)):  # or a marker
                    raw, images = with_videos(raw, self.spec.columns, images, videos)
            if conversation:
                return conversation_record(where, raw, images, self.spec.columns)
            return pair_record(where, raw, images, self.spec.columns, self.spec.prompt)
        except BadRecord as e:
            e.where = where
            raise


class JsonLinesSource(Source):
    """One record per line; only (byte offset, length, line number) are kept, lines are read on
    demand with os.pread: no shared file offset, so forked DataLoader workers that inherit the
    descriptor cannot move each other's reads (seek + readline there read wrong records)."""

    def __init__(self, spec: DataSpec):
        self.spec, self.lines = spec, []
        with open(spec.path, "rb") as f:
            pos = 0
            for n, line in enumerate(f, 1):
                if line.strip():
                    self.lines.append((pos, len(line), n))
                pos += len(line)
        self._fd = None

    def __len__(self):
        return len(self.lines)

    def __getstate__(self):  # workers started by pickling open their own descriptor
        return {**self.__dict__, "_fd": None}

    def raw(self, i):
        if self._fd is None:
            self._fd = os.open(self.spec.path, os.O_RDONLY)
        offset, length, n = self.lines[i]
        line = os.pread(self._fd, length, offset)
        where = f"{self.spec.path}:{n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(where, "bad_encoding", f"line is not valid UTF-8 ({e.reason} at byte {e.start})")
        try:
            return where, json.loads(text)
        except ValueError as e:
            raise _bad(where, "bad_json", f"line is not valid JSON ({e})")


def _bad(where: str, kind: str, reason: str) -> BadRecord:
    e = BadRecord(kind, reason)
    e.where = where
    return e


def _read_text(path: str) -> str:
    """The file as text; bytes that are not UTF-8 become lone surrogates, which _text() refuses
    per record instead of failing the whole file."""
    return Path(path).read_bytes().decode("utf-8", errors="surrogateescape")


class JsonArraySource(Source):
    def __init__(self, spec: DataSpec):
        self.spec = spec
        try:
            self.records = json.loads(_read_text(spec.path))
        except ValueError as e:
            raise ConfigError(f"--data: {spec.path} is not valid JSON ({e}); a file with one record per line "
                              f"should be named .jsonl") from None
        if not isinstance(self.records, list):
            raise ConfigError(f"--data: {spec.path} must hold a JSON array of records")

    def __len__(self):
        return len(self.records)

    def raw(self, i):
        return f"{self.spec.path}[{i}]", self.records[i]


class CsvSource(Source):
    def __init__(self, spec: DataSpec):
        self.spec = spec
        reader = csv.DictReader(io.StringIO(_read_text(spec.path), newline=""))
        self.rows = [(reader.line_num, row) for row in reader]
        header = reader.fieldnames or []
        need = [spec.columns["image"], spec.columns["text"]]
        if any(c not in header for c in need):
            raise ConfigError(f"--data: {spec.path}: the header {header} lacks column(s) "
                              f"{[c for c in need if c not in header]} (rename them with a data config's \"columns\")")

    def __len__(self):
        return len(self.rows)

    def raw(self, i):
        line, row = self.rows[i]
        where = f"{self.spec.path}:{line}"
        if None in row or None in row.values():  # more or fewer fields than the header
            raise _bad(where, "missing_field", f"row has {len(row) - (None in row) + len(row.get(None) or [])} "
                                               f"fields, the header has {len(row) - (None in row)}")
        return where, row


class HFSource(Source):
    """A local `datasets` Dataset. Image columns are read undecoded ({"bytes", "path"}) so that a
    corrupt image becomes a BadRecord here rather than an exception inside `datasets`."""

    def __init__(self, spec: DataSpec):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for the hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets
        self.spec = spec
        try:
            if spec.builder:
                ds = datasets.load_dataset(spec.builder, data_files=spec.data_files, split=spec.split)
            else:
                ds = datasets.load_from_disk(spec.path)
                if isinstance(ds, datasets.DatasetDict):
                    if spec.split not in ds:
                        raise ConfigError(f"--data: {spec.path} has splits {list(ds)}, not '{spec.split}'")
                    ds = ds[spec.split]
        except ConfigError:
            raise
        except Exception as e:  # datasets raises many types for unreadable inputs
            raise ConfigError(f"--data: cannot load {spec.path or spec.data_files} with datasets: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        image_col = spec.columns["image"]
        if image_col in ds.features and isinstance(ds.features[image_col], datasets.Image):
            ds = ds.cast_column(image_col, datasets.Image(decode=False))
        self.ds, self.name = ds, spec.path or ",".join(spec.data_files)

    def __len__(self):
        return len(self.ds)

    def raw(self, i):
        return f"{self.name.removesuffix('/**')}[{i}]", self.ds[i]


def open_source(spec: DataSpec) -> Source:
    if spec.format == "hf":
        return HFSource(spec)
    if spec.path.endswith(".csv"):
        return CsvSource(spec)
    if spec.path.endswith(".jsonl"):
        return JsonLinesSource(spec)
    return JsonArraySource(spec)
