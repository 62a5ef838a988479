"""A fork server for the tests' `python -m qconvert ARGS` (helpers.run_cli): one process imports the CLI once
(torch's import is 1.7 of the 2.4 s every command spends starting), then forks a fresh child per command.

The child is a new process as a user's would be: its own exit status, its stdout and stderr in files, the
caller's working directory and environment. What the import printed (warnings) is written again at the start of
every child's stderr / stdout, so a test that wants one line on stderr still sees what a user would. The server
only ever imports: no torch or OpenMP thread pool has started when it forks (numpy's OpenBLAS pool has, and
OpenBLAS re-creates it in a forked child, as multiprocessing's fork start method relies on).

Protocol (one JSON object per line): request {"argv", "cwd", "env", "stdout", "stderr"}, answer {"rc"}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _import_capturing_output() -> tuple[bytes, bytes]:
    """Import the CLI with fds 1 and 2 sent to files; return what the import wrote to each."""
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            import qconvert.converters.apps.cli  # noqa: F401
            from qconvert.converters.class_tensors import preload

            preload()  # transformers' model machinery (2-4 s), which non-llama checkpoints' checks import
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return out.read(), err.read()


def _child(req: dict, import_out: bytes, import_err: bytes, import_env: dict) -> None:
    """In the forked child: become the command, then exit with its status (never returns)."""
    rc = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        sys.stdin = open(0, closefd=False)  # not the server's protocol stream (it may hold read-ahead)
        for fd, path, prefix in ((1, req["stdout"], import_out), (2, req["stderr"], import_err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(f, prefix)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for k, v in import_env.items():  # what the import set unless already set (cli.py's OMP_WAIT_POLICY)
            os.environ.setdefault(k, v)
        sys.argv = ["qconvert", *req["argv"]]
        from qconvert.converters.apps.cli import main

        try:
            result = main()
            rc = 0 if result is None else int(result)
        except SystemExit as e:  # what `sys.exit(main())` in qconvert/__main__.py turns into the status
            code = e.code
            if code is None:
                rc = 0
            elif isinstance(code, int):
                rc = code
            else:
                print(code, file=sys.stderr)
                rc = 1
    except BaseException:  # noqa: BLE001  (as the interpreter would: a traceback and status 1)
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def serve() -> None:
    before = dict(os.environ)
    import_out, import_err = _import_capturing_output()
    import_env = {k: v for k, v in os.environ.items() if k not in before}
    protocol_in, protocol_out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb", buffering=0)
    protocol_out.write(b'{"ready": true}\n')
    for line in protocol_in:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, import_out, import_err, import_env)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        protocol_out.write(json.dumps({"rc": rc}).encode() + b"\n")


if __name__ == "__main__":
    serve()
