"""Start one process per GPU on this host, with the environment torchrun would give them.

    python -m rtkernels.dist.run -n 2 script.py [args ...]
    python -m rtkernels.dist.run -n 2 -m pytest -q tests/test_ring_multigpu.py

Each process gets RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = n, MASTER_ADDR
(127.0.0.1) and MASTER_PORT (a free port unless ``--master-port``), plus NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 always: NVLink multicast stays off
(shared multi-GPU hosts).  :func:`rtkernels.dist.ring_attention` picks its device from LOCAL_RANK.

The exit status is 0 when every process exits 0; otherwise the first failure's status, after the
other processes are stopped (SIGTERM, then SIGKILL after 10 s), or 124 when ``--timeout`` passes.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from .comm import NO_MULTICAST_ENV


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, addr: str, port: int, base: dict | None = None) -> dict:
    """The environment of process ``rank``."""
    env = dict(os.environ if base is None else base)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    env.update(NO_MULTICAST_ENV)
    return env


def _stop(procs, grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(nproc: int, command: list[str], *, addr: str = "127.0.0.1", port: int | None = None,
           timeout: float | None = None) -> int:
    """Run ``command`` (argv after the interpreter) in ``nproc`` processes; the exit status."""
    port = free_port() if port is None else port
    procs = [subprocess.Popen([sys.executable, *command], env=rank_env(r, nproc, addr, port)) for r in range(nproc)]
    start = time.monotonic()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                print(f"rtkernels.dist.run: timeout after {timeout:.0f} s; stopping {nproc} processes",
                      file=sys.stderr, flush=True)
                _stop(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


_VALUED = {"-n", "--nproc", "--master-addr", "--master-port", "--timeout"}


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, command): everything from the script (or after ``-m module``) on is
    the command's, untouched - its own ``-q`` or ``--help`` included."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[:i], argv[i:]
        if a in _VALUED:
            i += 2
        elif a.startswith("-") and (a.split("=")[0] in _VALUED or a in ("-h", "--help")):
            i += 1
        elif a.startswith("-n") and a[2:].isdigit():   # -n2
            i += 1
        else:
            return argv[:i], argv[i:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m rtkernels.dist.run", description=__doc__.split("\n\n")[0],
                                usage="python -m rtkernels.dist.run -n N [options] (script.py | -m module) [args ...]")
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes (one per GPU)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port")
    p.add_argument("--timeout", type=float, default=None, help="seconds before every process is stopped")
    ours, command = _split(argv)
    a = p.parse_args(ours)
    if a.nproc < 1:
        p.error(f"-n must be at least 1, got {a.nproc}")
    if not command or command == ["-m"]:
        p.error("give a script to run (or -m module)")
    return launch(a.nproc, command, addr=a.master_addr, port=a.master_port, timeout=a.timeout)


if __name__ == "__main__":
    sys.exit(main())
