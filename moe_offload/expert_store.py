"""The expert store: every expert weight bank of a model in one POSIX shared-memory segment.

A restarted scheduler, or a second rank, maps the segment instead of reading the checkpoint again.
The segment is named from the model's identity; its header (``store_header.py``) says whose weights
it holds and whether the fill finished.

Concurrency, with ``flock`` on the segment itself:
- a creator makes the file under a temporary name, locks it exclusively and only then links it to
  the real name (``link`` fails if the name exists: O_EXCL semantics). Nobody can see a half-filled
  segment without waiting for the fill, and a crashed filler's lock goes away with it;
- an opener reads the header under a shared lock;
- a stale segment is unlinked under an exclusive lock and only while it is still linked, so two
  processes that both find it stale cannot remove each other's fresh segment;
- creators reserve their pages one at a time (a lock on the directory), so the one that fits gets
  them all.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from moe_offload.experts import ExpertBanks
from moe_offload.host_register import host_register, host_unregister, mapped_device_bytes
from moe_offload.store_header import Header, mark_complete, parse_header, read_header, write_header
from moe_offload.store_layout import HEADER_BYTES, SEGMENT_PREFIX, BankLayout, StoreIdentity

log = logging.getLogger("sluice.expert_store")
SHM_DIR = Path(os.environ.get("SLUICE_SHM_DIR", "/dev/shm"))  # where expert segments live


def _cuda_device(device: torch.device | int | None) -> torch.device:
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"register_cuda needs a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class ExpertStore:
    """A mapped segment. ``host_banks()`` are CPU tensors over the mapping (pinned once
    ``register_cuda()`` ran); ``device_banks()`` are CUDA tensors over the same host pages."""

    def __init__(self, path: Path, mm: mmap.mmap, header: Header):
        self.path = path
        self.identity = header.identity
        self.layout = header.layout
        self.created = header.created
        self.fill_seconds = header.fill_seconds
        self._mm: mmap.mmap | None = mm
        self._bytes: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)
        self._device: torch.device | None = None
        self._device_ptr = 0
        self._unregister: weakref.finalize | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    @property
    def registered(self) -> bool:
        return self._unregister is not None and self._unregister.alive

    def bank(self, name: str) -> torch.Tensor:
        if self._bytes is None:
            raise RuntimeError(f"expert store {self.name} is closed")
        return self.layout.view(self._bytes, name)

    def host_banks(self) -> ExpertBanks:
        return self._banks(self.bank)

    def register_cuda(self, device: torch.device | int | None = None) -> None:
        """Pin the whole mapping (portable, mapped): copies run at full PCIe speed and kernels can
        read it in place. Undone by ``close()``, or when the store is garbage-collected."""
        if self.registered:
            return
        if self._bytes is None:
            raise RuntimeError(f"expert store {self.name} is closed")
        device = _cuda_device(device)
        ptr, started = self._bytes.data_ptr(), time.monotonic()
        self._device_ptr = host_register(ptr, self.nbytes, device)
        self._device = device
        self._unregister = weakref.finalize(self, host_unregister, ptr)
        self._unregister.atexit = False  # at exit the CUDA context is torn down anyway
        log.info("registered expert store %s (%.1f GB) in %.2f s", self.name, self.nbytes / 1e9, time.monotonic() - started)

    def device_banks(self) -> ExpertBanks:
        """Zero-copy CUDA views of the banks; each view keeps the store (and its pinning) alive."""
        if not self.registered:
            raise RuntimeError(f"expert store {self.name}: call register_cuda() before device_banks()")
        raw = mapped_device_bytes(self._device_ptr, self.nbytes, self._device, owner=self)
        return self._banks(lambda name: self.layout.view(raw, name))

    def _banks(self, view: Callable[[str], torch.Tensor]) -> ExpertBanks:
        """``w13``, ``w2`` and, in a quantized store, their scale banks (whatever the format names)."""
        banks = {spec.name: view(spec.name) for spec in self.layout.banks}
        return ExpertBanks(**banks, scale_block=self.layout.scale_block, kind=self.layout.kind)

    def close(self) -> None:
        """Unregister from CUDA and let go of the mapping. Host tensors taken earlier stay valid (they
        hold the mapping); device views must not be used after this."""
        if self._unregister is not None:
            self._unregister()
        self._bytes = None
        self._mm = None

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mark_complete(self, fill_seconds: float) -> None:
        mark_complete(self._mm, fill_seconds)
        self.fill_seconds = fill_seconds

    @classmethod
    def open_or_create(
        cls,
        identity: StoreIdentity,
        layout: BankLayout,
        fill: Callable[[ExpertStore], None],
        shm_dir: str | Path = SHM_DIR,
    ) -> ExpertStore:
        """Map the segment of ``identity`` if a complete, matching one exists; otherwise remove
        whatever sits at its name, create it and call ``fill(store)`` to write the banks."""
        path = Path(shm_dir) / identity.name
        for _ in range(3):  # each pass returns, or loses a race to another creator and retries
            store = _open_existing(path, identity, layout) or _create(path, identity, layout, fill)
            if store is not None:
                return store
        raise RuntimeError(f"expert store {path} kept changing while opening it")


def _lock(fd: int, kind: int, path: Path) -> None:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for another process to finish filling expert store %s", path.name)
        fcntl.flock(fd, kind)


def _open_existing(path: Path, identity: StoreIdentity, layout: BankLayout) -> ExpertStore | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        _lock(fd, fcntl.LOCK_SH, path)
        header, problem = read_header(fd, identity, layout)
        if problem is None:
            store = ExpertStore(path, mmap.mmap(fd, layout.total_bytes), header)
            log.info(
                "reusing expert store %s (%.1f GB), skipped reading the checkpoint, saved ~%.1f s",
                store.name, store.nbytes / 1e9, store.fill_seconds,
            )
            return store
        fcntl.flock(fd, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:  # nobody removed it while we waited for the lock
            log.warning("removing stale expert store %s: %s", path, problem)
            path.unlink(missing_ok=True)  # `scripts/expert_store.py remove` does not lock
        return None
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: mmap holds a dup of fd, so closing would not unlock
        os.close(fd)


def _check_space(shm_dir: Path, nbytes: int) -> None:
    """Writing past tmpfs' limit through a mapping is a SIGBUS, so refuse up front (``_reserve``
    then makes it true for processes filling stores at once). Stores of an older checkpoint version
    are never reused, yet hold RAM until someone removes them: say so."""
    others = list_segments(shm_dir)
    if others:
        log.warning(
            "%d other expert store(s) hold %.1f GB of %s; `python scripts/expert_store.py list` shows them",
            len(others), sum(s.nbytes for s in others) / 1e9, shm_dir,
        )
    st = os.statvfs(shm_dir)
    if st.f_bavail * st.f_frsize < nbytes:
        free = st.f_bavail * st.f_frsize / 1e9
        raise OSError(errno.ENOSPC, f"{shm_dir} has {free:.1f} GB free, the expert store needs {nbytes / 1e9:.1f} GB")


def _create(path: Path, identity: StoreIdentity, layout: BankLayout, fill: Callable[[ExpertStore], None]) -> ExpertStore | None:
    """None if another process linked the name first."""
    _check_space(path.parent, layout.total_bytes)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    linked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.link(tmp, path)
            linked = True
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        _reserve(fd, path, layout.total_bytes)
        mm = mmap.mmap(fd, layout.total_bytes)
        store = ExpertStore(path, mm, write_header(mm, identity, layout))
        log.info("filling expert store %s (%.1f GB) for %s", store.name, store.nbytes / 1e9, identity.label)
        started = time.monotonic()
        fill(store)
        store._mark_complete(time.monotonic() - started)
        log.info("filled expert store %s in %.1f s", store.name, store.fill_seconds)
        return store
    except BaseException:
        if linked and os.fstat(fd).st_nlink > 0:
            os.unlink(path)
        raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Give the segment all its pages before the fill writes through the mapping. A sparse file
    (ftruncate alone) takes pages as the fill touches them, so two processes that both passed
    ``_check_space`` could fill tmpfs between them and both die of SIGBUS mid-fill; allocated
    here, the one that does not fit gets ENOSPC, in one line, before it maps anything. Reservations
    in one directory take turns (an exclusive ``flock`` on the directory): two at once could each
    take part of what is left and both fail, where one of them fits."""
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"{path.parent} has no room for the expert store's "
                                        f"{nbytes / 1e9:.1f} GB (another process filled it meanwhile?)") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem that cannot allocate ahead: sparse, as before
    finally:
        os.close(dir_fd)  # and with it the lock


class SegmentInfo(NamedTuple):
    name: str
    nbytes: int
    complete: bool
    label: str
    created: float
    problem: str | None


def list_segments(shm_dir: str | Path = SHM_DIR) -> list[SegmentInfo]:
    """Every expert store segment in ``shm_dir``, ours or not, usable or not."""
    infos = []
    for path in sorted(Path(shm_dir).glob(SEGMENT_PREFIX + "*")):
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
        except FileNotFoundError:
            continue  # removed while we listed
        try:
            h = parse_header(raw)
        except ValueError as e:
            infos.append(SegmentInfo(path.name, size, False, "", 0.0, str(e)))
            continue
        complete = h.complete and size == h.layout.total_bytes
        infos.append(SegmentInfo(path.name, size, complete, h.identity.label, h.created, None))
    return infos


def remove_segment(name: str, shm_dir: str | Path = SHM_DIR) -> None:
    """Unlink one segment; processes that map it keep their mapping until they exit."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name:
        raise ValueError(f"{name!r} is not an expert store name ({SEGMENT_PREFIX}...)")
    (Path(shm_dir) / name).unlink()
