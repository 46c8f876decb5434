"""Run ``python -m hookexp`` with one fault injected, as the fault tests need a real process to kill.

    python tests/helpers/fault_runner.py MODE [hookexp overrides...]

Modes:
- ``kill_in_checkpoint:N``: the N-th checkpoint write stops halfway (SIGKILL): a torn temporary file is left.
- ``kill_in_metrics:N``: the N-th flush of the run's JSON lines writes half its bytes, then SIGKILL.
- ``kill_in_shutdown``: SIGKILL while the final plot is drawn (after training and validation).
- ``term_in_shutdown``: SIGTERM to itself while the final plot is drawn; the shutdown must go on.
- ``enospc_in_checkpoint:N``: the N-th checkpoint file fills the disk after 100 bytes (OSError ENOSPC inside
  torch.save, which torch's zip writer turns into a RuntimeError).
- ``term_after_finish``: SIGTERM to itself as it logs that the run finished.
- ``term_in_startup``: SIGTERM to itself while the run is built (before the first step).
- ``fsize:BYTES``: no file may grow beyond BYTES (RLIMIT_FSIZE; writes past it fail with EFBIG): a full disk.
- ``full_disk:BYTES``: ``fsize:BYTES``, and every log file (``logging.FileHandler``: cli.log, W&B's debug log)
  refuses writes with ENOSPC from the start, as on a disk that is full.
"""

from __future__ import annotations

import os
import resource
import signal
import sys


def _after(n: int, fn):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        return fn(calls["n"] == n, *args, **kwargs)

    return wrapper


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    name, _, value = mode.partition(":")
    if name == "kill_in_checkpoint":
        import torch

        real_save = torch.save

        def save(hit, obj, f, *a, **k):
            if not hit:
                return real_save(obj, f, *a, **k)
            real_save(obj, f, *a, **k)
            f.flush()
            f.truncate(f.tell() // 2)  # half the bytes reached the disk
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = _after(int(value), save)  # every module of hookexp.run.checkpoint calls torch.save
    elif name == "kill_in_metrics":
        from hookexp.run.sinks import files as sinks  # JsonLines writes through this module's os

        real_write = os.write
        fds: set[int] = set()
        real_open = os.open

        def opened(path, flags, mode=0o777):
            fd = real_open(path, flags, mode)
            if str(path).endswith("metrics.jsonl"):
                fds.add(fd)
            return fd

        def write(hit, fd, data):
            if fd in fds and hit:
                real_write(fd, bytes(data)[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(fd, data)

        counted = _after(int(value), write)
        sinks.os = type(os)("os_shim")  # the module's own view of os, patched
        sinks.os.__dict__.update(os.__dict__)
        sinks.os.open = opened
        sinks.os.write = lambda fd, data: counted(fd, data) if fd in fds else real_write(fd, data)
    elif name in ("kill_in_shutdown", "term_in_shutdown"):
        from hookexp.run import trainer as train

        real_plot = train.plot_grad_norms
        sig = signal.SIGKILL if name == "kill_in_shutdown" else signal.SIGTERM

        def plot(*a, **k):
            os.kill(os.getpid(), sig)
            return real_plot(*a, **k)

        train.plot_grad_norms = plot
    elif name == "enospc_in_checkpoint":
        import errno
        import io

        from hookexp.run.checkpoint import checkpointer, files, sharded

        class Full(io.FileIO):
            def write(self, data):
                if self.tell() + len(data) > 100:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return super().write(data)

        def opened(hit, path, mode="r", *a, **k):
            return Full(path, mode) if hit else open(path, mode, *a, **k)

        counted = _after(int(value), opened)  # one count over the modules that open checkpoint files
        for module in (checkpointer, files, sharded):
            module.open = counted  # type: ignore[attr-defined]
    elif name == "term_after_finish":
        import logging

        class Term(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                if record.getMessage().startswith("finished "):
                    os.kill(os.getpid(), signal.SIGTERM)
                return True

        logging.getLogger("hookexp").addFilter(Term())
    elif name == "term_in_startup":
        from hookexp.run import loop

        real_build = loop.build

        def build(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real_build(*a, **k)

        loop.build = build
    elif name in ("fsize", "full_disk"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.RLIM_INFINITY))
        if name == "full_disk":
            import errno
            import io
            import logging

            class Full(io.StringIO):
                def write(self, text):
                    raise OSError(errno.ENOSPC, "No space left on device")

            logging.FileHandler._open = lambda self: Full()
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.argv = ["hookexp", *args]
    from hookexp.cli import main as hookexp_main

    hookexp_main()


if __name__ == "__main__":
    main()
