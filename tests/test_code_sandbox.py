"""The code sandbox against code that tries to get out (``grpolab.tools.code_sandbox``): each attempt is run once
as a plain subprocess (the sandbox's ``unsafe`` mode: the same rlimits and cleared environment, no isolation),
where it gets out, and once in the bubblewrap sandbox, where it ends as the call's error (or its limit's status),
never as a hang or a change outside the sandbox."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpolab.tools.code_sandbox import INSIDE_UID, CodeSandbox, SandboxLimits, SandboxUnavailable

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")

LIMITS = SandboxLimits(wall_seconds=6, cpu_seconds=2, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    return CodeSandbox(LIMITS)


@pytest.fixture(scope="module")
def plain():
    return CodeSandbox(LIMITS, unsafe=True)


@pytest.fixture
def listener():
    """A TCP server on the host's loopback, counting the connections it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield server
    server.close()


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except TimeoutError:
        return False


def test_a_socket_reaches_nothing_not_even_the_hosts_loopback(sandbox, plain, listener):
    port = listener.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
    assert plain.run(code).stdout.strip() == "connected" and _accepted(listener)
    run = sandbox.run(code)
    assert run.status == "error" and "connected" not in run.stdout and not _accepted(listener)
    assert "Error" in run.stderr.strip().splitlines()[-1]  # refused or unreachable: no network at all


def test_the_run_directory_and_the_home_directory_are_not_there(sandbox, plain, tmp_path):
    secret = tmp_path / "run" / "config.json"
    secret.parent.mkdir()
    secret.write_text("token-123")
    code = f"print(open({str(secret)!r}).read())"
    assert plain.run(code).stdout.strip() == "token-123"
    run = sandbox.run(code)
    assert run.status == "error" and "FileNotFoundError" in run.stderr and "token-123" not in run.stdout
    listing = sandbox.run("import os; print(sorted(os.listdir('/')))")
    assert listing.stdout.strip() == "['bin', 'dev', 'lib', 'lib64', 'proc', 'sandbox', 'tmp', 'usr']"


def test_the_trainers_environment_never_enters(sandbox, plain, monkeypatch):
    """Neither inherited nor read from ``/proc/PID/environ`` of a process of the trainer's (one started with
    the secret in its environment stands for it)."""
    monkeypatch.setenv("GRPOLAB_TEST_API_KEY", "sk-secret-42")
    trainer = subprocess.Popen(["sleep", "60"])
    code = (
        "import os\n"
        "seen = str(dict(os.environ))\n"
        f"for pid in [os.getppid(), {trainer.pid}, *[p for p in os.listdir('/proc') if p.isdigit()]]:\n"
        "    try: seen += open(f'/proc/{pid}/environ').read()\n"
        "    except OSError: pass\n"
        "print('sk-secret-42' in seen)"
    )
    try:
        assert plain.run(code).stdout.strip() == "True"  # the trainer's /proc/PID/environ, read from outside
        assert sandbox.run(code).stdout.strip() == "False"
    finally:
        trainer.kill()
        trainer.wait()


def test_nothing_outside_the_working_directory_can_be_written(sandbox, plain, tmp_path):
    target = tmp_path / "written.txt"
    code = f"open({str(target)!r}, 'w').write('x'); print('wrote')"
    assert plain.run(code).stdout.strip() == "wrote" and target.exists()
    target.unlink()
    run = sandbox.run(code)
    assert run.status == "error" and not target.exists()
    for path in ("/usr/evil", "/bin/evil", "/proc/evil"):
        assert sandbox.run(f"open({path!r}, 'w')").status == "error"
    assert (
        sandbox.run("open('/sandbox/scratch', 'w').write('ok'); print(open('/sandbox/scratch').read())").stdout
        == "ok\n"
    )


def test_a_host_process_cannot_be_signalled(sandbox, plain):
    for runner, survives in ((plain, False), (sandbox, True)):
        victim = subprocess.Popen(["sleep", "60"])
        try:
            runner.run(f"import os, signal; os.kill({victim.pid}, signal.SIGKILL)")
            time.sleep(0.1)
            assert (victim.poll() is None) == survives
        finally:
            victim.kill()
            victim.wait()


def test_a_fork_bomb_ends_at_the_process_limit_and_leaves_nothing(sandbox):
    start = time.monotonic()
    run = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert run.status in ("error", "timeout", "output_limit") and time.monotonic() - start < LIMITS.wall_seconds + 2
    assert "Resource temporarily unavailable" in run.stderr or run.status == "timeout"  # the limit stopped it
    assert _gone("main.py")  # every process of the bomb: killed with its namespace


def test_memory_past_the_limit_is_a_memory_error(sandbox):
    run = sandbox.run("x = bytearray(2 << 30)")
    assert run.status == "error" and run.stderr.strip().endswith("MemoryError")


def test_an_endless_loop_ends_at_the_cpu_limit_and_a_sleep_at_the_wall_clock(sandbox):
    loop = sandbox.run("while True: pass")
    assert loop.status == "timeout" and loop.seconds < LIMITS.cpu_seconds + 2
    sleep = sandbox.run("import time; time.sleep(600)")
    assert sleep.status == "timeout" and LIMITS.wall_seconds <= sleep.seconds < LIMITS.wall_seconds + 2


def test_a_gigabyte_of_output_is_cut_at_the_cap(sandbox):
    run = sandbox.run("import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert run.status == "output_limit" and run.stdout == "x" * LIMITS.output_bytes and run.seconds < 2


def test_no_process_outlives_its_call(sandbox, plain):
    """A child that detaches (double fork, a session of its own) and sleeps on: outside it outlives the call,
    inside it dies with the sandbox's pid namespace."""
    marker = "7.25"
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        null = os.open('/dev/null', os.O_RDWR)\n"
        "        for fd in (0, 1, 2): os.dup2(null, fd)\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('detached')"
    )
    try:
        assert plain.run(code).stdout.strip() == "detached"
        assert _appears(f"sleep\0{marker}")  # the grandchild may exec a moment after the call returns
    finally:
        for pid in _leftovers(f"sleep\0{marker}"):
            os.kill(pid, signal.SIGKILL)
    assert sandbox.run(code).stdout.strip() == "detached"
    assert _gone(f"sleep\0{marker}")


def test_ctypes_cannot_make_a_namespace_or_enter_one(sandbox, plain):
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = os.open(f'/proc/{os.getppid()}/ns/mnt', os.O_RDONLY)\n"
        "entered = libc.setns(fd, 0)  # the mount namespace of the process that started it\n"
        "made = libc.unshare(0x10000000)  # CLONE_NEWUSER\n"
        "print(entered, made)"
    )
    assert plain.run(code).stdout.split() == ["0", "0"]  # outside: its starter's namespace, and one of its own
    assert sandbox.run(code).stdout.split() == ["-1", "-1"]


def test_the_code_runs_as_an_unprivileged_user_with_no_capabilities(sandbox):
    run = sandbox.run(
        "import os\nprint(os.getuid(), os.getgid())\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])"
    )
    assert run.stdout.split() == [str(INSIDE_UID), str(INSIDE_UID), "0000000000000000"]


def test_a_sandbox_that_cannot_start_is_a_failure_not_the_codes_error(sandbox, monkeypatch):
    """bwrap failing is ``sandbox_failed`` (an infrastructure failure); code that prints what bwrap would
    print is still the code's own error."""
    assert sandbox.run("import sys; print('bwrap: fake', file=sys.stderr); sys.exit(1)").status == "error"
    monkeypatch.setattr(sandbox, "python", "/usr/bin/no-such-python")
    run = sandbox.run("print(1)")
    assert run.status == "sandbox_failed" and run.failed and "no-such-python" in run.stderr
    with pytest.raises(
        SandboxUnavailable, match="bwrap cannot start a sandbox here .* task.tools.sandbox.unsafe = true"
    ):
        CodeSandbox(python="/usr/bin/no-such-python")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="^bwrap not found: the code sandbox needs bubblewrap"):
        CodeSandbox()


def test_unsafe_mode_says_so(capfd):
    CodeSandbox(unsafe=True)
    assert "WITHOUT isolation" in capfd.readouterr().err


def test_calls_in_a_pool_come_back_in_order():
    runs = CodeSandbox(LIMITS, workers=2).run_many([f"print({i} * {i})" for i in range(6)])
    assert [r.stdout.strip() for r in runs] == [str(i * i) for i in range(6)]


def _appears(needle: str, seconds: float = 5.0) -> bool:
    """A host process holds ``needle`` in its command line, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not _leftovers(needle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _gone(needle: str, seconds: float = 3.0) -> bool:
    """No host process holds ``needle`` in its command line, within ``seconds`` (a namespace's processes are
    killed with it, and take a moment to exit)."""
    deadline = time.monotonic() + seconds
    while _leftovers(needle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _leftovers(needle: str) -> list[int]:
    """The host's processes whose command line holds ``needle`` (arguments joined by NUL), this one aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("bubblewrap is Linux only", allow_module_level=True)
