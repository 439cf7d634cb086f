"""A real two-node Slurm cluster on one Linux machine: the course's practice cluster (``make cluster``)
and the test suite's (notebooks 04-06 and tests/test_slurm.py submit to it).

One ``slurmctld`` in the root network namespace and two ``slurmd`` "nodes",
each in its own network namespace (own hostname, address and loopback),
joined by a bridge. Fake GPUs are character devices listed in gres.conf
(typed ``a100`` x2 as on FT3 and ``rtx`` x4 as on Frontera), and
``config_overrides`` lets the nodes advertise more cores and memory than the
machine has. ``auth/none`` means no munge. Needs root (or sudo) and Debian's
``slurm-wlm`` (installed here when missing).

    python slurm/practice_cluster.py up      # leaves it running (a second up keeps it); prints SLURM_CONF
    python slurm/practice_cluster.py down    # removes all it added: daemons, namespaces, bridge, hosts lines
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The standard library only: it runs before the course's environment exists, and under sudo's environment.
CLUSTER_NAME = "coursetest"  # how the notebooks know this cluster (course_utils.slurm.TEST_CLUSTER)

WORKDIR = Path(os.environ.get("COURSE_SLURM_DIR", "/tmp/course-slurm"))
BRIDGE, SUBNET = "cslbr0", "10.77.0"
CONTROLLER = (socket.gethostname().split(".")[0], f"{SUBNET}.1")  # slurmctld checks its own name
NODES = [("cnode1", f"{SUBNET}.11"), ("cnode2", f"{SUBNET}.12")]
HOSTS_MARK = "# course-slurm-test"


@dataclass(frozen=True)
class Layout:
    """What the two nodes offer and how they are queued."""
    partitions: tuple[str, ...]  # the first is the default
    cpus: int
    memory_mb: int
    gpus: tuple[tuple[str, int], ...]  # (type, count) on each node


# The course's: FT3's typed A100s and Frontera's queue names and RTX cards on the same nodes
COURSE = Layout(("debug", "rtx", "rtx-dev"), cpus=64, memory_mb=256000, gpus=(("a100", 2), ("rtx", 4)))
# Another centre's, for slurm/generate.py --detect: other queues, one GPU type, another core count
OTHER = Layout(("standard", "gpu-long"), cpus=32, memory_mb=190000, gpus=(("v100", 4),))
LAYOUTS = {"course": COURSE, "other": OTHER}
PARTITIONS = COURSE.partitions


class ClusterError(RuntimeError):
    pass


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch")
APT_DIR = Path("/etc/apt")
APT_PROBE_S = 3.0  # apt-get's own timeouts and retries take minutes on a machine without a network


def unavailable_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if sys.platform != "linux":
        return "the Slurm test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (namespaces, slurmd); CI runs as root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    blocked = _install_blocked() if missing else None
    if blocked:
        return f"slurm-wlm is not installed ({', '.join(missing)} missing) and {blocked}"
    return None


def _install_blocked() -> str | None:
    """Why apt-get must not try to install here now, or None (it may)."""
    if os.environ.get("COURSE_NO_APT"):
        return ("COURSE_NO_APT is set (make gpu-check sets it: its notebook runs install nothing); to have it, "
                "run apt-get install slurm-wlm shellcheck first")
    if shutil.which("apt-get") is None:
        return "apt-get is not here: install slurm-wlm (Slurm 22.05) and shellcheck with this system's package manager"
    unreachable = _apt_unreachable(str(APT_DIR))
    if unreachable:
        return (f"{unreachable}: install slurm-wlm and shellcheck once apt reaches a mirror (COURSE_NO_APT=1 "
                "skips this check)")
    return None


def _apt_config() -> str:
    """apt's configuration (where its proxy, if any, is set)."""
    try:
        return subprocess.run(["apt-config", "dump"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _apt_targets(apt_dir: Path, config: str, environ: dict[str, str]) -> list[tuple[str, int]] | None:
    """The (host, port) pairs apt-get would connect to: its proxy where one is set, else its sources'
    hosts; None where a source is local (file:, cdrom:), which needs no network."""
    from urllib.parse import urlsplit

    proxies = re.findall(r'^Acquire::https?::Proxy "([^"]+)";', config, re.M)
    proxies += [environ[k] for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY") if environ.get(k)]
    uris = [u for u in proxies if u.lower() not in ("direct", "false")]
    if not uris:
        for path in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]:
            lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
            for line in lines:  # one-line format: deb [options] URI suite components
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 2 and words[0] in ("deb", "deb-src"):
                    uris.append(words[1])
        for path in sorted((apt_dir / "sources.list.d").glob("*.sources")):  # deb822 format
            for stanza in re.split(r"\n\s*\n", path.read_text(errors="replace")):
                if re.search(r"^Enabled:\s*no\b", stanza, re.M | re.I):
                    continue
                for match in re.findall(r"^URIs:(.*)$", stanza, re.M):
                    uris += match.split()
    targets = []
    for uri in uris:
        parts = urlsplit(uri.split("+", 1)[1] if re.match(r"^\w+\+\w+:", uri) else uri)  # mirror+http, tor+http
        if parts.scheme in ("file", "cdrom", "copy"):
            return None
        if parts.hostname:
            targets.append((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    return list(dict.fromkeys(targets))


def _reachable(targets: list[tuple[str, int]], timeout_s: float = APT_PROBE_S) -> bool:
    """Whether any target accepts a TCP connection within ``timeout_s`` (the name lookup included)."""
    import threading

    answered = threading.Event()

    def probe(host: str, port: int) -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                answered.set()
        except OSError:
            pass

    threads = [threading.Thread(target=probe, args=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while not answered.is_set() and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        answered.wait(0.05)
    return answered.is_set()


def _apt_unreachable_uncached(apt_dir: str) -> str | None:
    targets = _apt_targets(Path(apt_dir), _apt_config(), dict(os.environ))
    if targets is None:
        return None
    if not targets:
        return f"apt has no sources in {apt_dir}"
    if _reachable(targets):
        return None
    where = ", ".join(f"{h}:{p}" for h, p in targets[:4]) + (" ..." if len(targets) > 4 else "")
    return f"apt-get cannot reach its sources here ({where}: no answer within {APT_PROBE_S:g} s)"


_APT_SEEN: dict[str, str | None] = {}


def _apt_unreachable(apt_dir: str) -> str | None:
    """Why apt-get could not download here now, or None; asked once per process (every notebook cell of
    04-06 asks unavailable_reason())."""
    if apt_dir not in _APT_SEEN:
        _APT_SEEN[apt_dir] = _apt_unreachable_uncached(apt_dir)
    return _APT_SEEN[apt_dir]


def ensure_installed() -> str | None:
    """Debian's slurm-wlm (22.05) and shellcheck, installed when missing (as root); or why nothing was
    installed (a machine apt cannot fetch from, or COURSE_NO_APT), for the caller to say."""
    missing = [t for t in (*SLURM_TOOLS, "shellcheck") if shutil.which(t) is None]
    if not missing:
        return None
    blocked = _install_blocked()
    if blocked:
        return f"{', '.join(missing)} not installed, and nothing was installed: {blocked}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "shellcheck"]):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    return None


SLURMCTLD_PORT = 6817  # Slurm's default: a machine with Slurm of its own holds it already


def free_port(wanted: int, free=None) -> int:
    """``wanted`` where nothing listens on it here, else a port the system gives free now."""
    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
        return True

    free = free or bindable
    if free(wanted):
        return wanted
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _config(work: Path, port: int = SLURMCTLD_PORT, layout: Layout = COURSE) -> str:
    gres = ",".join(f"gpu:{kind}:{count}" for kind, count in layout.gpus)
    nodes = "\n".join(
        f"NodeName={name} NodeAddr={addr} NodeHostname={name} CPUs={layout.cpus} RealMemory={layout.memory_mb} "
        f"Gres={gres} State=UNKNOWN"
        for name, addr in NODES
    )
    names = ",".join(n for n, _ in NODES)
    parts = "\n".join(
        f"PartitionName={p} Nodes={names} Default={'YES' if p == layout.partitions[0] else 'NO'} MaxTime=INFINITE "
        "State=UP"
        for p in layout.partitions
    )
    return f"""# generated by slurm/practice_cluster.py
ClusterName={CLUSTER_NAME}
MailProg=/bin/true
FirstJobId={(int(time.time()) % 6_000_000) * 10 + 1000}
SlurmctldHost={CONTROLLER[0]}({CONTROLLER[1]})
SlurmctldPort={port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool-%n
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%n.pid
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=5
InactiveLimit=0
SchedulerParameters=sched_interval=1
{nodes}
{parts}
"""


def _gres(work: Path, layout: Layout = COURSE) -> str:
    names = ",".join(n for n, _ in NODES)
    return "".join(f"NodeName={names} Name=gpu Type={kind} File={work}/dev/{kind}-[0-{count - 1}]\n"
                   for kind, count in layout.gpus)


class SlurmTestCluster:
    def __init__(self, work: Path = WORKDIR) -> None:
        self.work = work
        self.conf = work / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ #
    def up(self, timeout: float = 60, layout: Layout = COURSE) -> None:
        reason = unavailable_reason()
        if reason:
            raise ClusterError(reason)
        ensure_installed()
        self.down(quiet=True)
        w = self.work
        if w.exists():
            shutil.rmtree(w)
        for sub in ("state", "dev"):
            (w / sub).mkdir(parents=True)
        for name, _ in NODES:
            (w / f"spool-{name}").mkdir()
        for kind, count in layout.gpus:
            for i in range(count):
                os.mknod(w / "dev" / f"{kind}-{i}", 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
        self.conf.write_text(_config(w, free_port(SLURMCTLD_PORT), layout))
        (w / "gres.conf").write_text(_gres(w, layout))
        self._network()
        os.environ["SLURM_CONF"] = str(self.conf)
        self._start(["slurmctld", "-D", "-f", str(self.conf)], w / "slurmctld.out")
        for name, _ in NODES:
            inner = f"hostname {name} && exec slurmd -D -N {name} -f {self.conf}"
            self._start(["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "sh", "-c", inner],
                        w / f"slurmd-{name}.out")
        self._wait_idle(timeout)

    def _node_states(self) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
        """sinfo's answer and each node's state in it."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                             env={**os.environ, "SLURM_CONF": str(self.conf)})
        return out, dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)

    def running(self) -> bool:
        """Whether a cluster from this folder answers now: its slurmctld alive, both nodes up."""
        pid_file = self.work / "slurmctld.pid"
        if shutil.which("sinfo") is None:
            return False
        try:  # its slurmctld, not a process that took its pid after a reboot (nor a zombie: no command line)
            command = Path(f"/proc/{int(pid_file.read_text().strip())}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False
        if str(self.conf).encode() not in command:
            return False
        out, states = self._node_states()
        return out.returncode == 0 and len(states) >= len(NODES) and not any(
            s.startswith(("down", "drain", "fail")) for s in states.values())

    def _start(self, cmd: list[str], log: Path) -> None:
        fh = open(log, "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, "SLURM_CONF": str(self.conf)}))

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{CONTROLLER[1]}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i, (name, addr) in enumerate(NODES):
            host_if, node_if = f"cslv{i}", f"cslv{i}n"
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
            _run("ip", "link", "set", host_if, "master", BRIDGE)
            _run("ip", "link", "set", host_if, "up")
            _run("ip", "link", "set", node_if, "netns", name)
            _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", node_if)
            _run("ip", "-n", name, "link", "set", node_if, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
        hosts = Path("/etc/hosts").read_text()
        lines = [f"{a} {n} {HOSTS_MARK}" for n, a in NODES]
        Path("/etc/hosts").write_text(hosts.rstrip("\n") + "\n" + "\n".join(lines) + "\n")

    def _wait_idle(self, timeout_s: float) -> None:
        last = ""

        def idle() -> bool:
            nonlocal last
            for p in self.procs:
                if p.poll() is not None:
                    raise ClusterError(f"a Slurm daemon exited ({p.args}); see {self.work}/*.log\n{self.logs()}")
            out, states = self._node_states()
            last = out.stdout + out.stderr
            return len(states) >= len(NODES) and all(s.startswith("idle") for s in states.values())

        deadline = time.monotonic() + timeout_s
        while not idle():
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes did not become idle within {timeout_s:.0f} s: {last}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, lines: int = 30) -> str:
        out = []
        for log in sorted(self.work.glob("*.log")) + sorted(self.work.glob("*.out")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def job_report(self, job_id: int, records: list[dict[str, str]] | None = None) -> str:
        """Everything about one job, for an assertion message: its state, its whole log (every
        start of a requeued job), and each slurmctld/slurmd log line that names it."""
        out = [f"=== job {job_id}: " + "; ".join(
            f"{r.get('JobId')} {r.get('JobState')} exit {r.get('ExitCode')} restarts {r.get('Restarts')} "
            f"reason {r.get('Reason')}" for r in records or [])]
        for r in records or []:
            log = Path(r.get("StdOut", ""))
            if log.is_file():
                out.append(f"--- {log}\n{log.read_text(errors='replace')}")
        pattern = re.compile(rf"\b{job_id}\b")
        for daemon_log in sorted(self.work.glob("*.log")):
            hits = [line for line in daemon_log.read_text(errors="replace").splitlines() if pattern.search(line)]
            out.append(f"--- {daemon_log.name}: {len(hits)} line(s) naming job {job_id}\n" + "\n".join(hits[-200:]))
        return "\n".join(out)

    def down(self, quiet: bool = False) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()
        # daemons left by an earlier run (a crashed test session) go too
        _run("pkill", "-KILL", "-f", "--", str(self.conf), check=False)
        for i, (name, _) in enumerate(NODES):
            _run("ip", "link", "del", f"cslv{i}", check=False)
            _run("ip", "netns", "del", name, check=False)
        _run("ip", "link", "del", BRIDGE, check=False)
        self.conf.unlink(missing_ok=True)  # its presence says the cluster is up (make lab reads it)
        try:
            hosts = Path("/etc/hosts").read_text()
            if HOSTS_MARK in hosts:
                kept = [line for line in hosts.splitlines() if HOSTS_MARK not in line]
                Path("/etc/hosts").write_text("\n".join(kept) + "\n")
        except OSError:
            if not quiet:
                raise


_shared: SlurmTestCluster | None = None


def shared() -> SlurmTestCluster:
    """One cluster for the whole test session (the Slurm tests and notebook 04)."""
    global _shared
    if _shared is None:
        cluster = SlurmTestCluster()
        cluster.up()
        _shared = cluster
    return _shared


def stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.down()
        _shared = None


def _as_root(argv: list[str]) -> None:
    """Run this command again as root through sudo (asking for the password), or say what is needed."""
    sudo = shutil.which("sudo")
    if sudo is None:
        sys.exit(f"the practice cluster needs root: run make cluster as root, or where sudo is on the PATH (uid "
                 f"{os.geteuid()} here); without it, notebooks 04-06 print the sbatch lines instead of submitting")
    os.execv(sudo, [sudo, sys.executable, os.path.abspath(__file__), *argv])


def main(argv: list[str]) -> int:
    cluster = SlurmTestCluster()
    if argv[:1] not in (["up"], ["down"]):
        print(__doc__)
        return 2
    if sys.platform != "linux":
        sys.exit(f"the practice cluster needs Linux (network namespaces); on {sys.platform}, notebooks 04-06 print "
                 "the sbatch lines instead of submitting, and slurm/README.md says how to run them on a cluster")
    if os.geteuid() != 0:
        _as_root(argv)
    if argv[:1] == ["up"]:
        if cluster.running():
            print(f"the practice cluster is already up; export SLURM_CONF={cluster.conf}")
            return 0
        start = time.time()
        try:
            cluster.up()
        except ClusterError as exc:
            sys.exit(f"error: {exc}")
        for p in cluster.procs:  # keep running after we exit
            p.returncode = 0
        print(f"practice cluster up in {time.time() - start:.0f} s: partitions {', '.join(PARTITIONS)}, nodes "
              f"{', '.join(n for n, _ in NODES)}. In a terminal: export SLURM_CONF={cluster.conf}; then sinfo, squeue, "
              f"sbatch slurm/generic/one_node.sbatch. make lab passes it to the notebooks. make cluster-down ends it.")
        sys.stdout.flush()
        os._exit(0)
    cluster.down()
    print("practice cluster down: its daemons, namespaces, bridge and /etc/hosts lines are gone")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
