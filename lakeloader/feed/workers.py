"""Batches built by worker processes into shared memory (``loader.workers: N``), handed out in step order.

Protocol. Worker ``k`` of ``N`` opens its own loader over the same config (``make_loader``, a
picklable callable) and says so (``("ready",)``, or ``("error", None, exception)``). While the
workers start (a spawned interpreter importing lakeloader: about a second), the consumer builds
the batches itself; once every worker is ready it sends ``("begin", step)``, the first step it has
not built, and worker ``k`` builds the blocks of :data:`BLOCK` consecutive steps numbered ``k``,
``k + N``, ... from there (stopping before ``total``; consecutive steps share decoded row groups)
into a ring of shared-memory slots of its own (a block and the read-ahead): each batch is built
in its slot's memory (its row fields where the slot's previous batch had them), so putting it
there copies only the few small fields. It announces its batches over its pipe in step order:
``("batches", [(step, slot, segment, layout, objects), ...])`` (the numeric fields' dtype, shape
and offset in the slot, and the few object arrays, pickled), :data:`ANNOUNCE` at a time once the
lake is built (each batch at once while it is being built, and before it waits for a message),
or ``("error", step, exception)`` after which it builds nothing more. The consumer takes the
next batch announced by the worker owning each step (:func:`owner`), so batches come out in
step order and are exactly the batches of one process (whichever process built them). Where
shared memory is a file of /dev/shm (Linux) it hands out the fields as arrays over the slot
itself and sends ``("release", slot)`` back only once nothing refers to them any more (the
caller dropped the batch and its slices: no copy); elsewhere it copies every batch out. While
:data:`LENT` slots of a worker are still held by the caller, it copies the next batches out into
arrays nobody else holds instead (:class:`~lakeloader.feed.rows.ArrayPool`) and releases their
slots at once, so a caller keeping every batch never stalls the workers. A batch the caller keeps
is never overwritten.

Shutdown. ``close()`` (also run by the iterator's ``close``, by garbage collection and at exit)
sends ``("stop",)``, joins the workers (terminating any that do not stop) and unlinks every
segment they created (one a killed worker made but never announced is found by the pool's
prefix in /dev/shm). Workers ignore SIGINT (Ctrl-C reaches the consumer, which closes them)
and notice a dead parent (the pipe closes, or ``os.getppid`` changes: a watchdog thread polls it
even while a batch is being built) and then unlink their segments and exit. Workers are spawned
(no fork of a process running threads), so a script using them runs its loop under
``if __name__ == "__main__":``, as any multiprocessing program. Segment names start
with the pool's ``prefix`` (``lakeloader_<pid>_<random>``), so leaks can be found in /dev/shm.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any, Protocol

import numpy as np

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.rows import ArrayPool, ArraySource, Batch
from lakeloader.feed.slots import SlotArrays, Slots, field_of

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.2
JOIN_SECONDS = 5.0
BLOCK = 4   # consecutive steps per worker: neighbouring steps share row groups (decoded once)
LENT = 2    # slots per worker the caller may hold as its batches' memory (the ring has these extra)
# Batches a worker announces in one message. A consumer waiting for a batch is woken by its
# message: on a 2-core virtual machine ~35 µs of the two processes' CPU, a tenth of building the
# batch. Two at a time halve that where training waits for the workers (the first of two comes
# one build later; the workers build ahead all the same).
ANNOUNCE = 2
# The consumer builds the first batches itself while its workers start (tests turn it off to have
# the workers build every batch).
BUILD_WHILE_STARTING = True
_SHM_FOLDER = "/dev/shm"   # where Linux lists POSIX shared-memory segments as files
# glibc's malloc gives freed memory at its heap's top back to the system past 128 KiB and serves
# blocks past 128 KiB by mmap, raising both only as large blocks are freed: a fresh worker's
# image buffers (decoded, resized, copied) had their pages faulted in anew for every image, 20-30 %
# more CPU per image than in a long-lived process (docs/performance-history.md). A worker keeps
# up to this much freed memory for reuse instead.
MALLOC_TRIM_THRESHOLD = 64 << 20
MALLOC_MMAP_THRESHOLD = 32 << 20   # (glibc's largest on 64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameters (malloc.h)


def owner(offset: int, workers: int) -> int:
    """The worker that builds step ``start + offset``: blocks of :data:`BLOCK` steps in turn."""
    return (offset // BLOCK) % workers


class BatchSource(Protocol):
    """What a worker builds batches with (a :class:`~lakeloader.feed.loader.Loader`)."""

    @property
    def complete(self) -> bool: ...

    def batch(self, step: int, pool: ArraySource | None = None) -> Batch: ...

    def close(self) -> None: ...


class WorkerError(LakeloaderError):
    """A worker failed with an exception that could not be sent to the consumer as it was."""


def _unlink(name: str) -> None:
    """Remove segment ``name`` if it still exists (its worker may have removed it already). One
    its worker was killed between creating and sizing is empty, which ``SharedMemory`` cannot
    map: where segments are files (Linux), that one is removed as a file."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return  # already removed by its worker: nothing left to clean
    except ValueError:   # "cannot mmap an empty file"
        path = os.path.join(_SHM_FOLDER, name)
        if not os.path.isfile(path) or os.path.getsize(path):
            raise
        os.unlink(path)
        return
    segment.close()
    segment.unlink()


def _listed_segments(prefix: str) -> set[str]:
    """Names of the shared-memory segments starting with ``prefix`` + "_" where the system lists
    them as files (Linux: /dev/shm); none elsewhere."""
    if not os.path.isdir(_SHM_FOLDER):
        return set()
    return {name for name in os.listdir(_SHM_FOLDER) if name.startswith(prefix + "_")}


class _Inbox:
    """Whether a connection has a message waiting, through one poll object kept for it
    (``Connection.poll`` builds a selector on every call: a cost per batch on both sides)."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.poller = select.poll()
        self.poller.register(conn.fileno(), select.POLLIN)

    def waiting(self, seconds: float = 0.0) -> bool:
        """Whether a message (or the end of the connection) can be read within ``seconds``."""
        return bool(self.poller.poll(seconds * 1000))


def _drop_frames(exc: BaseException | None) -> None:
    """Drop the tracebacks of ``exc`` and the exceptions it chains (their text is in its note):
    their frames' locals may be arrays over a slot, whose segment then could not be closed."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        found.__traceback__ = None
        pending += [found.__cause__, found.__context__]


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling with its type and message, else a WorkerError saying so."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            return exc
    except Exception:  # noqa: BLE001 - any pickling failure means: send a description instead
        pass
    return WorkerError(f"{type(exc).__name__}: {exc}")


def _reportable(exc: Exception, worker: int, doing: str) -> BaseException:
    """``exc`` as sent to the consumer: a note saying where it was raised (its traceback as text),
    the frames themselves dropped (:func:`_drop_frames`), or a WorkerError if it cannot be pickled."""
    exc.add_note(f"raised in loader worker {worker} (pid {os.getpid()}) {doing}:\n"
                 + "".join(traceback.format_exception(exc)))
    _drop_frames(exc)
    return _sendable(exc)


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse (:data:`MALLOC_TRIM_THRESHOLD`); nothing
    where the C library is another."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):   # another C library (musl): its own malloc
        return
    libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)


def _worker_main(make_loader: Callable[[], BatchSource], worker: int, workers: int, total: int | None,
                 ring: int, prefix: str, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """Body of worker ``worker``: open its loader, say so (``("ready",)``), then, from the step the
    consumer names (``("begin", step)``), build its steps into its ring until stopped, the end, an
    error or the parent's death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the consumer's to handle
    _keep_freed_memory()
    slots = Slots(prefix, worker, ring)
    done = threading.Event()

    def watchdog() -> None:
        while not done.wait(WATCH_SECONDS):
            if os.getppid() != parent:
                slots.unlink_all()
                os._exit(0)

    threading.Thread(target=watchdog, name="lakeloader-worker-watchdog", daemon=True).start()
    free = list(range(ring))
    inbox = _Inbox(conn)
    loader: BatchSource | None = None
    failed = False

    def handle(message: tuple[Any, ...]) -> bool:
        """Apply one message from the consumer; False on stop."""
        if message[0] == "release":
            free.append(message[1])
            return True
        return False

    try:
        try:
            loader = make_loader()
            conn.send(("ready",))
        except Exception as exc:  # raised by the consumer once it reads it
            conn.send(("error", None, _reportable(exc, worker, "opening its loader")))
            failed = True
        begin = conn.recv()
        if begin[0] != "begin":
            return   # stopped before building anything
        start = begin[1]
        step = start + worker * BLOCK
        built_here: list[tuple[Any, ...]] = []   # batches built, not yet announced
        while True:
            # Read what the consumer sent; block only when there is nothing to build now (having
            # announced every batch built: the consumer may be waiting for one).
            idle = failed or not free or (total is not None and step >= total)
            if idle and built_here:
                conn.send(("batches", built_here))
                built_here = []
            if idle or inbox.waiting():
                if not handle(conn.recv()):
                    return
                continue
            assert loader is not None
            slot = free.pop()   # the slot given back last: the likeliest still in the caches
            built: SlotArrays | None = None
            error: tuple[Any, ...] | None = None
            try:
                built = slots.pool(slot)
                batch = loader.batch(step, built)   # built in the slot: put there without a copy
                built_here.append((step, slot, *slots.write(slot, batch, built)))
                del batch
            except Exception as exc:  # handed to the consumer, which raises it at this step
                error = ("error", step, _reportable(exc, worker, f"building step {step}"))
                failed = True
            built = None   # nothing here refers to a slot's memory between batches (its segment can close)
            # Held for the next only where building that one cannot wait for a build of the lake.
            if built_here and (len(built_here) == ANNOUNCE or error is not None or not loader.complete):
                conn.send(("batches", built_here))
                built_here = []
            if error is not None:
                conn.send(error)
            step += 1 if (step - start + 1) % BLOCK else (workers - 1) * BLOCK + 1
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return   # the consumer is gone (closed its end or died)
    finally:
        done.set()
        slots.unlink_all()
        if loader is not None:
            loader.close()


class WorkerPool:
    """``workers`` processes building batches from the step :meth:`begin` names on (see the
    module docstring)."""

    def __init__(self, make_loader: Callable[[], BatchSource], workers: int, total: int | None, ring: int) -> None:
        self.workers, self.total = workers, total
        self.start: int | None = None                  # the step the workers began at
        self._starting = set(range(workers))           # workers that have not said they are ready
        self.prefix = f"lakeloader_{os.getpid()}_{secrets.token_hex(4)}"
        context = multiprocessing.get_context("spawn")   # no fork of a process running threads
        self._conns: list[multiprocessing.connection.Connection] = []
        self._inboxes: list[_Inbox] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._attached: dict[str, mmap.mmap | shared_memory.SharedMemory] = {}
        self._names: set[str] = set()
        self._arrays = ArrayPool()   # what batches are copied into: no fresh pages per batch
        self._lent: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(workers)]
        self._announced: list[collections.deque[tuple[Any, ...]]] = [collections.deque() for _ in range(workers)]
        self._releases: dict[int, bytes] = {}   # ("release", slot) pickled, by slot
        for worker in range(workers):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_worker_main, name=f"lakeloader-worker-{worker}", daemon=True,
                args=(make_loader, worker, workers, total, ring, self.prefix, theirs, os.getpid()))
            process.start()
            theirs.close()
            self._conns.append(mine)
            self._inboxes.append(_Inbox(mine))
            self._processes.append(process)
        self._finalizer = weakref.finalize(self, WorkerPool._shutdown, self._conns, self._processes,
                                           self._attached, self._names, self.prefix)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers."""
        return [p.pid for p in self._processes if p.pid is not None]

    def _receive(self, worker: int) -> tuple[Any, ...]:
        """``worker``'s next message; the error it reports, or its end, raised here."""
        conn, process, inbox = self._conns[worker], self._processes[worker], self._inboxes[worker]
        while not inbox.waiting(WATCH_SECONDS):
            if not process.is_alive() and not inbox.waiting():
                raise self._ended(worker)
        try:
            message = conn.recv()
        except (EOFError, ConnectionError):   # its end of the pipe closed (reset: with our messages unread)
            raise self._ended(worker) from None
        if message[0] == "error":
            raise message[2]
        return message

    def _send(self, worker: int, message: tuple[Any, ...] | bytes) -> None:
        """Send ``worker`` a message (or one pickled already); its end, if it has ended, raised here."""
        try:
            if isinstance(message, bytes):
                self._conns[worker].send_bytes(message)
            else:
                self._conns[worker].send(message)
        except ConnectionError:
            raise self._ended(worker) from None

    def _give_back(self, worker: int, slot: int) -> None:
        """Send ``worker`` ``("release", slot)``, pickled once per slot (one goes with every batch)."""
        message = self._releases.get(slot)
        if message is None:
            message = self._releases[slot] = pickle.dumps(("release", slot))
        self._send(worker, message)

    def _ended(self, worker: int) -> BaseException:
        """The error to raise for ``worker`` having ended: the one it reported, if its pipe still
        holds it, else what its exit says."""
        conn, process, inbox = self._conns[worker], self._processes[worker], self._inboxes[worker]
        try:
            while inbox.waiting():
                message = conn.recv()
                if message[0] == "error":
                    return message[2]
        except (EOFError, ConnectionError):
            pass   # the pipe is read to its end: the exit code below tells the rest
        process.join(JOIN_SECONDS)   # (an exit not yet reaped has no code)
        code = process.exitcode
        if code is not None and code < 0:
            return WorkerError(
                f"loader worker {worker} (pid {process.pid}) was killed by {signal.Signals(-code).name} "
                "(out of memory? killed by hand?); lower loader.workers or the batch size, or run with "
                "loader.workers: 0 to see any error in this process")
        return WorkerError(
            f"loader worker {worker} (pid {process.pid}) ended (exit code {code}) without reporting an "
            "error; its own, if any, is on stderr above. Workers are spawned processes that import the "
            "main module again: a script that iterates a loader with loader.workers > 0 must do so "
            "under `if __name__ == \"__main__\":` (as any multiprocessing program)")

    def _take_ready(self, worker: int) -> None:
        """Read ``worker``'s first message: ``("ready",)``, or the error it met opening its loader (raised)."""
        message = self._receive(worker)
        if message[0] != "ready":
            raise AssertionError(f"worker {worker} sent {message[0]!r} before it was ready")
        self._starting.discard(worker)

    def _next(self, worker: int) -> tuple[Any, ...]:
        """``worker``'s next batch announced: (step, slot, segment name, layout, object fields);
        its error raised here."""
        announced = self._announced[worker]
        if not announced:
            if worker in self._starting:
                self._take_ready(worker)
            message = self._receive(worker)
            if message[0] != "batches":
                raise AssertionError(f"worker {worker} sent {message[0]!r}, expected batches")
            announced.extend(message[1])
        return announced.popleft()

    def ready(self) -> bool:
        """Whether every worker has opened its loader, without waiting for one; a worker's error,
        or its death, raised here."""
        for worker in sorted(self._starting):
            if self._inboxes[worker].waiting() or not self._processes[worker].is_alive():
                self._take_ready(worker)
            else:
                return False
        return True

    def begin(self, step: int) -> None:
        """Have the workers build batches from ``step`` on."""
        self.start = step
        for worker in range(self.workers):
            self._send(worker, ("begin", step))

    def batch(self, step: int) -> Batch:
        """Batch ``step`` (the next one in order) as arrays owned by the caller."""
        if self.start is None:
            raise AssertionError("WorkerPool.batch before begin")
        worker = owner(step - self.start, self.workers)
        got, slot, name, layout, objects = self._next(worker)
        if got != step:
            raise AssertionError(f"worker {worker} sent step {got}, expected {step}")
        self._names.add(name)
        segment = self._attached.get(name)
        if segment is None:
            for old in [n for n in self._attached if n.rsplit("_", 1)[0] == name.rsplit("_", 1)[0]]:
                _close(self._attached.pop(old))   # a regrown slot's old segment
            segment = self._attached[name] = _attach(name)
        self._release_unused()
        lend = isinstance(segment, mmap.mmap) and len(self._lent[worker]) < LENT
        # Every field, and every view of one the caller makes, has ``slot_bytes`` as its base.
        slot_bytes = np.frombuffer(segment if isinstance(segment, mmap.mmap) else segment.buf, np.uint8)
        batch: Batch = {}
        for field, dtype, shape, offset in layout:
            values = field_of(slot_bytes, offset, dtype, shape)
            if lend:
                batch[field] = values
            else:
                batch[field] = self._arrays.empty(shape, values.dtype)
                np.copyto(batch[field], values)
        if lend:
            self._lent[worker].append((slot, slot_bytes))
        else:
            self._give_back(worker, slot)
        batch.update(objects)
        return batch

    def _release_unused(self) -> None:
        """Give the workers back the lent slots whose arrays nobody refers to any more."""
        for worker, lent in enumerate(self._lent):
            for slot, slot_bytes in list(lent):
                # References: the list's tuple, the loop's name and getrefcount's argument; any
                # array or view of the caller's adds its own.
                if sys.getrefcount(slot_bytes) == 3:
                    lent.remove((slot, slot_bytes))
                    self._give_back(worker, slot)

    def close(self) -> None:
        """Stop the workers and remove every shared-memory segment (idempotent)."""
        self._finalizer()

    @staticmethod
    def _shutdown(conns: list[multiprocessing.connection.Connection],
                  processes: list[multiprocessing.process.BaseProcess],
                  attached: dict[str, mmap.mmap | shared_memory.SharedMemory], names: set[str],
                  prefix: str) -> None:
        for conn in conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # that worker has exited already
        # The workers stop together: one deadline for all, then for the stragglers' SIGTERM.
        _join_all(processes, JOIN_SECONDS)
        for process in processes:
            if process.is_alive():
                log.warning("loader worker pid %s did not stop in %gs; terminating it", process.pid, JOIN_SECONDS)
                process.terminate()
        _join_all(processes, JOIN_SECONDS)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        for conn in conns:
            conn.close()
        for segment in attached.values():
            _close(segment)
        attached.clear()
        # A worker that was killed could not remove its own: those it announced, and any it made
        # but was killed before announcing.
        for name in sorted(names | _listed_segments(prefix)):
            _unlink(name)


def _attach(name: str) -> mmap.mmap | shared_memory.SharedMemory:
    """Map segment ``name`` (a worker's) here: where POSIX shared memory is a file of /dev/shm
    (Linux) with a plain mmap, which stays mapped while arrays over it live and is unmapped with
    the last of them (so its memory can be lent to the caller); elsewhere as SharedMemory (its
    batches are copied out)."""
    path = os.path.join(_SHM_FOLDER, name)
    if not os.path.exists(path):
        # Attaching registers the name with the resource tracker that spawned workers share
        # with this process: a no-op, the worker's unlink unregisters it.
        return shared_memory.SharedMemory(name=name)
    descriptor = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, 0)
    finally:
        os.close(descriptor)


def _close(segment: mmap.mmap | shared_memory.SharedMemory) -> None:
    """Unmap ``segment`` here unless batches the caller still holds are arrays over it: their
    mapping then ends with the last of them (its name is unlinked all the same)."""
    try:
        segment.close()
    except BufferError:
        pass   # lent to arrays the caller holds: unmapped when the last of them is collected


def _join_all(processes: list[multiprocessing.process.BaseProcess], seconds: float) -> None:
    """Wait until every process of ``processes`` has ended or ``seconds`` have passed in all."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def worker_batches(make_loader: Callable[[], BatchSource], workers: int, start: int, total: int | None,
                   prefetch: int, build_here: Callable[[int], Batch] | None = None,
                   handed_over: Callable[[], None] | None = None) -> Iterator[Batch]:
    """Batches ``start, start + 1, ...`` (before ``total``) built by ``workers`` processes, about
    ``prefetch`` ahead in all (at least one per worker); the workers stop when this closes.

    While the workers start (a spawned interpreter importing lakeloader takes about a second),
    ``build_here`` (when given, and :data:`BUILD_WHILE_STARTING`) builds the batches in this
    process; the workers begin at the first step it has not built once every one of them is
    ready, and ``handed_over`` is called then (to free what building here kept)."""
    ring = BLOCK + max(1, -(-prefetch // workers)) + LENT
    pool = WorkerPool(make_loader, workers, total, ring)
    try:
        step = start
        if build_here is not None and BUILD_WHILE_STARTING:
            while (total is None or step < total) and not pool.ready():
                yield build_here(step)
                step += 1
            if handed_over is not None:
                handed_over()
        if total is None or step < total:
            pool.begin(step)
        while total is None or step < total:
            yield pool.batch(step)
            step += 1
    finally:
        pool.close()
