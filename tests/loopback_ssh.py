"""A private sshd on 127.0.0.1 for DeepSpeed's pdsh runner, as on a cluster, without touching the machine's ssh.

The packages (openssh-server, pdsh) are installed only here, on the test path, when missing and running as
root, with a policy-rc.d that forbids starting services so no system sshd comes up. The daemon runs from a
temporary directory: its own config, host key, port (127.0.0.1 only), authorized key and pid; it is stopped
by its pid. The client side is an `ssh` wrapper first on PATH that adds `-F <temporary config>` (port, key,
known_hosts): DeepSpeed's runner (its ssh check) and pdsh (its ssh rcmd module) both exec `ssh` from PATH, so
neither ~/.ssh nor a system sshd is read, written or started.

What runs on the "remote" side (a login's shell, DeepSpeed's remote launcher, its ranks) is sshd's, not the test's:
killing a timed-out launch kills its ssh clients, and the remote processes of a session without a terminal keep
running. `end_sessions` stops every login of the test daemons with all it started (tests/processes.py); the
daemon itself runs in a session of its own and is stopped the same way.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from processes import stop_tree


PACKAGES = {"sshd": "openssh-server", "pdsh": "pdsh", "ssh-keygen": "openssh-client"}
POLICY = Path("/usr/sbin/policy-rc.d")
PRIVSEP_DIR = Path("/run/sshd")  # compiled into Debian's sshd: it refuses to start without it
_daemons: dict[int, subprocess.Popen] = {}  # the test sshds running now, by port


def end_sessions() -> int:
    """Stop every login of the running test sshds, with everything each started; how many processes that was.
    A login's processes are the sshd's descendants, and - once the login itself is gone (its client killed),
    orphaned to PID 1 - still carry SSH_CONNECTION naming the daemon's port."""
    stopped = 0
    for port, daemon in list(_daemons.items()):
        try:
            logins = {login.pid for login in psutil.Process(daemon.pid).children()}
        except psutil.NoSuchProcess:
            logins = set()
        logins |= connected_to(port)
        stopped += sum(stop_tree(pid) for pid in logins)
    return stopped


def connected_to(port: int) -> set[int]:
    """Processes whose environment says they run in an ssh login to 127.0.0.1:`port`."""
    found = set()
    for proc in psutil.process_iter():
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(item.startswith(b"SSH_CONNECTION=") and item.endswith(f" 127.0.0.1 {port}".encode())
               for item in environ):
            found.add(proc.pid)
    return found


def missing_programs() -> list[str]:
    return [name for name in PACKAGES if shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]


def install_if_missing() -> str | None:
    """None when everything is there (or was installed); why the pdsh tests cannot run here when this machine
    cannot install packages (not root, no apt-get). An install that fails where it could work raises: a fresh CI
    machine must run these tests, not skip them."""
    missing = missing_programs()
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"needs {', '.join(PACKAGES[m] for m in missing)} (apt-get as root installs them)"
    had_policy = POLICY.exists()
    if not had_policy:  # invoke-rc.d asks it: 101 = do not start any service the packages bring
        POLICY.write_text("#!/bin/sh\nexit 101\n")
        POLICY.chmod(0o755)
    try:
        proc = _apt_install(sorted({PACKAGES[m] for m in missing}))
        if proc.returncode != 0:  # a fresh machine may have no package lists yet
            _apt("update", "-qq")
            proc = _apt_install(sorted({PACKAGES[m] for m in missing}))
    finally:
        if not had_policy:
            POLICY.unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(PACKAGES[m] for m in missing)} failed: {proc.stderr[-500:]}")
    return None


def _apt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *args], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                          capture_output=True, text=True)


def _apt_install(packages: list[str]) -> subprocess.CompletedProcess:
    return _apt("install", "-y", "-qq", "--no-install-recommends", *packages)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def wait_for_port(port: int, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the test sshd did not listen on 127.0.0.1:{port}")


@contextmanager
def loopback_sshd(root: Path, port: int, hosts=("localhost", "127.0.0.1")):
    """Yields a directory to put first on PATH (its `ssh` reaches the private sshd on `port` for `hosts`)."""
    root.mkdir(parents=True, exist_ok=True)
    keygen(root / "host_key")
    keygen(root / "client_key")
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        # StrictModes checks every directory up to / for group/world write: pytest's tmp is under /tmp (1777)
        f"StrictModes no\nAcceptEnv none\n")
    host_key = (root / "host_key.pub").read_text().split()
    (root / "known_hosts").write_text("".join(f"[{h}]:{port} {host_key[0]} {host_key[1]}\n" for h in hosts))
    (root / "ssh_config").write_text(
        f"Host {' '.join(hosts)}\n  Port {port}\n  IdentityFile {root / 'client_key'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {root / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
        f"  StrictHostKeyChecking yes\n  BatchMode yes\n")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {root / 'ssh_config'} \"$@\"\n")
    (bin_dir / "ssh").chmod(0o755)
    made_privsep = not PRIVSEP_DIR.exists()
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    sshd = subprocess.Popen([shutil.which("sshd", path="/usr/sbin:/usr/bin") or "/usr/sbin/sshd", "-D", "-e", "-f",
                             str(root / "sshd_config")], stdout=subprocess.DEVNULL, stderr=open(root / "sshd.log", "w"),
                            start_new_session=True)
    _daemons[port] = sshd
    try:
        wait_for_port(port)
        yield bin_dir
    finally:
        end_sessions()
        del _daemons[port]
        stop_tree(sshd.pid)  # by its pid and session: its logins go with it, no other sshd is touched
        sshd.wait()
        if made_privsep:
            shutil.rmtree(PRIVSEP_DIR, ignore_errors=True)
