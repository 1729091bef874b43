"""Writing into the results folder safely: never through a symbolic link, one run of a paper at a time, and
a run that replaces the old result only when it completes.

    with run_lock(results, "afl", "smoke"), staging(results, "afl-smoke") as tmp:
        ... write tmp/afl-smoke/, tmp/afl-smoke.ipynb, tmp/afl-smoke.json ...
        publish(tmp, results, ["afl-smoke", "afl-smoke.ipynb", "afl-smoke.json"])

A run killed before `publish` leaves the previous result, its notebook and its figures as they were (and a
hidden `.afl-smoke.*.running` folder, removed by the next run of that paper). `publish` writes a journal into the
staging folder before it moves anything and removes it when every move is done; a run killed part-way through
(SIGKILL, a power cut) leaves the journal, and the next listing of the results or the next run of that paper
puts the old versions back (`recover_publishes`), so the old result never stays without its figures."""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from .claims import ReproError
from .results import printable


class UnsafePathError(ReproError):
    """A path in the results folder is a symbolic link (or not what it should be): nothing is written."""


class RunLockedError(ReproError):
    """Another run of the same paper holds the results folder's lock."""


def user_path(value, name: str) -> Path:
    """A path a user typed or set in the environment, '~' and '~user' expanded (a quoted '~/res' in a .env file or a
    Dockerfile ENV reaches us unexpanded: it means the home folder, not a folder named '~')."""
    try:
        return Path(value).expanduser()
    except RuntimeError:  # ~nosuchuser, or no home folder at all
        raise UnsafePathError(f"{name} {str(value)[:120]!r} starts with a '~' that names no home folder here; give "
                              "the folder's full path") from None


def refuse_link(path) -> Path:
    """`path` unless it is a symbolic link; fedlab-nb never writes or deletes through one in the results folder."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafePathError(f"{path} is a symbolic link (to {os.readlink(path)}); fedlab-nb does not write or "
                              "delete through links in the results folder: remove the link, or give --results "
                              "a folder of its own")
    return path


def write_atomic(path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` through a temporary file in its folder and os.replace: a hard link
    at `path` is replaced, never written through (its other name keeps its content); a symbolic link is refused."""
    path = refuse_link(path)
    if path.is_dir():
        raise UnsafePathError(f"{path} is a folder where fedlab-nb writes a file; remove or rename that folder "
                              "(or give --results another folder)")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if isinstance(data, str):  # a lone surrogate (a '\\ud800' escape in a result file) becomes '?', not an error
            Path(tmp).write_text(data, encoding="utf-8", errors="replace")
        else:
            Path(tmp).write_bytes(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the board and copies are ordinary user files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_regular(path, limit: int) -> bytes:
    """The bytes of `path` when it is a regular file of at most `limit` bytes (opened without blocking, so a
    FIFO or a device is refused, not read); UnsafePathError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise UnsafePathError(f"cannot read {path} ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{path} is not a regular file (a FIFO, a device or a folder); remove it or "
                                  "replace it with a file")
        data = f.read(min(os.fstat(fd).st_size, limit) + 1)  # a buffered read allocates all it is asked for
    if len(data) > limit:
        raise UnsafePathError(f"{path} is over {limit} bytes; remove it or replace it with a smaller file")
    return data


def make_folder(path) -> Path:
    """mkdir -p, refusing a link at the folder or a file in its place."""
    path = refuse_link(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UnsafePathError(f"{path} is a file, not a folder; give --results a folder") from None
    except OSError as e:
        raise ReproError(f"cannot create the folder {path} ({e.strerror or e}); give --results a writable folder") from None
    return path


def writable_folder(path) -> Path:
    """`path`, when it exists checked writable by writing a temporary file into it (a missing one is made by
    `make_folder` when the run writes, so a refused command leaves nothing behind)."""
    path = refuse_link(path)
    if not path.is_dir():
        return path
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ReproError(f"cannot write into the results folder {path} ({e.strerror or e}): make it writable "
                         f"(chmod u+w {path}) or give --results a writable folder") from None
    return path


# --------------------------------------------------------------------------------------------- the lock
@contextlib.contextmanager
def run_lock(results_dir, paper_id: str, scale: str):
    """Hold `<results>/<paper_id>.lock` for one run; a second run of the same paper raises RunLockedError
    naming the first (its process, host, scale and start time). The lock is an advisory `flock`, released by
    the system when its process dies, so a killed run never leaves the paper locked."""
    import fcntl
    path = refuse_link(Path(make_folder(results_dir)) / f"{paper_id}.lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise UnsafePathError(f"cannot open {path} as {paper_id}'s run lock ({e.strerror or e}); remove it or "
                                  "make the results folder writable, or give --results another folder") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: never truncated, written or deleted
            os.close(fd)
            raise UnsafePathError(f"{path} is not a regular file, so it cannot be {paper_id}'s run lock; remove it "
                                  "(nothing else belongs there) or give --results another folder")
        if os.fstat(fd).st_nlink > 1:  # a hard link: truncating it would truncate its other name's file
            os.close(fd)
            raise UnsafePathError(f"{path} is a hard link to another file, so it cannot be {paper_id}'s run lock; "
                                  "remove it (nothing else belongs there) or give --results another folder")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(f"another run of {paper_id} is writing into {Path(results_dir)} ({_holder(path)}); "
                                 f"wait for it to finish, or give --results another folder") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: a file system without locks (some NFS, SMB or sshfs mounts)
            if os.fstat(fd).st_size == 0:  # the empty file this call made (nobody can hold a lock here)
                with contextlib.suppress(OSError):
                    path.unlink()
            os.close(fd)
            raise UnsafePathError(f"cannot lock {path} as {paper_id}'s run lock ({e.strerror or e}): the results "
                                  "folder's file system does not support file locks, so two runs of a paper could "
                                  "not be kept apart; give --results a folder on a local disk") from None
        if _same_file(fd, path):  # not unlinked by a run that finished between our open and our flock
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "scale": scale,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "command": " ".join(sys.argv[:6])}).encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                path.unlink()
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(path: Path) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read(4096))
        return (f"process {int(info['pid'])} on {str(info['host'])[:64]}, scale {str(info['scale'])[:64]}, "
                f"started {str(info['started'])[:32]}")
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):  # pid 1e999, deep JSON
        return (f"the holder written in {path} is unreadable; the lock is released when the process holding it "
                f"ends: find it with `fuser {path}` and stop it")


# ----------------------------------------------------------------------------------- staging and publishing
JOURNAL = "publishing.json"  # in a staging folder while its publish moves files: what to undo if it is killed
DIGEST = re.compile(r"[fd]:[0-9a-f]{64}")  # a journal's record of a new version (see _identity)


@contextlib.contextmanager
def staging(out_dir, stem: str):
    """A fresh hidden folder `<out_dir>/.<stem>.*.running` to run into, removed on the way out; folders left
    by killed runs of the same stem are removed first, once a publish killed part-way has had its old versions
    put back (call it under `run_lock`)."""
    out_dir = make_folder(out_dir)
    recover_run(out_dir, stem)
    folder = Path(tempfile.mkdtemp(prefix=f".{stem}.", suffix=".running", dir=out_dir))
    try:
        yield folder
    finally:
        if not (folder / JOURNAL).exists():  # else a publish could not put the old versions back: keep them
            shutil.rmtree(folder, ignore_errors=True)


def recover_run(out_dir, stem: str) -> None:
    """Put back the old versions a publish of `stem` killed part-way left, then remove the staging folders of its
    killed runs (call it under `run_lock`, before reading the old result)."""
    out_dir, unfollowed = Path(out_dir), []
    mention_kept(out_dir, stem)
    for old in out_dir.glob(f".{stem}.*.running"):
        _recover(old, out_dir, unfollowed=unfollowed)
        if old.is_dir() and not old.is_symlink() and not (old / JOURNAL).exists():
            shutil.rmtree(old, ignore_errors=True)
    _warn_unfollowed(unfollowed)


def publish(folder: Path, out_dir, names) -> None:
    """Move `folder/<name>` to `out_dir/<name>` for each name, in order (put the result file last): a folder
    replaces the old one, a file replaces the old one atomically. All or nothing: every name is checked before
    anything moves, and an error or an interrupt part-way puts the old ones back (the old result never stands
    beside the new run's figures)."""
    out_dir = Path(out_dir)
    for name in names:
        refuse_link(out_dir / name)
    moves = [(folder / name, out_dir / name) for name in names if (folder / name).exists()]
    for new, final in moves:
        if final.exists() and final.is_dir() != new.is_dir():
            kind = "folder" if final.is_dir() else "file"
            raise UnsafePathError(f"{final} is a {kind} where fedlab-nb writes a {'file' if kind == 'folder' else 'folder'}"
                                  "; move it away")
    # what a killed publish must undo: each name, its new version's and its old version's content digests, signed
    _write_journal(folder, [[final.name, _identity(new), _identity(final)] for new, final in moves])
    try:
        for new, final in moves:
            _set_aside(final, folder / f"{final.name}.old")
            os.replace(new, final)
    except BaseException as e:
        try:  # undone through the journal, as the next reader would after a kill: one way back, not two
            whole, stuck = _recover(folder, out_dir, {final.name for _, final in moves}), "a name was replaced meanwhile"
        except OSError as error:
            whole, stuck = False, _why(error)
        if not whole:  # the journal stays: the next listing or run of the paper puts them back
            raise ReproError(f"publishing into {out_dir} failed ({_why(e)}) and the old versions could not be put "
                             f"back ({stuck}); they are kept in {folder}, and the next `fedlab-nb list` or run "
                             "of this paper restores them") from None
        raise
    (folder / JOURNAL).unlink()


def _set_aside(final: Path, old: Path) -> None:
    """Keep the old `final` at `old` until the publish is complete: a folder is moved there, a file hard-linked
    (so the file at `final` is replaced atomically, never missing)."""
    if final.is_file():
        try:
            os.link(final, old)
        except OSError:  # a file system without hard links (FAT, some network shares): a copy keeps it as well
            _copy_whole(final, old)
    elif final.exists():
        os.replace(final, old)


def _copy_whole(src: Path, dst: Path) -> None:
    """Copy src to dst, or leave no dst: a copy cut short (a full disk, an interrupt) must never be put back."""
    part = dst.with_name(dst.name + ".part")
    try:
        shutil.copy2(src, part)
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)


def recover_publishes(out_dir) -> None:
    """Put back the old versions a killed publish left in `out_dir`'s staging folders, for every paper whose
    run lock is free (a live run's publish is left alone); best effort, for the readers of the results."""
    out_dir, unfollowed = Path(out_dir), []
    mention_kept(out_dir)
    for folder in out_dir.glob(".*.running"):
        paper, scale = _paper_and_scale(folder)
        if not paper.isidentifier() or not (folder / JOURNAL).is_file():  # paper ids hold no '-'
            continue
        with contextlib.suppress(ReproError, OSError):
            with run_lock(out_dir, paper, scale):
                if _recover(folder, out_dir, unfollowed=unfollowed):
                    shutil.rmtree(folder, ignore_errors=True)
    _warn_unfollowed(unfollowed)


def _recover(folder: Path, out_dir: Path, names=None, unfollowed=None) -> bool:
    """Undo the publish whose journal is in `folder` (call it holding the paper's lock); whether it did.

    Only a journal signed with this user's key (`_journal_key`) is followed, so one planted in, or carried with, a
    results folder someone hands over moves and deletes nothing. Only what that publish moved is touched, and each
    name once: the journal is rewritten without a name as soon as it is back. A name now holding something that is
    neither the publish's new version nor its old one (written meanwhile) is left as it is: the publish's earlier
    versions are then kept in a `.kept` folder beside it, named in a warning, and the journal is retired, so no
    later reader acts on it. `names`: publish undoing its own moves (the names it moved; no signature needed).
    `unfollowed`: a list the folder is added to when its journal is not this user's, for one warning naming all."""
    journal, stem = folder / JOURNAL, folder.name[1:].rsplit(".", 2)[0]
    if folder.is_symlink() or not journal.is_file() or journal.is_symlink():
        return False
    entries = _read_journal(folder, stem, names)
    if entries is None:  # not a journal this user's publish wrote: nothing in it is followed, the folder is kept
        if unfollowed is not None:
            unfollowed.append(folder)
        return False
    left = list(entries)
    for entry in reversed(entries):
        if _restore(folder, out_dir, *entry):
            left.remove(entry)
            _write_journal(folder, left)  # this name is back: a later recovery never acts on it again
    if left:  # something newer stands there: keep the old versions, and never act on this journal again
        _retire(folder, [name for name, _, _ in left])
        return False
    journal.unlink()
    return True


def _retire(folder: Path, names: list) -> None:
    """Keep a publish's earlier versions where a user finds them, and stop its journal from acting again."""
    kept = folder.with_name(folder.name[:-len(".running")] + ".kept")
    try:
        os.rename(folder, kept)  # never onto something there already: a link, a folder
    except OSError as e:  # the journal stays, so no reader deletes this folder; the next one tries again
        _warn(f"a run killed while it published left the earlier {', '.join(names)} in {folder}; they were not put "
              f"back because {folder.parent} holds newer ones written meanwhile, and the folder could not be renamed "
              f"to {kept.name} ({_why(e)}); move what you want back by hand, then remove that folder")
        return
    (kept / JOURNAL).unlink(missing_ok=True)
    _warn(f"a run killed while it published left the earlier {', '.join(names)} in {kept}; they were not put back "
          f"because {folder.parent} holds newer ones written meanwhile (move what you want back by hand, then remove "
          "that folder)")


def mention_kept(out_dir, stem: str = "*") -> None:
    """Name the `.kept` folders of `stem` (all papers by default) again, until the user removes them: a warning
    missed once is not the last word on a killed run's earlier versions."""
    kept = sorted(p for p in Path(out_dir).glob(f".{stem}.*.kept") if _retired_folder(p))
    if kept:
        _warn(f"{_some(kept)} hold{'s' if len(kept) == 1 else ''} earlier versions a run killed while it published "
              "left (newer ones had been written meanwhile); move what you want back by hand, then remove "
              f"{'that folder' if len(kept) == 1 else 'those folders'}")


def _retired_folder(path: Path) -> bool:
    """Whether `path` may be a folder `_retire` made: a real folder (not a link, not a file) of a paper's stem."""
    return path.is_dir() and not path.is_symlink() and _paper_and_scale(path)[0].isidentifier()


def _paper_and_scale(folder: Path) -> tuple[str, str]:
    """(paper, scale) of a staging or kept folder `.<paper>-<scale>.<random>.running|kept` (paper ids hold no '-')."""
    paper, _, scale = folder.name[1:].rsplit(".", 2)[0].partition("-")
    return paper, scale


def _warn_unfollowed(folders: list) -> None:
    folders = sorted(folders)
    if folders:
        _warn(f"{_some(folders)} {'holds a run' if len(folders) == 1 else 'hold runs'} killed while publishing, with "
              f"a journal not signed with your key (another user's run, a key under {_state_home()}/fedlab_nb that "
              "changed or is not private to you, or an earlier release), so it was not followed: "
              f"{folders[0].parent} may show a killed run's newer files beside the old result, whose earlier "
              "versions are the *.old entries of each such folder; move what you want back by hand, then remove it")


def _some(paths: list, shown: int = 3) -> str:
    """Up to `shown` paths, and how many more: one warning line however many folders a results folder holds."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(str(p) for p in paths[:shown]) + more


def _warn(text: str) -> None:
    print(printable(f"warning: {text}"), file=sys.stderr)


def _journal_key() -> bytes | None:
    """This user's key for signing publish journals, made once (0600) under $XDG_STATE_HOME or ~/.local/state;
    None where it cannot be made (a read-only home) or cannot be trusted (another owner, readable by others):
    journals are then followed only by the publish that wrote them."""
    try:
        path = _state_home() / "fedlab_nb" / "journal.key"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists() and not path.is_symlink():
            _make_key(path)
        key = read_regular(path, 64)
        for _ in range(100):  # a key another process is writing in place (no hard links here): wait up to 1 s
            if len(key) == 32 or time.time() - os.lstat(path).st_mtime > 2:
                break
            time.sleep(0.01)
            key = read_regular(path, 64)
        info = os.lstat(path)
    except (OSError, ReproError, RuntimeError):  # RuntimeError: no home directory
        return None
    private = info.st_uid == os.geteuid() and not info.st_mode & 0o077
    return key if private and len(key) == 32 else None


def _state_home() -> Path:
    """$XDG_STATE_HOME when it is an absolute path (the XDG spec ignores a relative one), else ~/.local/state."""
    state = os.environ.get("XDG_STATE_HOME", "")
    return Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"


def _make_key(path: Path) -> None:
    """Write a fresh key beside `path` and link it into place, so a reader never sees a half-written key and two
    processes making it at once agree on one (the loser's link fails and it reads the winner's)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".journal.key.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        except OSError:  # a file system without hard links: create it in place, never replacing one in use
            _make_key_in_place(path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _make_key_in_place(path: Path) -> None:
    """O_EXCL: of two makers one wins and the other reads its key (`_journal_key` waits out a half-written one)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))


def _signature(folder: Path, entries: list) -> str | None:
    key = _journal_key()
    body = json.dumps([folder.name, entries], sort_keys=True).encode()
    return None if key is None else hmac.new(key, body, hashlib.sha256).hexdigest()


def _write_journal(folder: Path, entries: list) -> None:
    write_atomic(folder / JOURNAL, json.dumps({"entries": entries, "mac": _signature(folder, entries)}))


def _read_journal(folder: Path, stem: str, names=None) -> list | None:
    """The journal's entries when this user's publish wrote it (its signature checks; with `names`, publish reading
    its own journal, the names are enough), else None."""
    try:
        data = json.loads(read_regular(folder / JOURNAL, 100_000))
    except (OSError, ValueError, RecursionError, ReproError):  # unreadable, too long, not JSON or too deep
        return None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        return None
    entries = data["entries"]
    if not all(_journal_entry(e, stem, names) for e in entries):
        return None
    if names is not None:  # publish reading the journal it wrote a moment ago
        return entries
    mac, want = data.get("mac"), _signature(folder, entries)
    return entries if isinstance(mac, str) and want is not None and hmac.compare_digest(mac, want) else None


def _restore(folder: Path, out_dir: Path, name: str, new_id: str, old_id: str | None) -> bool:
    """Put `name`'s old version back over its new one; False when `out_dir/name` is something else (left as it is,
    with the old version kept in `folder`). `old_id`: the old version's digest, None when there was none."""
    final, old, new = out_dir / name, folder / f"{name}.old", folder / name
    here = _identity(final)
    if _identity(new) == new_id:  # the new version never moved in: only a folder set aside has to go back
        if old.exists() and here is None:
            os.replace(old, final)
        return True
    if not old.exists():  # nothing was set aside: the new version goes only where there was no old one
        if old_id is None and here == new_id:
            _remove(final)
        return True
    if here is not None and here not in (new_id, _identity(old)):  # something newer is there now: leave it
        return False
    if here == new_id:
        _remove(final)
    os.replace(old, final)
    return True


def _remove(path: Path) -> None:
    shutil.rmtree(path) if stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode) else path.unlink()


def _identity(path: Path) -> str | None:
    """A publish's versions by content: "f:" and the sha256 of a file, "d:" and that of a folder's tree (names,
    kinds, file contents); None when missing. Not (device, inode): a results folder copied elsewhere still matches,
    and a newer file given a freed inode number does not."""
    try:
        st = os.stat(path, follow_symlinks=False)
        h = hashlib.sha256()
        if stat.S_ISDIR(st.st_mode):
            _tree_digest(path, h)
            return "d:" + h.hexdigest()
        if stat.S_ISREG(st.st_mode):
            _file_digest(path, h)
            return "f:" + h.hexdigest()
    except FileNotFoundError:
        return None
    except (OSError, RecursionError, ValueError):
        pass
    return "unreadable"  # matches no digest: never taken for a version this package moved


def _file_digest(path, h) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        while chunk := f.read(1 << 20):
            h.update(chunk)


def _tree_digest(path, h) -> None:
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        h.update(entry.name.encode("utf-8", "surrogateescape") + b"\0")
        if entry.is_dir(follow_symlinks=False):
            h.update(b"d(")
            _tree_digest(entry.path, h)
            h.update(b")")
        elif entry.is_file(follow_symlinks=False):
            h.update(b"f")
            _file_digest(entry.path, h)
        else:  # a link or special file: its kind only, never followed
            h.update(b"o")


def _journal_entry(entry, stem: str, names=None) -> bool:
    """[name, new digest, old digest or None] with a name of this staging folder's run (its stem, stem.<suffix> or
    parameters.json) or, when given, one of `names`, and digests as `_identity` writes them."""
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], str)
            and DIGEST.fullmatch(entry[1]) and (entry[2] is None or isinstance(entry[2], str) and DIGEST.fullmatch(entry[2]))):
        return False
    name = entry[0]
    if names is not None:
        return name in names
    return "/" not in name and "\\" not in name and "\0" not in name and (
        name == stem or name.startswith(stem + ".") or name == "parameters.json")


def _why(e: BaseException) -> str:
    return (getattr(e, "strerror", None) or str(e) or type(e).__name__) if isinstance(e, OSError) else type(e).__name__
