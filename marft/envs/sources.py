"""Where the benchmark data comes from: a file, a Hugging Face Hub data set, or a local copy of one.

``task.train_path`` and ``task.test_path`` (the ``math`` and ``code`` tasks) each name either

- a file: ``.json`` (a list of records) or ``.jsonl`` (one record per line); or
- a Hub data set, ``hf:REPO[:CONFIG[:SPLIT]]``: the arguments of ``datasets.load_dataset(REPO,
  CONFIG, split=SPLIT)`` joined by colons, e.g. ``hf:openai/gsm8k:main:train``. An empty CONFIG
  (``hf:HuggingFaceH4/MATH-500::test``) is the data set's default; without SPLIT every split is read,
  one after the other (``hf:google-research-datasets/mbpp:full``: the code task splits MBPP by task id).

A Hub data set is read with ``datasets`` (the network, or its cache with ``HF_HUB_OFFLINE=1``), unless
the environment variable ``MARFT_DATA_DIR`` names a folder of local copies: then the data sets of
:data:`LOCAL_COPIES` are read from the files listed there, relative to that folder, and never from the
Hub (other Hub ids are still read from the Hub)::

    $MARFT_DATA_DIR/gsm8k/train.json     openai/gsm8k (config main), split train
    $MARFT_DATA_DIR/gsm8k/test.json      openai/gsm8k (config main), split test
    $MARFT_DATA_DIR/math/train.json      DigitalLearningGmbH/MATH-lighteval, split train
    $MARFT_DATA_DIR/math/test500.jsonl   HuggingFaceH4/MATH-500, split test
    $MARFT_DATA_DIR/mbpp/mbpp.jsonl      google-research-datasets/mbpp (config full), every split

Each file may also end in the other of ``.json`` (a list of records) and ``.jsonl`` (one per line;
the name listed is read first) and hold its records in the Hub's shape (``Dataset.to_json`` writes
it) or in the original releases'; the loaders read both (:func:`marft.envs.math.math_record`,
:func:`marft.envs.code.mbpp_problem`). The ``dataset`` task (``task.dataset: openai/gsm8k``) reads
the same copies, with the Hub's columns (:func:`local_dataset`).

Whatever goes wrong (the folder or a file missing, no local copy of a split, the Hub unreachable)
is one :class:`~marft.errors.UserError` line that names the fix.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable

from marft.errors import UserError

DATA_DIR_ENV = "MARFT_DATA_DIR"
PREFIX = "hf:"
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


@dataclass(frozen=True)
class HubRef:
    """``hf:REPO[:CONFIG[:SPLIT]]``; an empty split means every split."""

    repo: str
    config: str = ""
    split: str = ""

    def __str__(self) -> str:
        return PREFIX + ":".join([self.repo, self.config, self.split]).rstrip(":")


def parse_hub(spec: str) -> HubRef | None:
    """The Hub reference ``spec`` names, or None when it is no ``hf:`` reference (a file path)."""
    if not isinstance(spec, str) or not spec.startswith(PREFIX):
        return None
    parts = spec[len(PREFIX):].split(":")
    if len(parts) > 3 or not _REPO.fullmatch(parts[0]) or any(not re.fullmatch(r"[\w.-]*", p) for p in parts[1:]):
        raise UserError(f"{spec!r} is not a Hub data set reference; write hf:owner/name[:config[:split]], "
                        "e.g. hf:openai/gsm8k:main:train, a split's name without a slice (or give a .json or .jsonl file)")
    return HubRef(*parts)


# --- the Hub's shape of the local copies -------------------------------------------------------------------

def gsm8k_answer(answer: str) -> str | None:
    """The final answer of a GSM8K worked solution (``... #### 1,080`` -> ``1080``), or None if it
    has no ``####`` line. Thousands separators are dropped, as in the original release's
    ``final_answer``."""
    m = re.search(r"(?:^|\n)####\s*(.*?)\s*$", answer or "", re.S)
    if not m or not m.group(1):
        return None
    gold = m.group(1)
    return gold.replace(",", "") if _THOUSANDS.fullmatch(gold) else gold


def _gsm8k_hub(r: dict) -> dict:
    if "question" in r:
        return {"question": r["question"], "answer": r.get("answer")}
    return {"question": r.get("problem"), "answer": r.get("answer_with_process") or f"#### {r.get('final_answer')}"}


def _mbpp_split(r: dict) -> str:
    """MBPP's splits by task id (the Hub's ``full`` config has the same): 11-510 test, 511-600
    validation, 601-974 train, 1-10 prompt."""
    i = r.get("task_id")
    if not isinstance(i, int):
        return ""
    return "prompt" if i <= 10 else "test" if i <= 510 else "validation" if i <= 600 else "train"


@dataclass(frozen=True)
class LocalCopy:
    """The files of a Hub data set's local copy under ``MARFT_DATA_DIR``."""

    files: dict  # split -> file under the folder ("" = one file with every split); .json and .jsonl both do
    configs: tuple  # the Hub configs it copies ("" = the default config)
    split_of: Callable[[dict], str] | None = None  # a one-file copy: the split a record is in
    to_hub: Callable[[dict], dict] | None = None  # a record with the Hub's columns (the dataset task)
    note: str = field(default="", compare=False)


LOCAL_COPIES: dict[str, LocalCopy] = {
    "openai/gsm8k": LocalCopy({"train": "gsm8k/train.json", "test": "gsm8k/test.json"}, ("main",), to_hub=_gsm8k_hub),
    "DigitalLearningGmbH/MATH-lighteval": LocalCopy({"train": "math/train.json"}, ("", "default")),
    "HuggingFaceH4/MATH-500": LocalCopy({"test": "math/test500.jsonl"}, ("", "default")),
    "google-research-datasets/mbpp": LocalCopy({"": "mbpp/mbpp.jsonl"}, ("", "full"), split_of=_mbpp_split),
}


def _candidates(folder: str, name: str) -> list[str]:
    """The file ``name`` under ``folder``, then the same with the other extension (.json / .jsonl)."""
    stem, ext = os.path.splitext(name)
    return [os.path.join(folder, name), os.path.join(folder, stem + (".jsonl" if ext == ".json" else ".json"))]


def data_dir() -> str | None:
    """``MARFT_DATA_DIR``, checked to be a folder; None when it is unset or empty."""
    d = os.environ.get(DATA_DIR_ENV, "").strip()
    if not d:
        return None
    if not os.path.isdir(os.path.expanduser(d)):
        raise UserError(f"{DATA_DIR_ENV}={d} is not a folder; set it to the folder of local data set copies "
                        f"(gsm8k/train.json, math/test500.jsonl, mbpp/mbpp.jsonl, ...) or unset it to read the Hub")
    return os.path.expanduser(d)


def _layout(copy: LocalCopy) -> str:
    return ", ".join(name + (f" ({split})" if split else "") for split, name in copy.files.items())


def local_files(ref: HubRef, key: str = "") -> list[str] | None:
    """The local copy's file(s) of ``ref`` under ``MARFT_DATA_DIR`` (every split's file, in
    order, for a reference without a split), or None when ``ref`` is to be read from the Hub (the
    variable is unset, or no local copy of that data set is known). ``key`` names the config key
    that holds ``ref`` in messages (``task.train_path``)."""
    folder = data_dir()
    copy = LOCAL_COPIES.get(ref.repo)
    if folder is None or copy is None:
        return None
    fix = f"unset {DATA_DIR_ENV} to read the Hub, or give a file: {key or 'task.train_path'}=path/to/file.jsonl"
    if ref.config not in copy.configs:
        held = " or ".join(repr(c) for c in copy.configs if c) or "its default"
        raise UserError(f"{ref}: {DATA_DIR_ENV} holds {ref.repo} config {held} only, not {ref.config!r}; "
                        f"name that config, {fix}")
    if ref.split and ref.split not in copy.files and "" not in copy.files:
        raise UserError(f"{ref}: {DATA_DIR_ENV} has no local copy of {ref.repo} split {ref.split!r} "
                        f"(it holds {_layout(copy)}); {fix}")
    names = [copy.files[ref.split]] if ref.split in copy.files else [copy.files[""]] if "" in copy.files \
        else list(copy.files.values())
    paths = []
    for name in names:
        found = [p for p in _candidates(folder, name) if os.path.isfile(p)]
        if not found:
            raise UserError(f"{ref} is read from {DATA_DIR_ENV}={folder}, which has no {name}; "
                            f"put the local copy there, {fix}")
        paths.append(found[0])
    return paths


def stamp(paths: list[str]) -> tuple:
    """Changes when one of the files changes (a cache key)."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.abspath(p), st.st_mtime_ns, st.st_size))
    return tuple(out)


def in_split(ref: HubRef, record: dict) -> bool:
    """Whether a record of a one-file local copy is in ``ref``'s split (every record without a split)."""
    copy = LOCAL_COPIES.get(ref.repo)
    if not ref.split or copy is None or copy.split_of is None or ref.split in copy.files:
        return True
    return copy.split_of(record) == ref.split


def read_json_records(path: str, what: str) -> list[tuple[str, object]]:
    """``(where, record)`` of a ``.json`` list or a ``.jsonl`` file; ``what`` names the file in
    messages (``math data file``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise UserError(f"{what} {path!r} is empty; give a file with at least one record")
    if path.endswith(".jsonl"):
        raw = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    raw.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}: line {n} is not valid JSON ({e.msg}); fix or remove that line") from None
        return raw
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
        if not isinstance(data, list):
            raise UserError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return [(f"record {i}", r) for i, r in enumerate(data)]
    raise UserError(f"{what} {path!r} must end in .json (a list of records) or .jsonl (one per line)")


# --- the Hub -----------------------------------------------------------------------------------------------

def hub_hint(repo: str, key: str = "") -> str:
    """How to do without the Hub, for messages: the local copy (where one is known) or a file."""
    copy = LOCAL_COPIES.get(repo)
    local = f"set {DATA_DIR_ENV} to a folder of local copies (for {repo}: {_layout(copy)}), or " if copy else ""
    return f"{local}give a file: {key or 'task.train_path'}=path/to/file.jsonl"


def cached(ref: HubRef, key: str, cache: dict, from_hub: Callable[[], list], from_files: Callable[[list[str]], list]) -> list:
    """What ``ref`` holds, read once per source into ``cache``: ``from_files(paths)`` of
    MARFT_DATA_DIR's copy where it has one (keyed by the files' :func:`stamp`), else ``from_hub()``
    (:func:`marft.envs.dataset.hub_records`)."""
    files = local_files(ref, key)  # MARFT_DATA_DIR's copy, if it has one
    k = (str(ref), stamp(files)) if files is not None else (str(ref),)
    if k not in cache:
        cache[k] = from_hub() if files is None else from_files(files)
    return cache[k]


def local_dataset(repo: str, config: str, splits: list[str], key: str = "task.dataset"):
    """The ``dataset`` task's splits of ``repo`` from its local copy, as ``datasets.Dataset`` with
    the Hub's columns, by the names in ``splits`` (slices such as ``train[:90%]`` work); None when
    ``MARFT_DATA_DIR`` is unset or holds no copy of ``repo``."""
    copy = LOCAL_COPIES.get(repo)
    if data_dir() is None or copy is None:
        return None
    import datasets

    out = {}
    for name in dict.fromkeys(splits):
        base = name.split("[", 1)[0]
        ref = HubRef(repo, config, base)
        rows = []
        for path in local_files(ref, key) or []:
            rows += [r for _, r in read_json_records(path, "data set file") if isinstance(r, dict) and in_split(ref, r)]
        if copy.to_hub is not None:
            rows = [copy.to_hub(r) for r in rows]
        ds = datasets.Dataset.from_list(rows)
        if base != name:
            (rel,) = datasets.ReadInstruction.from_spec(name).to_absolute({base: len(ds)})
            ds = ds.select(range(rel.from_, rel.to))
        out[name] = ds
    return out


def local_stamp(repo: str, config: str) -> tuple:
    """A cache key part for the ``dataset`` task: the data folder and its copy's files, if used."""
    copy = LOCAL_COPIES.get(repo)
    folder = data_dir()
    if folder is None or copy is None:
        return ()
    paths = [p for name in copy.files.values() for p in _candidates(folder, name)]
    return (folder, stamp([p for p in paths if os.path.isfile(p)]))
