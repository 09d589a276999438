"""`python -m dtp` without paying for its imports on every call: multiprocessing's fork server,
which imports torch, transformers and dtp's commands once, forks one child per command line.

Importing them is 2–3 s of CPU per command line, most of what a test of a usage error costs;
with about 80 command lines in the suite that is minutes on two cores. The child is what
`python -m dtp` is once its imports are done: the environment, working directory and `sys.path`
that command line would have, stdin on /dev/null, stdout and stderr captured, `dtp/__main__.py`
run as `__main__`, atexit handlers run at its exit, its exit status `python -m dtp`'s.

What a forked child cannot be is a fresh process: a variable read while torch is imported takes
the server's value, and /proc/PID/environ (where tests look for their marker) keeps the server's.
conftest.dtp_cli therefore sends a call with an environment of its own, or one made while the
test's environment differs from the server's, to a fresh interpreter.
"""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import tempfile
from multiprocessing import forkserver
from pathlib import Path

# what the dtp commands import on first use (dtp/cli/*.py)
PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "transformers",
    "dtp.cli",
    "dtp.verify.apply",
    "dtp.train.session",
    "dtp.fuzz.session",
    "dtp.simulate.session",
    "dtp.auto.planner",
    "dtp.generate.command",
    "dtp.checkpoint.export",
    "dtp.hf.plan",
]

# pytest names the running test in PYTEST_CURRENT_TEST; torch sets TORCHINDUCTOR_CACHE_DIR to the
# default it computes, as a fresh interpreter's torch would: neither is a test's change
_NOT_A_CHANGE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


class Zygote:
    """The fork server of this process and what a `python -m dtp` child of it must be given."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        # the test's environment as the server starts: a call made under another is not forked
        self.env = dict(os.environ)
        # sys.path as `python -m dtp` run from cwd has it (not pytest's, which holds tests/)
        out = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        self.path = [str(cwd), *json.loads(out.stdout)]
        self.context = mp.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        # as every call has them (dtp_cli's one thread; dtp's entry point sets the log level
        # before torch is imported, which reads it then): the server imports torch
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(self.env)

    def serves(self, env: dict | None) -> bool:
        """Whether a call can be forked: no environment of its own, and the test's is the
        server's."""
        return env is None and not self.changed()

    def changed(self) -> list[str]:
        """The variables the test's environment has changed since the server started."""
        now, then = _settled(os.environ), _settled(self.env)
        return sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))

    def run(
        self, args: list[str], env: dict, timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """`python -m dtp ARGS` in a forked child (run from `cwd`, the server's unless given);
        subprocess.run's result and timeout."""
        cwd = cwd or self.cwd
        # as -m has it: the working directory first, then PYTHONPATH's entries, then the rest
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        path = [str(cwd), *[p for p in extra if p not in self.path[1:]], *self.path[1:]]
        with tempfile.TemporaryDirectory(prefix="dtp-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            cmd = [sys.executable, "-m", "dtp", *args]
            child = self.context.Process(
                target=_child, args=(args, str(cwd), env, path, str(out), str(err))
            )
            child.start()
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
            return subprocess.CompletedProcess(cmd, child.exitcode, _read(out), _read(err))


@functools.cache
def zygote(cwd: Path) -> Zygote:
    """This process's server (one per pytest worker), started on first use."""
    return Zygote(cwd)


def _settled(env) -> dict:
    return {k: v for k, v in env.items() if k not in _NOT_A_CHANGE}


def _read(path: Path) -> str:
    # as subprocess.run(text=True) decodes: the locale's encoding, universal newlines
    return path.read_text() if path.exists() else ""


def _child(args: list[str], cwd: str, env: dict, path: list[str], out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [sys.executable, *args]  # runpy puts dtp/__main__.py's path first, as -m does
    try:
        runpy.run_module("dtp", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # the fork server's child leaves through os._exit, which skips them
