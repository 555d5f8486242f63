"""A task from a data set and a reward function, no class to write (``task.kind: dataset``).

The data set is read with the Hugging Face ``datasets`` library from

- a local file: ``.jsonl`` (one record per line), ``.json`` (a list of records), ``.csv`` or
  ``.parquet``; such a file holds one split, ``train``;
- a local folder of such files: ``datasets`` names the splits after the files (``train.jsonl`` and
  ``test.jsonl`` give ``train`` and ``test``; a folder with one file has only ``train``);
- a Hub id such as ``openai/gsm8k`` with its config (``task.dataset_config: main``), loaded with
  ``datasets.load_dataset(id, config)``. This needs the network or the local ``datasets`` cache:
  without network it fails at once, in one line (with ``HF_HUB_OFFLINE=1`` it uses the cache only).
  With ``MARFT_DATA_DIR`` set, the data sets that :mod:`marft.envs.sources` knows local copies of
  (``openai/gsm8k``, ``HuggingFaceH4/MATH-500``, ...) are read from that folder instead, with the
  Hub's columns (``question`` and ``answer`` for GSM8K), and never from the Hub.

Splits: ``task.train_split`` / ``task.test_split`` (default ``train`` / ``test``) name the splits
the team trains and is evaluated on; ``datasets``' slice syntax works too (``train[:90%]``,
``train[-200:]``). When the data set has **no** ``test`` split and ``test_split`` is left at
``test``, and the data set has only the one split ``train_split`` (a single file), the last tenth
of its records (rounded up, at least one) is held out as the test split and the rest is the train
split, in file order: shuffle a sorted file first, or name the splits yourself (``test_split:
train`` evaluates on the training records).

Each episode is one record: its ``task.prompt_column`` (default ``question``, a non-empty string)
is shown to the team; answering agents also get ``instruction`` (``task.options: {instruction:
...}``, default "Give the final answer in \\boxed{}.", ``""`` for none).

The reward (``task.reward``: ``"package.module:function"`` or ``"path/to/file.py:function"``)::

    def reward(reply: str, record: dict) -> float:

is called once per answering agent per step with ``reply``, that agent's whole reply text in that
step, and ``record``, a fresh ``dict`` of the record's columns (every column, not only the prompt
and ``task.answer_column``, with the values as ``datasets`` read them: a column of numbers is ints
or floats). It returns a finite number or a bool (True = 1.0); anything else, or an exception,
fails that episode with a one-line error naming the function. The step's team reward is the mean
over answering agents (as for every :class:`~marft.envs.base.TurnBasedEnv`); a reply counts as
solved (``success``, and the end of a multi-turn episode) when its reward is at least
``task.success_threshold`` (default 1.0). ``extracted`` is True for a non-empty reply (a reward
function does not say whether it could read an answer).

A reward function written for TRL's trainers (a parameter ``completions``, none ``reply``)::

    def accuracy(completions, answer, **kwargs) -> list[float]:

is called as TRL calls it, one reply at a time (:class:`TRLReward`): ``prompts``, ``completions``
and the record's columns as lists of one value, its list of one number the reward.

Data sets are loaded once per process and settings and shared by the environment instances of a
rollout; reward functions are imported once per process.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
import os
import random
import re
import threading
from typing import Any, Callable

from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.errors import UserError

HOLDOUT = 10  # a single-split data set holds out its last 1/HOLDOUT (rounded up) as its test split
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
DEFAULT_INSTRUCTION = "Give the final answer in \\boxed{}."
LOCAL_HINT = "use a local file or folder instead: task.dataset=path/to/train.jsonl (.jsonl, .json, .csv, .parquet)"

_LOCK = threading.Lock()
_DATA: dict[tuple, dict[str, Any]] = {}  # (source, settings) -> {"train": Dataset, "test": Dataset}
_REWARDS: dict[tuple, tuple[Callable, bool]] = {}  # (spec, file stamp) -> (the function, written for TRL)


# --- loading ---------------------------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")


def _root(e: BaseException) -> BaseException:
    """The informative exception behind ``datasets``' wrappers (DatasetGenerationError ...)."""
    while type(e).__name__ in ("DatasetGenerationError",) and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__
    return e


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars and no log lines from ``datasets`` while it loads (restored afterwards)."""
    import datasets

    level = datasets.utils.logging.get_verbosity()
    bars_off = datasets.utils.are_progress_bars_disabled()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.utils.logging.set_verbosity(level)
        if not bars_off:
            datasets.enable_progress_bars()


def _offline() -> bool:
    flags = (os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if any(flags):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hint(repo_id: str) -> str:
    """How to do without the Hub: the local copies' folder where marft knows one, or a local file."""
    from marft.envs.sources import DATA_DIR_ENV, LOCAL_COPIES

    return (f"set {DATA_DIR_ENV} to a folder of local copies, or {LOCAL_HINT}" if repo_id in LOCAL_COPIES else LOCAL_HINT)


def _check_hub_reachable(repo_id: str, hint: str = "") -> None:
    """Fail at once when the Hub cannot be reached (``datasets`` would retry for about 25 s, printing
    a line per retry); offline mode is left to ``datasets``, which then reads its cache. ``hint``
    says how to do without the Hub (default: the dataset task's ``task.dataset=path``)."""
    from marft.errors import hub_unreachable

    endpoint, why = hub_unreachable()
    if why:
        raise UserError(f"data set {repo_id!r} is a Hub id, but the Hub ({endpoint}) cannot be reached "
                        f"({why}); {hint or _hint(repo_id)}, or set HF_HUB_OFFLINE=1 to use the "
                        "local Hugging Face datasets cache")


def _source(spec: str) -> tuple[str, str, tuple]:
    """("file" | "folder" | "hub", path or id, a stamp that changes when local data changes)."""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in BUILDERS:
            raise UserError(f"data set file {spec!r} must end in .jsonl, .json, .csv or .parquet (or give a folder of such files)")
        st = os.stat(path)
        blank = st.st_size == 0
        if not blank and ext != ".parquet" and st.st_size <= 65536:
            with open(path, "rb") as f:
                blank = not f.read().strip()
        if blank:
            raise UserError(f"data set file {spec!r} is empty; give a file with at least one record")
        return "file", path, (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if os.path.isdir(path):
        stamp = []
        for root, _, files in os.walk(path):
            for f in sorted(files):
                st = os.stat(os.path.join(root, f))
                stamp.append((os.path.join(root, f), st.st_mtime_ns, st.st_size))
        return "folder", path, (os.path.abspath(path), tuple(sorted(stamp)))
    looks_local = (spec.startswith((".", "/", "~")) or os.path.splitext(spec)[1].lower() in BUILDERS
                   or spec.count("/") > 1 or "\\" in spec)
    if looks_local:
        raise UserError(f"data set file {spec!r} does not exist; set task.dataset to a .jsonl, .json, .csv or .parquet "
                        "file, a folder of them, or a Hub id like openai/gsm8k")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", spec):
        raise UserError(f"data set {spec!r} not found: not a file, not a folder and not a Hub id like openai/gsm8k; "
                        "set task.dataset to a .jsonl, .json, .csv or .parquet file, a folder of them, or a Hub id")
    return "hub", spec, (spec,)


def _load(kind: str, where: str, config: str, split: str | None, hint: str = ""):
    """``datasets.load_dataset`` for one source: a DatasetDict (``split`` None) or one Dataset.
    ``hint`` says how to do without the Hub, in messages (default: ``task.dataset=path``)."""
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise UserError(f"task.kind dataset needs the datasets library, which is not installed: pip install 'datasets>=3' ({e})") from None
    if kind == "hub" and not _offline():
        _check_hub_reachable(where, hint)
    with _quiet_datasets() as ds:
        try:
            if kind == "file":
                builder = BUILDERS[os.path.splitext(where)[1].lower()]
                return ds.load_dataset(builder, data_files=where, split=split)
            if kind == "folder":
                return ds.load_dataset(where, split=split)
            return ds.load_dataset(where, config or None, split=split)
        except Exception as e:  # noqa: BLE001 - whatever datasets raises about the user's data
            err = _root(e)
            if kind == "hub" and isinstance(err, ConnectionError) and _offline():
                raise UserError(f"data set {where!r} is not in the local Hugging Face datasets cache and HF_HUB_OFFLINE "
                                f"is set; {hint or _hint(where)}") from None
            if split is not None and "Unknown split" in str(err):
                fix = "name one of them in the hf: reference" if hint else "set task.train_split / task.test_split to its splits"
                raise UserError(f"data set {where!r} has no split {split!r} ({' '.join(str(err).split())}); {fix}") from None
            what = f"data set {where!r}" + (f" (config {config!r})" if kind == "hub" and config else "")
            fix = "; fix the file" if kind == "file" else "; fix the files" if kind == "folder" else ""
            raise UserError(f"cannot load {what}: {_one_line(err)}{fix}") from None


def hub_records(ref, key: str = "") -> list[tuple[str, dict]]:
    """``(where, record)`` of an ``hf:`` reference (:class:`marft.envs.sources.HubRef`), read with
    ``datasets`` (every split in turn when it names none); ``key`` names the config key in messages."""
    from marft.envs.sources import hub_hint

    data = _load("hub", ref.repo, ref.config, ref.split or None, hint=hub_hint(ref.repo, key))
    parts = [data] if ref.split else [data[name] for name in data]
    return [(f"record {i}", dict(r)) for i, r in enumerate(r for part in parts for r in part)]


def _check_columns(spec: str, split: str, data, prompt_column: str, answer_column: str) -> None:
    """``split`` names the split for messages: ``train split``, ``test split 'validation'`` ..."""
    columns = list(data.column_names)
    for key, col in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if col and col not in columns:
            extra = ", or task.answer_column='' if the reward needs no answer column" if key == "answer_column" else ""
            raise UserError(f"data set {spec!r}: the {split} has no column {col!r} (its columns: {', '.join(columns)}); "
                            f"set task.{key} to one of them{extra}")
    if len(data) == 0:
        raise UserError(f"data set {spec!r}: the {split} has no records; give a data set with at least one")
    for i, value in enumerate(data[prompt_column]):
        if not isinstance(value, str) or not value.strip():
            got = "an empty prompt" if value is None or isinstance(value, str) else f"a {type(value).__name__}, not text,"
            raise UserError(f"data set {spec!r}: record {i} of the {split} has {got} in column {prompt_column!r}; "
                            "fix or remove that record")


def load_splits(dataset: str, dataset_config: str = "", train_split: str = "train", test_split: str = "test",
                prompt_column: str = "question", answer_column: str = "answer") -> dict[str, Any]:
    """``{"train": Dataset, "test": Dataset}`` for these settings (see the module docstring for the
    held-out test split); loaded and checked once per process. Raises :class:`UserError`."""
    if not dataset:
        raise UserError("task.kind dataset needs task.dataset: a Hub id (openai/gsm8k) or a .jsonl, .json, .csv or .parquet file or folder")
    if not prompt_column:
        raise UserError("task.prompt_column is empty; name the column that holds the prompt (default: question)")
    from marft.envs.sources import local_dataset, local_stamp

    kind, where, stamp = _source(dataset)
    if kind == "hub":
        stamp = (*stamp, local_stamp(where, dataset_config))  # MARFT_DATA_DIR's copy, if it is read
    key = (stamp, dataset_config if kind == "hub" else "", train_split, test_split, prompt_column, answer_column)
    with _LOCK:
        if key in _DATA:
            return _DATA[key]
    local = local_dataset(where, dataset_config, [train_split, test_split]) if kind == "hub" else None
    splits = local if local is not None else _load(kind, where, dataset_config, None)
    names = list(splits)
    held_out = local is None and test_split == "test" and "test" not in splits and names == [train_split]
    if held_out:
        full = splits[train_split]
        _check_columns(dataset, f"{train_split} split", full, prompt_column, answer_column)  # record numbers of the file
        n = len(full)
        if n < 2:
            raise UserError(f"data set {dataset!r} has 1 record and no test split, too few to hold one out; "
                            "add records, or set task.test_split=train to evaluate on the training records")
        k = -(-n // HOLDOUT)  # ceil(n / 10) without floats
        out = {"train": full.select(range(n - k)), "test": full.select(range(n - k, n))}
    else:
        out = {}
        for role, name in (("train", train_split), ("test", test_split)):
            if name in splits:
                out[role] = splits[name]
            elif "[" in name:
                out[role] = _load(kind, where, dataset_config, name)
            else:
                raise UserError(f"data set {dataset!r} has no split {name!r} (its splits: {', '.join(names)}); "
                                f"set task.{role}_split to one of them")
        for role, name in (("train", train_split), ("test", test_split)):
            label = f"{role} split" + ("" if name == role else f" ({name!r})")
            _check_columns(dataset, label, out[role], prompt_column, answer_column)
    with _LOCK:
        _DATA[key] = out
    return out


# --- the reward --------------------------------------------------------------------------------------

def load_reward(spec: str, prompt_column: str = "question") -> Callable[[str, dict], Any]:
    """The function named by ``"package.module:function"`` or ``"path/to/file.py:function"``, as a
    ``reward(reply, record)``: a TRL-style reward function (a parameter ``completions``, none
    ``reply``) wrapped by :class:`TRLReward`, whose ``prompts`` are the records' ``prompt_column``.

    Raises :class:`UserError` when the spec is malformed, the module cannot be imported, it has no
    such attribute, the attribute is not callable, or it cannot be called as ``reward(reply, record)``
    (nor, TRL-style, with the keywords marft passes).
    """
    from marft.envs.check import import_user_module

    if not isinstance(spec, str):
        raise UserError(f"task.reward must be one 'package.module:function' or 'path/to/file.py:function', got {spec!r}; "
                        "for several (TRL's reward_funcs), write one function that returns their weighted sum")
    module_name, _, attr = (spec or "").rpartition(":")
    if not module_name or not attr:
        raise UserError(f"task.reward {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    is_file = module_name.endswith(".py") or "/" in module_name or os.sep in module_name
    stamp = ()
    if is_file and os.path.isfile(module_name):
        st = os.stat(module_name)
        stamp = (os.path.abspath(module_name), st.st_mtime_ns, st.st_size)
    with _LOCK:
        if (spec, stamp) in _REWARDS:
            return _styled(*_REWARDS[(spec, stamp)], prompt_column)
    try:
        module = import_user_module(module_name, "marft_user_reward_")
    except UserError as e:
        raise UserError(f"task.reward {spec!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        listed = f" (its functions: {', '.join(found)})" if found else ""
        raise UserError(f"task.reward {spec!r}: module {module_name!r} has no function {attr!r}{listed}; check the name after ':'")
    if not callable(fn):
        raise UserError(f"task.reward {spec!r} is a {type(fn).__name__}, not a function reward(reply, record)")
    if inspect.iscoroutinefunction(fn):
        raise UserError(f"task.reward {spec!r} is an async function; marft calls reward functions as plain functions: "
                        "define it with def, not async def")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None  # some builtins have no signature: their calls will tell
    trl = sig is not None and TRLReward.written_for_trl(sig)
    if trl:
        TRLReward.check(sig, spec, attr)
    elif sig is not None:
        try:
            sig.bind("reply", {})
        except TypeError:
            raise UserError(f"task.reward {spec!r} must take two arguments, reward(reply, record) (or, as a TRL reward "
                            f"function, completions and **kwargs); its signature is {attr}{sig}") from None
    with _LOCK:
        _REWARDS[(spec, stamp)] = (fn, trl)
    return _styled(fn, trl, prompt_column)


def _styled(fn: Callable, trl: bool, prompt_column: str) -> Callable[[str, dict], Any]:
    return TRLReward(fn, prompt_column) if trl else fn


class TRLReward:
    """A reward function written for TRL's trainers, called as TRL calls it, one reply at a time::

        def accuracy(completions, answer, **kwargs) -> list[float]:

    with the keywords ``prompts`` (the record's prompt column, as text), ``completions`` (the reply,
    as text: TRL's standard format, not its conversational one) and every column of the record,
    each a list of one value (as TRL passes a batch's columns); keywords the function does not take
    are left out unless it has ``**kwargs``. What it returns for that one reply (a list, a tuple, an
    array: anything TRL iterates) holds the reward. TRL's ``completion_ids``, ``trainer_state``,
    ``log_extra``, ``log_metric`` and ``environments`` are not passed; ``async`` functions are
    refused when loaded, and so (by :meth:`check_columns`) are required parameters that are no
    column of the data set."""

    GIVEN = ("prompts", "completions")

    @staticmethod
    def written_for_trl(sig: inspect.Signature) -> bool:
        """TRL's reward functions take ``completions``; marft's, ``reply`` (and a parameter named
        ``completions`` beside ``reply`` leaves a function marft's)."""
        return "completions" in sig.parameters and "reply" not in sig.parameters

    def __init__(self, fn: Callable, prompt_column: str):
        self.fn, self.prompt_column = fn, prompt_column
        params = inspect.signature(fn).parameters
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.names = set(params)

    @staticmethod
    def _needed(sig: inspect.Signature) -> list[str]:
        """The parameters a call must give (no default, not ``*args``/``**kwargs``)."""
        return [n for n, p in sig.parameters.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @staticmethod
    def check(sig: inspect.Signature, spec: str, attr: str) -> None:
        """A :class:`UserError` when the function needs what marft does not pass."""
        needed = TRLReward._needed(sig)
        if any(sig.parameters[n].kind is inspect.Parameter.POSITIONAL_ONLY for n in needed):
            raise UserError(f"task.reward {spec!r} looks like a TRL reward function (it takes completions) but has "
                            f"positional-only parameters; TRL and marft call it by keyword: {attr}{sig}")
        missing = [n for n in needed if n in ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")]
        if missing:
            raise UserError(f"task.reward {spec!r} needs {missing[0]}, which marft does not pass to a TRL reward function "
                            f"(it passes prompts, completions and the record's columns); give it a default: {attr}{sig}")

    def check_columns(self, spec: str, columns: list[str]) -> None:
        """A :class:`UserError` when the data set has a column TRL's keywords would collide with, or
        the function requires a parameter that is no column (TRL fails there too, at its first call)."""
        clash = [c for c in columns if c in self.GIVEN]
        if clash:
            raise UserError(f"task.reward {spec!r} is a TRL reward function, called with prompts= and completions=, but "
                            f"the data set has a column {clash[0]!r} too; rename that column")
        missing = [n for n in self._needed(inspect.signature(self.fn)) if n not in self.GIVEN and n not in columns]
        if missing:
            raise UserError(f"task.reward {spec!r} takes {missing[0]!r}, which is no column of the data set (its columns: "
                            f"{', '.join(columns)}); a TRL reward function gets the columns by name")

    def __call__(self, reply: str, record: dict) -> Any:
        given = {"prompts": [record.get(self.prompt_column)], "completions": [reply],
                 **{k: [v] for k, v in record.items() if k not in self.GIVEN}}
        if not self.takes_all:
            given = {k: v for k, v in given.items() if k in self.names}
        value = self.fn(**given)
        if hasattr(value, "tolist"):  # a NumPy array or a tensor
            value = value.tolist()
        if not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__"):
            value = list(value)
            if len(value) != 1:
                raise ValueError(f"a TRL reward function returns one reward per completion; for one completion it "
                                 f"returned {len(value)} values")
            value = value[0]
            if value is None:
                raise ValueError("returned [None] (TRL's 'not applicable', which it skips); marft needs a number for every reply")
        return value


def score_reply(fn: Callable, spec: str, reply: str, record: dict, where: str, agents: list[str] | None = None):
    """``fn(reply, record)`` as a float; a UserError naming ``spec`` if it raises or returns
    anything but a finite number or a bool. ``where`` says which record (for the message). With
    ``agents``, a mapping ``{agent: number}`` (per-agent rewards, agents among ``agents``) is
    accepted too and returned as ``{agent: float}``."""
    try:
        value = fn(reply, record)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's function (sys.exit() in it too)
        raise UserError(f"task.reward {spec} raised {_one_line(e)} on {where}") from e
    if agents is not None and isinstance(value, dict):
        unknown = [k for k in value if k not in agents]
        if not value or unknown:
            raise UserError(f"task.reward {spec} returned rewards for {unknown or 'no agent'} on {where}; "
                            f"per-agent rewards are {{agent: number}} for agents of the team ({', '.join(agents)})")
        return {k: _number(v, spec, where) for k, v in value.items()}
    return _number(value, spec, where)


def _number(value, spec: str, where: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise UserError(f"task.reward {spec} returned {value!r} ({type(value).__name__}) on {where}; "
                        "it must return a finite number or a bool")
    return float(value)


# --- the environment ---------------------------------------------------------------------------------

class DatasetEnv(TurnBasedEnv):
    """A team answers one record of a data set per episode, judged by a reward function.

    Keyword arguments (the ``task.*`` keys of the same names; see the module docstring):
    ``dataset``, ``reward``, ``dataset_config``, ``train_split``, ``test_split``, ``prompt_column``,
    ``answer_column``, ``success_threshold`` and ``instruction`` (from ``task.options``).
    ``reset(options={"split": s, "index": i})`` gives record ``i`` of split ``s`` ("train" or
    "test"); without an index the record is drawn with the reset seed.
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1, *, dataset: str = "",
                 reward: str = "", dataset_config: str = "", train_split: str = "train", test_split: str = "test",
                 prompt_column: str = "question", answer_column: str = "answer", success_threshold: float = 1.0,
                 instruction: str = DEFAULT_INSTRUCTION):
        super().__init__(agents, answering, horizon)
        if not reward:
            raise UserError("task.kind dataset needs task.reward: 'package.module:function' or 'path/to/file.py:function', "
                            "called as reward(reply, record) -> float")
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, numbers.Real) \
                or not math.isfinite(success_threshold):
            raise UserError(f"task.success_threshold must be a finite number, got {success_threshold!r}")
        if not isinstance(instruction, str):
            raise UserError(f"task.options instruction must be text, got {instruction!r}")
        self.data = load_splits(dataset, dataset_config, train_split, test_split, prompt_column, answer_column)
        self.reward_fn = load_reward(reward, prompt_column)
        if isinstance(self.reward_fn, TRLReward):
            self.reward_fn.check_columns(reward, list(self.data["train"].column_names))
        self.dataset, self.reward, self.splits = dataset, reward, {"train": train_split, "test": test_split}
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.success_threshold = float(success_threshold)
        self.instruction = instruction

    def _split(self, split: str):
        if split not in self.data:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return self.data[split]

    def num_problems(self, split: str) -> int | None:
        """How many records the split holds."""
        return len(self._split(split))

    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        data = self._split(split)
        if index is None:
            index = rng.randrange(len(data))
        elif not 0 <= index < len(data):
            raise UserError(f"problem index {index} is out of range: the {split} split of {self.dataset!r} has {len(data)} records")
        record = dict(data[index])
        answer = record.get(self.answer_column) if self.answer_column else None
        return Problem(prompt=record[self.prompt_column], answer=answer,
                       meta={"split": split, "index": index, "record": record})

    def answer_instruction(self) -> str:
        return self.instruction

    def observe(self, agent: str) -> str:
        text = super().observe(agent)
        return text[:-2] if agent in self.answering and not self.instruction and text.endswith("\n\n") else text

    def grade(self, problem: Problem, reply: str) -> Grade:
        where = f"record {problem.meta['index']} of the {problem.meta['split']} split"
        score = score_reply(self.reward_fn, self.reward, reply, dict(problem.meta["record"]), where)
        solved = score >= self.success_threshold
        return Grade(correct=solved, extracted=bool((reply or "").strip()), answer=None, score=score)
