"""The one place where diffrl reads and writes user-facing files, so every failure is one clear line.

Reading: a file that is missing, not UTF-8, not valid JSON, or a damaged safetensors / torch file raises
`DamagedFile` (a `UserError`) naming the file and what is wrong, instead of a decoder's traceback.

Writing: every file is written to a hidden sibling and renamed into place, so a full or read-only disk never
leaves a 0-byte or half-written file under the real name, and never replaces a good file with a broken one. An
`OSError` while writing becomes a `UserError` ("cannot write PATH: No space left on device"). Payloads (torch
pickles, safetensors) are serialised in memory first and written with plain Python I/O: a C++ writer that hits a
full disk can abort the whole process (std::terminate in a destructor), Python's write raises.

Output folders of `sample`, `steer` and `score` are fresh: writing into a folder that already holds results would
mix old and new images.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

from diffrl.errors import UserError

MAX_SHOWN = 120  # characters of a user value quoted in an error message


class DamagedFile(UserError):
    """A file exists but cannot be read as what it should be (truncated, not UTF-8, not JSON, not safetensors)."""

    def __init__(self, path, what: str, hint: str = ""):
        self.path = Path(path)
        super().__init__(f"{path} {what}" + (f"; {hint}" if hint else ""))


def shorten(value: Any, limit: int = MAX_SHOWN) -> str:
    """`repr`-free text of a user value cut to `limit` characters, for error messages."""
    text = str(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} characters)"


def _strerror(e: OSError) -> str:
    return e.strerror or str(e)


# ---------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------


def read_text(path, what: str = "file") -> str:
    """The UTF-8 text of `path`; `UserError` if it is missing, unreadable or not UTF-8 text."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {_strerror(e)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedFile(path, f"is not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); give a text file "
                          f"saved as UTF-8") from None


def read_json(path, what: str = "file") -> Any:
    """The JSON value in `path`; `DamagedFile` if it is not valid JSON (e.g. cut short by a crash)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedFile(path, f"is not valid JSON (line {e.lineno}: {e.msg})") from None


def read_jsonl(path, what: str = "file") -> list[dict]:
    """One JSON object per line. A last line without its newline that does not parse is what a process killed
    mid-write leaves: it is dropped. Any other bad line is a `DamagedFile` naming its number."""
    path = Path(path)
    if not path.is_file():
        return []
    text = read_text(path, what)
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the unterminated last line: a write that never finished
                break
            raise DamagedFile(path, f"line {number} is not valid JSON; fix or delete that line") from None
    return records


def load_safetensors(path, hint: str = "") -> dict:
    """The tensors of a safetensors file; `DamagedFile` if it is truncated or not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = _read_bytes(path)
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError):
        raise DamagedFile(path, "is not a readable safetensors file (truncated by a crash or a full disk?)",
                          hint) from None


def torch_load(path, hint: str = "", *, weights_only: bool = True) -> Any:
    """`torch.load` on the CPU; `DamagedFile` if the file is truncated or not a torch file."""
    import pickle

    import torch

    data = _read_bytes(path)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError):
        raise DamagedFile(path, "is not a readable torch file (truncated by a crash or a full disk?)", hint) from None


def _read_bytes(path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DamagedFile(path, "is missing") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {_strerror(e)}") from None


# ---------------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def writing(what):
    """Turn an `OSError` (full disk, read-only file system, permission) inside the block, or the same failure
    inside safetensors' own writer (which diffusers' `save_pretrained` / `save_lora_weights` use), into a one-line
    `UserError` naming `what`."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {what}: {_strerror(e)}") from None
    except Exception as e:
        from safetensors import SafetensorError

        if not isinstance(e, SafetensorError):
            raise
        # "Error while serializing: I/O error: No space left on device (os error 28)"
        reason = str(e).rsplit("I/O error: ", 1)[-1].split(" (os error")[0]
        raise UserError(f"cannot write {what}: {reason}") from None


def write_bytes(path, data: bytes) -> None:
    """Write `data` to `path` atomically: a hidden sibling, flushed and fsynced, then renamed over `path`. On
    failure the sibling is removed and `path` is as it was; raises `UserError`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(f"cannot write {path}: {_strerror(e)}") from None


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def _finite(value):
    """JSON has no NaN or infinity: NaN -> null, ±inf -> "inf" / "-inf" (the convention of metrics.jsonl)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(data, **kwargs) -> str:
    """Strict JSON (no bare NaN / Infinity, which most readers reject)."""
    return json.dumps(_finite(data), allow_nan=False, **kwargs)


def write_json(path, data, **kwargs) -> None:
    write_text(path, json_text(data, indent=2, **kwargs) + "\n")


def save_torch(path, obj) -> None:
    """`torch.save` serialised in memory, then written atomically."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getvalue())


def save_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """A safetensors file serialised in memory, then written atomically."""
    from safetensors.torch import save

    write_bytes(path, save(tensors, metadata=metadata))


def save_png(path, image) -> None:
    """`image`: `[3, H, W]` float tensor in [0, 1] (NaN -> 0), written as an 8-bit PNG atomically."""
    from PIL import Image

    array = image.detach().float().cpu().nan_to_num(0.0).clamp(0, 1).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray((array * 255).round().astype("uint8")).save(buffer, format="PNG")
    write_bytes(path, buffer.getvalue())


def fresh_out_dir(path, flag: str = "--out") -> Path:
    """Create the output folder of `sample` / `steer`, refusing one that already holds files (new images would mix
    with old ones that scores.json no longer lists); check that it can be written to."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a folder for the images")
    if path.is_dir() and any(path.iterdir()):
        raise UserError(f"{flag} {path} already holds files (earlier results?); give a new or empty folder")
    _file_in_the_way(path, flag)
    with writing(f"to {flag} {path}"):
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".diffrl-write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    return path


def _file_in_the_way(path: Path, flag: str) -> None:
    """A regular file where `path` needs a folder (itself or one of its parents) is named as such."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"cannot write {flag} {path}: {parent} is a file, not a folder")
            return


def check_out_file(path, flag: str = "--out") -> Path:
    """Check before any work that the output file `path` can be created (its folder made and writable)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name such as {path / 'scores.json'}")
    _file_in_the_way(path, flag)
    with writing(f"{flag} {path}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".diffrl-write-test-{uuid.uuid4().hex[:8]}")
        probe.write_bytes(b"")
        probe.unlink()
    return path


# ---------------------------------------------------------------------------------------------------------------
# one writer per run dir
# ---------------------------------------------------------------------------------------------------------------

RUN_LOCK = ".lock"  # in the run dir: flock'ed by the process that writes the run; holds its PID while it runs


def lock_run_dir(run_dir, in_use: str = "") -> contextlib.AbstractContextManager:
    """Take the run dir's writer lock, or raise a one-line `UserError` naming the process that holds it.

    Taken by `diffrl run` and `diffrl resume` (for the whole run), by the runs of `diffrl bench` (`--keep` puts them
    where a `diffrl resume` can reach them) and, on the folder it fills, by `diffrl pairs sample` (`in_use`: what
    the message says after "in use by process N"; the run dir's text by default).

    An OS advisory lock (`fcntl.flock` on `run_dir/.lock`): the kernel drops it when its process exits in any way
    (SIGKILL included), so a killed run resumes without a stale lock to remove. The holder writes its PID into the
    file for the message of a second writer and empties it on release (a finished run leaves the file as it was).
    Where `fcntl` does not exist (Windows), or the file system refuses locks (some network mounts), there is no lock
    and one writer per run dir is the user's to keep.

    Returns:
        A context manager; leaving it releases the lock.
    """
    try:
        import fcntl
    except ImportError:
        return contextlib.nullcontext()
    run_dir = Path(run_dir)
    with writing(f"run dir {run_dir}"):
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _lock_holder(fd)
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise (UserError(f"{run_dir} is in use by {holder} {in_use}") if in_use else _in_use(run_dir, holder)
                   ) from None
        return contextlib.nullcontext()  # no locks on this file system (ENOLCK, EOPNOTSUPP)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return _HeldLock(fd)


class _HeldLock(contextlib.AbstractContextManager):
    """A taken run dir lock; `release()` (or leaving the `with`) empties the file and drops the lock, once."""

    def __init__(self, fd: int):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def check_run_dir_unlocked(run_dir) -> None:
    """A `UserError` naming the holder if another process writes `run_dir` now (the lock is probed, not kept; no
    file is created)."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fd = os.open(Path(run_dir) / RUN_LOCK, os.O_RDONLY)
    except OSError:  # no lock file: no run has held it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(Path(run_dir), _lock_holder(fd)) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _lock_holder(fd: int) -> str:
    """'process PID' from the lock file (its holder writes the PID just after taking the lock: wait briefly)."""
    import time

    for _ in range(20):
        with contextlib.suppress(OSError, ValueError):
            return f"process {int(os.pread(fd, 32, 0).decode().strip())}"
        time.sleep(0.05)
    return "another process"


def _in_use(run_dir: Path, holder: str) -> UserError:
    return UserError(f"run dir {run_dir} is in use by {holder} (a `diffrl run`, `diffrl resume` or `diffrl bench` "
                     f"of it); one process writes a run dir: wait for it to end or stop it, then `diffrl resume "
                     f"{run_dir}`")
