"""Run-folder files that must survive a kill at any moment: checkpoints and metrics.jsonl.

A checkpoint ``<run>/checkpoints/iter_NNNNNN/`` is written into a temporary folder, fsynced and
renamed; only then does ``checkpoints/latest`` (itself written atomically) name it, so a run killed
while saving resumes from the previous one. ``metrics.jsonl`` gets one fsynced line per iteration;
on resume the lines after the checkpoint's iteration (written by the run that was killed) are cut.
What goes into a checkpoint is the trainer's business (:meth:`marft.run.trainer.Trainer.save`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from ..errors import UserError


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (what ``checkpoints/latest`` names), or None
    (also when ``latest`` is empty or names no checkpoint folder: :func:`no_checkpoint_reason` says why)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    name = _pointer_name(pointer)
    if not name:
        return None
    path = pointer.parent / name
    return path if path.is_dir() else None


def _pointer_name(pointer: Path) -> str | None:
    """The checkpoint name ``checkpoints/latest`` holds: None if it is not a readable file, "" if
    it holds nothing usable (empty, not text, or not a plain folder name)."""
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return name if name and "/" not in name and "\\" not in name and name not in (".", "..") else ""


def saved_checkpoints(root: Path) -> list[str]:
    """Names of the checkpoint folders under ``root`` (``checkpoints/``) that hold a trainer state."""
    return sorted(p.name for p in root.glob("iter_*") if (p / "trainer.pt").is_file()) if root.is_dir() else []


def no_checkpoint_reason(run_dir: str | Path) -> str:
    """Why ``run_dir`` has no checkpoint to resume from or load (one clause, naming the file that
    is wrong and how to fix it), for a run folder where :func:`latest_checkpoint` gives None."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    saved = saved_checkpoints(root)
    fix = (f"write the name of one that is there ({', '.join(saved[-3:])}) into {pointer}" if saved
           else f"{root} holds no checkpoint folder; start a new run")
    name = _pointer_name(pointer)
    if name == "":
        return f"{pointer} does not name a checkpoint (it is empty or not a folder name such as iter_000002); {fix}"
    if name:
        return f"{pointer} names checkpoint {name}, which is missing from {root}; {fix}"
    if pointer.exists():
        return f"{pointer} is a folder, not the file that names the newest checkpoint; {fix}"
    if (run_dir / "trainer.pt").is_file() and run_dir.parent.name == "checkpoints":
        return f"{run_dir} is a checkpoint, not a run folder; give the run folder {run_dir.parent.parent}"
    if saved:
        return f"{run_dir} has no {pointer.relative_to(run_dir)} naming its newest checkpoint; {fix}"
    return f"{run_dir} has no complete checkpoint to resume from (expected {pointer})"


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint that resuming ``run_dir`` continues from, or a :class:`UserError` saying
    what is wrong with ``run_dir`` (missing, a file, no checkpoint, a ``latest`` naming nothing)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UserError(f"run folder {run_dir} not found; resume takes the output_dir of an earlier marft train run")
    if not run_dir.is_dir():
        new = f" (to start a new run from this config file: marft train {run_dir})" if run_dir.suffix in (".yaml", ".yml") else ""
        raise UserError(f"{run_dir} is a file, not a run folder; resume takes the output_dir of an earlier marft train run{new}")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(no_checkpoint_reason(run_dir))
    if not (ckpt / "config.yaml").is_file():
        raise UserError(f"checkpoint {ckpt} has no config.yaml; it is incomplete or not a marft checkpoint")
    return ckpt


def write_checkpoint(run_dir: str | Path, iteration: int, fill: Callable[[Path], None], keep: int = 0) -> Path:
    """``fill(folder)`` writes the checkpoint's files into a temporary folder, which becomes
    ``checkpoints/iter_NNNNNN`` and ``latest``; then all but the newest ``keep`` go (0 = keep all).
    An iteration that ``latest`` already names is not written again (its state is the same)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:06d}"
    final = root / name
    if final.is_dir() and latest_checkpoint(run_dir) == final:
        # this iteration is saved already (MarftTrainer.save() after train(), or after a resume): the
        # state is the same, and replacing the folder latest names would leave a moment with none
        return final
    for stale in root.glob(".iter_*.tmp-*"):  # left by a run killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{name}.tmp-{os.getpid()}"
    tmp.mkdir()
    fill(tmp)
    _fsync_tree(tmp)
    if final.exists():  # written before by a run killed before it named it latest: set it aside first
        old = root / f".{name}.tmp-old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    write_atomic(root / "latest", name)
    if keep:
        for old in sorted(root.glob("iter_*"))[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(checkpoint: Path, file: str = "trainer.pt") -> dict:
    """The trainer state of ``checkpoint``, or a one-line error saying which earlier one to use."""
    import torch

    path = checkpoint / file
    if not path.is_file():
        raise UserError(f"checkpoint {checkpoint} has no {file}; it is incomplete or not a marft checkpoint")
    try:
        # on the CPU whatever device wrote it: a run saved on a GPU resumes on a CPU and the reverse
        # (optimisers move their state to their parameters' device when it is loaded)
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or corrupt file
        earlier = sorted(p.name for p in checkpoint.parent.glob("iter_*") if p != checkpoint and (p / file).is_file())
        hint = (f"to resume from an earlier one, write its name ({', '.join(earlier[-3:])}) into {checkpoint.parent / 'latest'}"
                if earlier else "there is no earlier checkpoint; start a new run")
        raise UserError(f"checkpoint {checkpoint} cannot be read ({type(e).__name__}: the file is truncated or corrupt); {hint}") from None


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def append_metrics(path: Path, metrics: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: Path) -> list[dict]:
    """The lines of metrics.jsonl (none if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, iteration: int) -> None:
    """Drop metric lines written after ``iteration`` (a run killed after its last checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("iteration", 0) <= iteration:
                keep.append(line)
        except json.JSONDecodeError:
            break  # a line cut by a kill
    write_atomic(path, "".join(line + "\n" for line in keep))


CRITIC_FOLDER = "critic"  # a checkpoint's critic: its value heads and what they are


def write_critic(folder: Path, heads: dict, about: dict) -> None:
    """The value heads (``{head: module}``; ``"team"`` or an agent's name) into ``folder/critic/``:
    ``value_heads.safetensors`` (tensors named ``<head>/<parameter>``) and ``critic.json``
    (``about``: the critic's kind, algorithm and adapter, with the heads' names and widths added).
    A learning critic's adapter is saved with the agents' (``adapters/<adapter>``). Nothing for a
    critic-free algorithm."""
    if not heads:
        return
    from safetensors.torch import save_file

    out = Path(folder) / CRITIC_FOLDER
    out.mkdir()
    save_file({f"{key}/{name}": t.detach().cpu().contiguous() for key, head in heads.items()
               for name, t in head.state_dict().items()}, str(out / "value_heads.safetensors"))
    widths = {key: int(head.state_dict()["net.0.weight"].shape[1]) for key, head in heads.items()}
    (out / "critic.json").write_text(json.dumps({**about, "heads": widths}, indent=2) + "\n")


def read_critic(checkpoint: Path, state: dict | None = None) -> tuple[dict, dict] | None:
    """``(about, {head: state_dict})`` of the critic :func:`write_critic` saved in ``checkpoint``; of
    a checkpoint written before the critic had its folder, the heads its ``trainer.pt`` holds (their
    kind and algorithm from the same file; ``state``: that file's contents where the caller read it
    already); None where it has none (a critic-free run). A one-line error when the files are
    unreadable."""
    checkpoint = Path(checkpoint)
    folder = checkpoint / CRITIC_FOLDER
    if not folder.is_dir():
        if not (checkpoint / "trainer.pt").is_file():
            return None
        state = state if state is not None else read_state(checkpoint)
        heads = state.get("heads") or {}
        if not heads:
            return None
        lora = "critic_adapter_opt" in state
        return ({"kind": "lora" if lora else "head", "algorithm": state.get("algorithm"), "adapter": "critic" if lora else None,
                 "team": state.get("team"), "heads": {k: int(h["net.0.weight"].shape[1]) for k, h in heads.items()}}, heads)
    from safetensors.torch import load_file

    try:
        about = json.loads((folder / "critic.json").read_text())
        heads: dict[str, dict] = {key: {} for key in about["heads"]}
        for name, t in load_file(str(folder / "value_heads.safetensors")).items():
            key, _, param = name.partition("/")  # agent names hold no "/" (marft/team.py)
            heads[key][param] = t
    except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file: say which folder
        gist = " ".join(str(e).split())[:80]
        raise UserError(f"the critic in {folder} cannot be read ({type(e).__name__}: {gist}); the checkpoint is "
                        f"incomplete: write an earlier checkpoint's name into {checkpoint.parent / 'latest'}") from None
    return about, heads


def load_heads(heads: dict, states: dict, does_not_fit: str, fix: str) -> None:
    """Saved value heads (``{head: state_dict}``, :func:`read_critic`) into ``heads``; where one does
    not fit, a one-line error: ``does_not_fit (the reason: a size mismatch); fix``."""
    for key, head in heads.items():
        try:
            head.load_state_dict(states[key])
        except RuntimeError as e:
            raise UserError(f"{does_not_fit} ({str(e).splitlines()[0][:100]}); {fix}") from None


def adapters_folder(source: str | Path) -> Path:
    """The ``adapters/`` folder of a run folder (its latest checkpoint), of a checkpoint, or itself.
    A path through ``checkpoints/latest`` (a file naming the newest checkpoint, not a folder) goes
    to that checkpoint: ``run/checkpoints/latest/adapters`` works."""
    p = Path(source)
    for i, part in enumerate(p.parts):
        head = Path(*p.parts[:i + 1])
        if part == "latest" and head.is_file() and head.parent.name == "checkpoints":
            target = latest_checkpoint(head.parent.parent)
            if target is not None:
                p = target.joinpath(*p.parts[i + 1:])
            break
    if p.exists() and not p.is_dir():  # after resolving checkpoints/latest, which is a file naming a folder
        raise UserError(f"adapters {source} is a file, not a folder; give a checkpoint's adapters/ folder, a checkpoint or a run folder")
    if (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            if (p / "checkpoints" / "latest").exists():  # a latest that names no checkpoint: say which
                raise UserError(f"run folder {p}: {no_checkpoint_reason(p)}")
            raise UserError(f"run folder {p} has no complete checkpoint (expected {p}/checkpoints/latest); "
                            "train it first or give a checkpoint's adapters/ folder")
        return ckpt / "adapters"
    if (p / "adapters").is_dir():
        return p / "adapters"
    return p


def critic_checkpoint(source: str | Path) -> Path | None:
    """The checkpoint whose critic ``source`` names: that of :func:`adapters_folder` (a run folder's
    latest, a checkpoint, ``checkpoints/latest`` or a checkpoint's ``adapters/``); None where
    ``source`` names no checkpoint's adapters."""
    folder = adapters_folder(source)
    return folder.parent if folder.name == "adapters" and folder.is_dir() else None
