"""Shakespeare next-character prediction, built the way LEAF builds it.

One client per speaking role. A role's lines are joined into one string (newlines become
spaces, runs of two or more spaces collapse to one, as LEAF's ``txt_to_data`` does) and
every window of ``seq_length`` characters predicts the character after it. Each role's
windows are split in time: the first ``1 - test_fraction`` go to training, the test windows
start ``seq_length - 1`` positions later so that no test window shares text with a training
target (LEAF's ``split_data.py`` for shakespeare); roles without both parts are dropped.

Consecutive test windows overlap in all but one character, so scoring all of them costs
``seq_length`` LSTM steps per predicted character; ``test_stride`` keeps every k-th test window
of each role instead (``test_stride = seq_length``: non-overlapping inputs over the whole test text).

Two sources are read:

- LEAF's preprocessed JSON, ``<root>/shakespeare/data/{train,test}/*.json``;
- plain-text plays, one Project Gutenberg ``.txt`` per play, parsed into roles here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from .base import ArrayDataset, DatasetBundle

# LEAF's language_utils.py ALL_LETTERS; a character's class is its index in this string.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
# The 95 printable ASCII characters (space to tilde), the vocabulary size HAS-FL reports.
PRINTABLE = "".join(chr(c) for c in range(32, 127))
VOCABULARIES = {"leaf": ALL_LETTERS, "printable": PRINTABLE}
SEQ_LENGTH = 80
SOURCES = ("auto", "leaf", "plays")

# LEAF's letter_to_index returns -1 for characters outside ALL_LETTERS, which no embedding
# accepts; they map to the space instead (LEAF's own older preprocessing padded with ' ').
UNKNOWN_CHAR = " "


def letter_to_index(letter: str, vocabulary: str = ALL_LETTERS) -> int:
    """LEAF's ``letter_to_index``: the position of ``letter`` in the vocabulary (unknown: space)."""
    index = vocabulary.find(letter)
    return index if index >= 0 else vocabulary.index(UNKNOWN_CHAR)


def _lookup_table(vocabulary: str) -> np.ndarray:
    """Code point (< 65536) -> class index, unknown characters -> index of the space."""
    table = np.full(65536, vocabulary.index(UNKNOWN_CHAR), dtype=np.int64)
    for i, ch in enumerate(vocabulary):
        table[ord(ch)] = i
    return table


def encode(text: str, vocabulary: str = ALL_LETTERS) -> torch.Tensor:
    """A string as a LongTensor of class indices, one per character."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    codes = np.minimum(codes, 65535)  # characters beyond the BMP are unknown anyway
    return torch.from_numpy(_lookup_table(vocabulary)[codes])


def decode(indices: Sequence[int], vocabulary: str = ALL_LETTERS) -> str:
    """Class indices back to a string."""
    return "".join(vocabulary[int(i)] for i in indices)


def normalize_role_text(lines: Sequence[str]) -> str:
    """A role's lines as LEAF's ``txt_to_data`` sees them: one line each, newlines to spaces,
    runs of two or more spaces to one."""
    text = "".join(line + "\n" for line in lines).replace("\n", " ")
    return re.sub(r"   *", " ", text)


def windows(text_indices: torch.Tensor, seq_length: int = SEQ_LENGTH):
    """Every ``seq_length`` window and the index after it: ``x[i] = t[i:i+L]``, ``y[i] = t[i+L]``.

    ``x`` is a view into ``text_indices`` (no copy); ``len(t) - L`` windows, as LEAF.
    """
    n = len(text_indices) - seq_length
    if n <= 0:
        empty = text_indices.new_empty((0, seq_length))
        return empty, text_indices.new_empty((0,))
    x = text_indices.unfold(0, seq_length, 1)[:n]
    return x, text_indices[seq_length:]


def temporal_split(n: int, test_fraction: float, seq_length: int = SEQ_LENGTH):
    """LEAF's per-user split for shakespeare: ``(train range, test range)`` of window indices."""
    num_train = max(1, int((1.0 - test_fraction) * n))
    if n == 2:
        num_train = 1
    return range(0, num_train), range(num_train + seq_length - 1, n)


# ----------------------------------------------------------------------------------------
# Plain-text plays
# ----------------------------------------------------------------------------------------

# A heading that opens the acted text and ends any speech: "ACT I.", "SCENE 1.", "Scene I.--",
# "INDUCTION", "THE PROLOGUE", "EPILOGUE". Everything before the first one (title, persons
# represented) is skipped.
_HEADING_RE = re.compile(r"^(?:ACT|SCENE|INDUCTION|PROLOGUE|THE PROLOGUE|EPILOGUE)\b", re.IGNORECASE)
# A speaker's name: capitalised words or numerals ("First Lord", "MRS. PAGE", "1 Citizen",
# "Cor. and Volt.", "FALS, GADS., &C.") joined by a few lower-case particles. Requiring every
# other word to be capitalised keeps a short spoken line ("Come hither, sir.") from looking
# like a name.
_TOKEN = r"(?:[A-Z0-9][A-Za-z0-9'\-]*(?:\.(?=[\s,]))?|&[Cc](?:\.(?=[\s,]))?|&|and|of|the|de|du|la|le|to)"
_SPEAKER_RE = re.compile(rf"^(?P<name>{_TOKEN}(?:,?\s+{_TOKEN})*?)(?P<dot>\.)?(?:\s*\[[^\]]*\]?)?$")
_NUMERAL_RE = re.compile(r"^[IVXLC]+$")  # numbered stanzas of a song ("II.")
_MAX_NAME_LENGTH = 40
_DIRECTION_RE = re.compile(r"\[[^\]]*\]")


@dataclass
class ParsedPlay:
    """A play split into roles: role name -> spoken lines, in order of first appearance."""

    name: str
    roles: dict = field(default_factory=dict)


def _speaker(line: str) -> Optional[str]:
    """The speaker's name if ``line`` (stripped) is a speaker line, else None."""
    if len(line) > _MAX_NAME_LENGTH + 20:
        return None
    match = _SPEAKER_RE.match(line)
    if match is None:
        return None
    name = match.group("name")
    if len(name) > _MAX_NAME_LENGTH or _NUMERAL_RE.match(name):
        return None
    # Some plays (A Midsummer Night's Dream) write names in capitals without the period.
    if match.group("dot") is None and name != name.upper():
        return None
    return name


def role_key(name: str) -> str:
    """A name as a user key: upper case, each run of other characters one underscore."""
    return re.sub(r"[\W_]+", "_", name.upper()).strip("_")


def parse_play(text: str, name: str = "PLAY") -> ParsedPlay:
    """Split one Gutenberg play into roles and their spoken lines.

    Format (see ``data/shakespeare/README.md``): a speech starts with the speaker's name
    alone on a line after a blank line, ending in a period (``Ham.``, ``FIRST LORD.``,
    ``MRS. PAGE.``), optionally followed by a bracketed direction; its lines run until the
    next speaker or heading. A speech resumes after a stage direction (``[Exeunt ...]``),
    so lines after one stay with the current speaker. Stage directions in square brackets
    (also over several lines, and the odd brace typed for a bracket) are removed; act and scene
    headings end the current speech. Poems have no headings and give no roles.
    """
    roles: dict[str, list[str]] = {}
    started = False
    speaker: Optional[str] = None
    in_direction = False
    prev_blank = True
    # Braces only occur as typos for square brackets ("{Aside.]", "[Exeunt.}").
    text = text.replace("\r\n", "\n").replace("{", "[").replace("}", "]")
    for raw in text.split("\n"):
        line = raw.strip()
        if in_direction and line:
            # Inside a multi-line direction: skip to its closing bracket (a blank line also
            # ends it, so that an unclosed bracket cannot swallow the rest of the play).
            if "]" not in line:
                prev_blank = False
                continue
            in_direction = False
            line = line.split("]", 1)[1].strip()
            if not line:
                prev_blank = False
                continue
        if not line:
            prev_blank, in_direction = True, False
            continue
        after_blank, prev_blank = prev_blank, False
        if after_blank and _HEADING_RE.match(line):
            started, speaker = True, None
            continue
        if not started:
            continue
        if after_blank:
            name_ = _speaker(line)
            if name_ is not None:
                speaker = role_key(name_)
                continue
        spoken = _DIRECTION_RE.sub(" ", line)
        if "[" in spoken:
            # A direction opens here and closes on a later line.
            spoken, in_direction = spoken.split("[", 1)[0], True
        spoken = spoken.strip()
        if speaker and spoken:
            roles.setdefault(speaker, []).append(spoken)
    return ParsedPlay(name=name, roles=roles)


def play_files(plays_dir: str) -> dict[str, str]:
    """Play stem -> path for every ``*.txt`` in ``plays_dir`` (stems drop a ``_gut`` suffix)."""
    found = {}
    for entry in sorted(os.listdir(plays_dir)):
        if entry.endswith(".txt"):
            stem = entry[:-4]
            stem = stem[:-4] if stem.endswith("_gut") else stem
            found[stem] = os.path.join(plays_dir, entry)
    return found


# ----------------------------------------------------------------------------------------
# Building the dataset
# ----------------------------------------------------------------------------------------


@dataclass
class _Role:
    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def num_samples(self) -> int:
        return len(self.train_y) + len(self.test_y)


def _roles_from_plays(plays_dir, plays, vocabulary, seq_length, test_fraction, min_samples):
    files = play_files(plays_dir)
    stems = list(files) if plays is None else list(plays)
    roles = []
    for stem in stems:
        with open(files[stem], encoding="utf-8", errors="replace") as f:
            parsed = parse_play(f.read(), stem)
        play_key = role_key(stem)
        for role, lines in parsed.roles.items():
            x, y = windows(encode(normalize_role_text(lines), vocabulary), seq_length)
            n = len(y)
            if n < max(min_samples, 2):
                continue
            train, test = temporal_split(n, test_fraction, seq_length)
            if len(train) == 0 or len(test) == 0:
                continue
            roles.append(_Role(f"{play_key}_{role}", x[train.start:train.stop], y[train.start:train.stop],
                               x[test.start:test.stop], y[test.start:test.stop]))
    return roles


def _leaf_files(leaf_dir: str, split: str) -> list[str]:
    folder = os.path.join(leaf_dir, split)
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".json")]


def _read_leaf_split(leaf_dir: str, split: str) -> dict[str, dict]:
    users: dict[str, dict] = {}
    for path in _leaf_files(leaf_dir, split):
        for user, data in _read_leaf_file(path).items():
            users[user] = data
    return users


def _read_leaf_file(path: str) -> dict[str, dict]:
    """``{user: {"x": [...], "y": [...]}}`` of one LEAF JSON file, or a ConfigError naming it."""
    hint = "regenerate it with LEAF's preprocess.sh"
    try:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
    except UnicodeDecodeError as error:
        raise _corrupt(path, f"not UTF-8 text (byte {error.start})", hint) from None
    except json.JSONDecodeError as error:
        raise _corrupt(path, f"not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
                             "a truncated or interrupted copy?", hint) from None
    except OSError as error:
        raise _corrupt(path, f"cannot be read ({error.strerror or error})", hint) from None
    if (not isinstance(blob, dict) or not isinstance(blob.get("users"), list)
            or not isinstance(blob.get("user_data"), dict)):
        raise _corrupt(path, "not a LEAF data file (expected 'users': [...] and 'user_data': {...})", hint)
    out = {}
    for user in blob["users"]:
        data = blob["user_data"].get(user) if isinstance(user, str) else None
        if (not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list)
                or not all(isinstance(v, str) for v in data["x"]) or not all(isinstance(v, str) for v in data["y"])):
            raise _corrupt(path, f"user {user!r} has no 'user_data' entry with string lists 'x' and 'y'", hint)
        out[user] = data
    return out


def _corrupt(path: str, problem: str, hint: str) -> ConfigError:
    return ConfigError("data.root", f"{path}: {problem}; {hint}")


def _encode_leaf(xs: Sequence[str], ys: Sequence[str], vocabulary: str, seq_length: int, where: str):
    if any(len(s) != seq_length for s in xs):
        raise ConfigError("data.dataset.seq_length",
                          f"LEAF JSON in {where} holds windows that are not {seq_length} characters long")
    if len(ys) != len(xs) or any(len(s) != 1 for s in ys):
        raise ConfigError("data.root", f"LEAF JSON in {where}: 'y' must hold one character per 'x' window")
    x = encode("".join(xs), vocabulary).view(len(xs), seq_length)
    y = encode("".join(ys), vocabulary)
    return x, y


def _roles_from_leaf(leaf_dir, vocabulary, seq_length, min_samples):
    train, test = _read_leaf_split(leaf_dir, "train"), _read_leaf_split(leaf_dir, "test")
    roles = []
    for user, data in train.items():
        tx, ty = _encode_leaf(data["x"], data["y"], vocabulary, seq_length, leaf_dir)
        held = test.get(user, {"x": [], "y": []})
        vx, vy = _encode_leaf(held["x"], held["y"], vocabulary, seq_length, leaf_dir)
        role = _Role(user, tx, ty, vx, vy)
        if len(ty) > 0 and role.num_samples >= min_samples:
            roles.append(role)
    return roles


def _largest(roles: list, max_roles: Optional[int]) -> list:
    """The ``max_roles`` roles with most samples (HAS-FL: "the twenty roles with the largest
    amount of dialogue"), kept in their original order."""
    if max_roles is None or max_roles >= len(roles):
        return roles
    ranked = sorted(range(len(roles)), key=lambda i: (-roles[i].num_samples, roles[i].name))
    keep = set(ranked[:max_roles])
    return [r for i, r in enumerate(roles) if i in keep]


def _concat(parts: list, seq_length: int):
    """Concatenate per-role (x, y) and return the tensors plus each role's indices (a
    LongTensor per role: millions of Python ints would cost seconds and memory)."""
    xs = [p[0] for p in parts]
    ys = [p[1] for p in parts]
    groups, start = [], 0
    for y in ys:
        groups.append(torch.arange(start, start + len(y)))
        start += len(y)
    x = torch.cat(xs) if xs else torch.empty((0, seq_length), dtype=torch.long)
    y = torch.cat(ys) if ys else torch.empty((0,), dtype=torch.long)
    return x, y, groups


def resolve_source(root: str, source: str = "auto", plays_dir: Optional[str] = None):
    """``("leaf", dir)`` or ``("plays", dir)``: where the Shakespeare data is read from."""
    leaf_dir = os.path.join(root, "shakespeare", "data")
    plays_dir = plays_dir or os.path.join(root, "shakespeare")
    if source == "leaf" or (source == "auto" and _leaf_files(leaf_dir, "train")):
        return "leaf", leaf_dir
    return "plays", plays_dir


def check_shakespeare(root: str = "data", download: bool = False, *, source: str = "auto",
                      plays_dir: Optional[str] = None, plays: Optional[Sequence[str]] = None,
                      min_samples_per_role: int = 64, max_roles: Optional[int] = None,
                      test_fraction: float = 0.2, vocabulary: str = "leaf",
                      seq_length: int = SEQ_LENGTH, test_stride: int = 1) -> None:
    """That the chosen source is on disk and agrees with the options, without parsing it (each
    option's own range is its type's in ``fl_lightning.data.Shakespeare``)."""
    kind, where = resolve_source(root, source, plays_dir)
    if kind == "leaf":
        if not _leaf_files(where, "train"):
            raise ConfigError("data.root", f"no LEAF Shakespeare JSON under '{where}': expected "
                              f"{where}/train/*.json and {where}/test/*.json (LEAF's preprocess.sh output)")
        if int(seq_length) != SEQ_LENGTH:
            raise ConfigError("data.dataset.seq_length",
                              f"LEAF JSON windows are {SEQ_LENGTH} characters; use source: plays for other lengths")
        return
    if not os.path.isdir(where) or not play_files(where):
        raise ConfigError("data.root", f"no Shakespeare data under '{root}': expected LEAF JSON at "
                          f"{root}/shakespeare/data/{{train,test}}/*.json or plain-text plays at "
                          f"{where}/<play>.txt (one Project Gutenberg text per play); "
                          "it cannot be downloaded automatically")
    if plays is not None:
        if isinstance(plays, str):
            raise ConfigError("data.dataset.plays", "must be a list of play names, not a string")
        missing = sorted(set(plays) - set(play_files(where)))
        if missing:
            raise ConfigError("data.dataset.plays", f"unknown plays {missing}; found: {', '.join(play_files(where))}")


def load_shakespeare(root: str = "data", download: bool = False, augment: bool = True, *,
                     source: str = "auto", plays_dir: Optional[str] = None,
                     plays: Optional[Sequence[str]] = None, min_samples_per_role: int = 64,
                     max_roles: Optional[int] = None, test_fraction: float = 0.2,
                     vocabulary: str = "leaf", seq_length: int = SEQ_LENGTH,
                     test_stride: int = 1) -> DatasetBundle:
    """Shakespeare next-character prediction, one group of training windows per role.

    ``source``: ``auto`` (LEAF JSON if present, else plays), ``leaf`` or ``plays``.
    ``plays_dir``: folder of plain-text plays (default ``<root>/shakespeare``); ``plays``:
    play stems to use (file name without ``.txt``/``_gut.txt``; default all).
    ``min_samples_per_role``: drop roles with fewer windows (LEAF's ``-k``), before the split.
    ``max_roles``: keep only the roles with the most windows. ``test_fraction``: LEAF's
    temporal per-role split (plays only; LEAF JSON comes split). ``vocabulary``: ``leaf``
    (LEAF's 80 characters) or ``printable`` (95 printable ASCII characters).
    ``test_stride``: keep test windows ``0, k, 2k, ...`` of each role (1: all of them, LEAF);
    roles are chosen and the split made before it, so it thins the test set and nothing else.
    ``download`` and ``augment`` have no effect.
    """
    check_shakespeare(root, download, source=source, plays_dir=plays_dir, plays=plays,
                      min_samples_per_role=min_samples_per_role, max_roles=max_roles,
                      test_fraction=test_fraction, vocabulary=vocabulary, seq_length=seq_length,
                      test_stride=test_stride)
    vocab = VOCABULARIES[vocabulary]
    seq_length = int(seq_length)
    kind, where = resolve_source(root, source, plays_dir)
    if kind == "leaf":
        roles = _roles_from_leaf(where, vocab, seq_length, int(min_samples_per_role))
    else:
        roles = _roles_from_plays(where, plays, vocab, seq_length, float(test_fraction), int(min_samples_per_role))
    roles = _largest(roles, max_roles)
    if not roles:
        raise ConfigError("data.dataset.min_samples_per_role",
                          f"no role in '{where}' has {min_samples_per_role} or more windows and text enough for "
                          f"both a training and a test part (test windows start {seq_length - 1} "
                          "after the last training one)")
    train_x, train_y, groups = _concat([(r.train_x, r.train_y) for r in roles], seq_length)
    k = int(test_stride)
    test_x, test_y, test_groups = _concat([(r.test_x[::k], r.test_y[::k]) for r in roles], seq_length)
    train = ArrayDataset(train_x, train_y)
    return DatasetBundle(
        name="shakespeare",
        train=train,
        train_eval=train,
        test=ArrayDataset(test_x, test_y),
        train_targets=train.targets,
        num_classes=len(vocab),
        input_shape=(seq_length,),
        groups=groups,
        group_names=[r.name for r in roles],
        task="next_char",
        extras={"vocabulary": vocab, "source": kind, "test_groups": test_groups},
    )
