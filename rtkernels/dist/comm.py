"""Communicators for the ring: one operation, :meth:`Comm.shift` - send arrays to the next rank
and receive as many from the previous one, queued on a communication stream after the work
already queued on a given stream, returning a :class:`Pending` the compute stream waits on.

* :class:`NcclComm` - NCCL point-to-point through CuPy's binding (``cupy.cuda.nccl``): one
  ``groupStart``/``send``/``recv``/``groupEnd`` per shift on the communicator's own stream.
  :func:`default_comm` builds it from the usual environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, as ``torchrun`` and
  ``python -m rtkernels.dist.run`` set them; Open MPI's ``OMPI_COMM_WORLD_*`` are read too); the
  NCCL unique id travels through torch's ``TCPStore`` when torch is installed, otherwise through
  ``cupyx.distributed.init_process_group``'s store.
* :class:`TorchComm` - a ``torch.distributed`` process group the caller already has (NCCL
  backend): ``batch_isend_irecv`` on the communication stream.
* :class:`SimulatedComm` - ``world_size`` ranks in one process (threads), on one GPU or on the
  CPU with NumPy arrays: each rank runs the very same ring code with its own compute stream;
  a shift meets the other ranks at a barrier and the copies run on one shared stream.  The tests
  and the single-GPU benchmark use it.

All ranks must call :meth:`Comm.shift` the same number of times with arrays of matching sizes;
the simulated communicator checks this, NCCL does not (a mismatch hangs or corrupts).
"""
from __future__ import annotations

import abc
import os
import threading
from typing import Any, Callable, Sequence

from ..errors import ConfigError

# Environment variables the launcher always sets: NVLink SHARP / multicast stays off on the
# shared multi-GPU hosts (the machines' rules), for NCCL, torch's symmetric memory and NVSHMEM.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Pending:
    """A shift in flight: :meth:`wait` makes a stream wait for it (no host wait)."""

    __slots__ = ("event",)

    def __init__(self, event=None):
        self.event = event

    def wait(self, stream) -> None:
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)


class Comm(abc.ABC):
    """A ring of ``world_size`` ranks; this process is ``rank``."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def shift(self, send: Sequence[Any], recv: Sequence[Any], after) -> Pending:
        """Queue: send each array of ``send`` to rank + 1 and receive each of ``recv`` (same sizes,
        contiguous) from rank - 1, after the work queued so far on the stream ``after``.  The
        arrays must not change until the returned :class:`Pending` completes."""

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class SingleComm(Comm):
    """One rank: the ring has a single step and never shifts."""

    def __init__(self):
        self.rank, self.world_size = 0, 1

    def shift(self, send, recv, after) -> Pending:
        raise RuntimeError("SingleComm.shift: a ring of one rank has nothing to send")


def _record(stream):
    import cupy
    ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
    ev.record(stream)
    return ev


def _check_contiguous(arrays, what: str) -> None:
    for i, a in enumerate(arrays):
        if not a.flags.c_contiguous:
            raise ConfigError(f"shift: {what}[{i}] of shape {tuple(a.shape)} is not contiguous (NCCL sends "
                              "contiguous memory)", family="ring_attention", field=what)


class NcclComm(Comm):
    """NCCL point-to-point over ``cupy.cuda.nccl.NcclCommunicator``.

    Parameters
    ----------
    nccl_comm : a ``cupy.cuda.nccl.NcclCommunicator`` of ``world_size`` ranks.
    rank, world_size : this rank and the ring's size.
    device : the CUDA device of this rank (default: the current one).
    keepalive : anything that must live as long as the communicator (a store).
    """

    def __init__(self, nccl_comm, rank: int, world_size: int, device: int | None = None, keepalive=None):
        import cupy
        self._nccl = nccl_comm
        self.rank, self.world_size = int(rank), int(world_size)
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self._keepalive = keepalive
        with cupy.cuda.Device(self.device):
            # the communication stream: non-blocking, so the legacy default stream does not
            # serialize it with the compute stream
            self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_env(cls) -> "NcclComm":
        """Bootstrap from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (see module doc)."""
        import cupy
        from cupy.cuda import nccl
        if not nccl.available:
            raise RuntimeError("NcclComm: CuPy's NCCL binding is not available (pip install nvidia-nccl-cu13, "
                               "or pass comm= a torch.distributed process group)")
        env = read_env()
        cupy.cuda.Device(env["local_rank"]).use()
        # one key per torchrun restart: the agent's store outlives the workers
        uid_key = "rtkernels/nccl_unique_id/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            import torch.distributed as tdist
        except ImportError:
            tdist = None
        if tdist is not None:
            # Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            from datetime import timedelta
            store = tdist.TCPStore(env["master_addr"], env["master_port"], env["world_size"],
                                   is_master=env["rank"] == 0 and not agent, timeout=timedelta(seconds=300))
            if env["rank"] == 0:
                uid = nccl.get_unique_id()
                store.set(uid_key, _encode_uid(uid))
            else:
                uid = _decode_uid(store.get(uid_key).decode())
            comm = nccl.NcclCommunicator(env["world_size"], uid, env["rank"])
            return cls(comm, env["rank"], env["world_size"], env["local_rank"], keepalive=store)
        import cupyx.distributed
        backend = cupyx.distributed.init_process_group(env["world_size"], env["rank"], host=env["master_addr"],
                                                       port=env["master_port"])
        # cupyx's backend exchanged the unique id through its store and holds the communicator;
        # its own send/recv take only dtypes NCCL names (no bfloat16 bits), so the ring sends bytes
        # through the communicator itself.
        return cls(backend._comm, env["rank"], env["world_size"], env["local_rank"], keepalive=backend)

    def shift(self, send, recv, after) -> Pending:
        from cupy.cuda import nccl
        _check_contiguous(send, "send")
        _check_contiguous(recv, "recv")
        self.stream.wait_event(_record(after))
        s = self.stream.ptr
        nccl.groupStart()
        try:
            for a in send:
                self._nccl.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, self.next_rank, s)
            for a in recv:
                self._nccl.recv(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, self.prev_rank, s)
        finally:
            nccl.groupEnd()
        return Pending(_record(self.stream))


class TorchComm(Comm):
    """A ``torch.distributed`` process group (NCCL backend) as the ring's communicator."""

    def __init__(self, group=None):
        import cupy
        import torch
        import torch.distributed as tdist
        self._torch, self._dist, self.group = torch, tdist, group
        self.rank = tdist.get_rank(group)
        self.world_size = tdist.get_world_size(group)
        self._next = tdist.get_global_rank(group, self.next_rank) if group is not None else self.next_rank
        self._prev = tdist.get_global_rank(group, self.prev_rank) if group is not None else self.prev_rank
        self.device = torch.cuda.current_device()
        with cupy.cuda.Device(self.device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._torch_stream = torch.cuda.ExternalStream(self.stream.ptr, device=self.device)

    def _bytes(self, a):
        """A uint8 torch view of a contiguous CuPy array (NCCL moves bytes; bfloat16 bits included)."""
        import cupy
        return self._torch.from_dlpack(a.reshape(-1).view(cupy.uint8))

    def shift(self, send, recv, after) -> Pending:
        _check_contiguous(send, "send")
        _check_contiguous(recv, "recv")
        self.stream.wait_event(_record(after))
        dist = self._dist
        with self._torch.cuda.stream(self._torch_stream):
            # byte views made here: DLPack orders them on torch's current stream, this one
            ops = [dist.P2POp(dist.isend, self._bytes(a), self._next, self.group) for a in send]
            ops += [dist.P2POp(dist.irecv, self._bytes(a), self._prev, self.group) for a in recv]
            for work in dist.batch_isend_irecv(ops):
                work.wait()   # the communication stream waits for the transfer (no host wait)
        return Pending(_record(self.stream))


class SimulatedComm:
    """``world_size`` ranks in one process: :meth:`run` calls ``fn(comm)`` once per rank, each in
    its own thread with its own communicator (and, on a GPU, its own compute stream made
    current), and returns the results in rank order.

    Parameters
    ----------
    world_size : ranks in the ring.
    device : "cuda" (CuPy arrays on the current GPU) or "cpu" (NumPy arrays: the schedule alone,
        with the float64 reference kernels).

    A shift waits at a barrier for every rank's shift of the same round; the last rank to arrive
    queues all ranks' copies (recv of rank r <- send of rank r - 1) on one stream after every
    rank's queued work, and each rank's next work waits for that stream.  An exception in one
    rank breaks the barrier for the others and is raised from :meth:`run`.
    """

    def __init__(self, world_size: int, device: str = "cuda"):
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError.bad_value("SimulatedComm", "world_size", world_size, "a positive int")
        if device not in ("cuda", "cpu"):
            raise ConfigError.bad_value("SimulatedComm", "device", device, "'cuda' or 'cpu'")
        self.world_size, self.device = world_size, device
        self._barrier = None
        self._posts: list = [None] * world_size
        self._done = None
        self._wire = None
        self._streams: list = []
        self.rounds = 0

    def ranks(self) -> list["_SimulatedRank"]:
        return [_SimulatedRank(self, r) for r in range(self.world_size)]

    def run(self, fn: Callable[[Comm], Any]) -> list:
        """``[fn(comm_0), ..., fn(comm_{N-1})]``, the ranks running concurrently."""
        n = self.world_size
        self._barrier = threading.Barrier(n, action=self._exchange)
        self.rounds = 0
        results: list = [None] * n
        errors: list = [None] * n
        gpu = self.device == "cuda"
        if gpu:
            import cupy
            dev = cupy.cuda.runtime.getDevice()
            caller = cupy.cuda.get_current_stream()
            start = _record(caller)
            self._wire = cupy.cuda.Stream(non_blocking=True)
            # one compute stream per rank, kept while this object lives: the pools (CuPy's and
            # torch's) file what a rank freed under its stream
            while len(self._streams) < n:
                self._streams.append(cupy.cuda.Stream(non_blocking=True))
        ends = [None] * n

        def body(rank: int) -> None:
            comm = _SimulatedRank(self, rank)
            try:
                if gpu:
                    import cupy
                    with cupy.cuda.Device(dev):
                        stream = self._streams[rank]
                        stream.wait_event(start)   # the shards were made on the caller's stream
                        with stream, _torch_stream(stream, dev):
                            results[rank] = fn(comm)
                        ends[rank] = _record(stream)
                else:
                    results[rank] = fn(comm)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other ranks stop
                errors[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rtk-sim-rank{r}") for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        if gpu:
            for ev in ends:
                caller.wait_event(ev)
        return results

    def _post(self, rank: int, send, recv, after) -> Pending:
        event = _record(after) if self.device == "cuda" else None
        self._posts[rank] = (list(send), list(recv), event)
        self._barrier.wait()
        return Pending(self._done)

    def _exchange(self) -> None:
        """The barrier's action (one thread, every rank waiting): round ``self.rounds``'s copies."""
        n = self.world_size
        posts = self._posts
        for r in range(n):
            send, recv = posts[(r - 1) % n][0], posts[r][1]
            if len(send) != len(recv) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(send, recv)):
                raise ConfigError(f"SimulatedComm: round {self.rounds}: rank {r} receives "
                                  f"{[(tuple(b.shape), str(b.dtype)) for b in recv]} but rank {(r - 1) % n} sends "
                                  f"{[(tuple(a.shape), str(a.dtype)) for a in send]}", family="ring_attention")
        if self.device == "cuda":
            import cupy
            for _, _, ev in posts:
                self._wire.wait_event(ev)
            with self._wire:
                for r in range(n):
                    for a, b in zip(posts[(r - 1) % n][0], posts[r][1]):
                        cupy.copyto(b, a)
            self._done = _record(self._wire)
        else:
            # every rank's sends are read before any receive lands (a rank may send the array it receives into)
            staged = [[a.copy() for a in posts[(r - 1) % n][0]] for r in range(n)]
            for r in range(n):
                for a, b in zip(staged[r], posts[r][1]):
                    b[...] = a
            self._done = None
        self._posts = [None] * n
        self.rounds += 1


def _torch_stream(stream, dev: int):
    """torch's current stream set to ``stream`` in this thread when torch is loaded (torch tensors
    launch on torch's current stream), else nothing."""
    import contextlib
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=dev))


class _SimulatedRank(Comm):
    def __init__(self, sim: SimulatedComm, rank: int):
        self._sim, self.rank, self.world_size = sim, rank, sim.world_size

    def shift(self, send, recv, after) -> Pending:
        return self._sim._post(self.rank, send, recv, after)


# ---- bootstrap ------------------------------------------------------------------------------
def _env_int(names: Sequence[str], default: int | None = None) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ConfigError(f"ring_attention: environment variable {n}={v!r} is not an integer",
                                  family="ring_attention", field=n, value=v, allowed="an integer") from None
    return default


def read_env() -> dict:
    """rank, world_size, local_rank, master_addr, master_port from the environment (torchrun /
    rtkernels.dist.run names; Open MPI's as a fallback)."""
    world = _env_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)
    rank = _env_int(("RANK", "OMPI_COMM_WORLD_RANK"), 0)
    local = _env_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), rank)
    if not 0 <= rank < world:
        raise ConfigError(f"ring_attention: RANK={rank} is outside [0, WORLD_SIZE={world})", family="ring_attention",
                          field="RANK", value=rank, allowed=f"[0, {world})")
    return {"rank": rank, "world_size": world, "local_rank": local,
            "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": _env_int(("MASTER_PORT",), 29500)}


_DEFAULT: Comm | None = None
_TORCH_COMMS: dict = {}
_LOCK = threading.Lock()


def default_comm() -> Comm:
    """The process's communicator, built once: torch's default process group when
    ``torch.distributed`` is initialized (its store already holds MASTER_PORT); else
    :class:`SingleComm` when WORLD_SIZE is unset or 1; else :class:`NcclComm` from the environment,
    or, where CuPy has no NCCL library, torch's NCCL process group initialized from it."""
    global _DEFAULT
    import sys
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        return resolve(tdist.group.WORLD)
    with _LOCK:
        if _DEFAULT is None:
            env = read_env()
            if env["world_size"] == 1:
                _DEFAULT = SingleComm()
            elif _cupy_nccl_available():
                _DEFAULT = NcclComm.from_env()
            else:
                _DEFAULT = _torch_from_env(env)
        return _DEFAULT


def _cupy_nccl_available() -> bool:
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(nccl.available)


def _torch_from_env(env: dict) -> "TorchComm":
    """Without CuPy's NCCL: torch's NCCL process group from the same environment (env://)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        raise RuntimeError("ring_attention: WORLD_SIZE > 1 needs NCCL: CuPy's binding (pip install "
                           "nvidia-nccl-cu13) or torch.distributed") from None
    torch.cuda.set_device(env["local_rank"])
    import cupy
    cupy.cuda.Device(env["local_rank"]).use()
    tdist.init_process_group("nccl", device_id=torch.device("cuda", env["local_rank"]))
    comm = _TORCH_COMMS[id(tdist.group.WORLD)] = TorchComm(tdist.group.WORLD)   # the caller holds _LOCK
    return comm


def resolve(comm) -> Comm:
    """``comm`` as a :class:`Comm`: None -> :func:`default_comm`; a torch ProcessGroup -> a cached
    :class:`TorchComm`."""
    if comm is None:
        return default_comm()
    if isinstance(comm, Comm):
        return comm
    if type(comm).__module__.startswith("torch"):
        with _LOCK:
            hit = _TORCH_COMMS.get(id(comm))
            if hit is None or hit.group is not comm:
                hit = _TORCH_COMMS[id(comm)] = TorchComm(comm)
            return hit
    raise TypeError(f"ring_attention: comm must be None, an rtkernels.dist.Comm or a torch.distributed "
                    f"ProcessGroup, got {type(comm).__name__}")


def _encode_uid(uid) -> str:
    """NCCL's unique id as text for a store: CuPy 14 hands out (and its NcclCommunicator takes)
    bytes, older CuPy a tuple of ints; the type travels with the value (a tuple where bytes are
    expected failed on the second rank: 2x H100, 2026-11-25)."""
    if isinstance(uid, (bytes, bytearray)):
        return "b:" + bytes(uid).hex()
    return "t:" + ",".join(map(str, uid))


def _decode_uid(text: str):
    kind, _, data = text.partition(":")
    if kind == "b":
        return bytes.fromhex(data)
    return tuple(int(x) for x in data.split(","))
