"""A real one-node SLURM cluster on 127.0.0.1 for tests: slurmctld + slurmd in a temporary dir.

    with slurm_cluster(tmp_path) as cluster:
        job_id = cluster.sbatch("slurm/train.sbatch", "--nodes=1", env={"JOB": ...})
        state = cluster.wait(job_id, timeout=60)

Needs Debian's `slurm-wlm` (slurmctld, slurmd, sbatch, ...) and root, because the daemons run as
root. Authentication is `auth/none` (no munge daemon), `SlurmdParameters=config_overrides` lets a
2-core machine offer 16 CPUs, and `MpiDefault=pmi2` is what the PyPI MPICH wheel speaks. The
daemons detach and write pid files; `stop()` cancels every job and ends them by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
NODE = "node0"
PARTITION = "debug"
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class SlurmError(RuntimeError):
    """The cluster did not start, or a client command failed; carries the daemons' log tails."""


def missing_programs() -> list[str]:
    """SLURM programs not found on PATH (and /usr/sbin, where Debian puts the daemons)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p, path=path) is None]


def unavailable_reason() -> str | None:
    """Why a local cluster cannot run here, or None when it can."""
    missing = missing_programs()
    if missing:
        return f"SLURM not installed ({', '.join(missing)} missing): apt-get install slurm-wlm"
    if os.geteuid() != 0:
        return "the local SLURM daemons run as root; these tests need root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _slurm_conf(root: Path, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=mpihybrid-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job becomes eligible cred_expire + 1 s later (default 120 s).
AuthInfo=cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Pending jobs (a requeued one, once eligible) are looked at every second, not every minute.
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Like a GPU site, though this node has none: jobs here ask for --gpus-per-node=0.
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={cpus} Sockets=1 \
CoresPerSocket={cpus} ThreadsPerCore=1 State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A started cluster: its directory, slurm.conf and the environment clients need."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def command(
        self, *argv: str, env: dict | None = None, cwd: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client against this cluster."""
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=60,
            env={**self.env, **(env or {})},
            cwd=cwd,
        )
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(
        self,
        script: str | Path,
        *options: str,
        args: tuple[str, ...] | list[str] = (),
        env: dict | None = None,
        cwd: Path | None = None,
    ) -> str:
        """`sbatch OPTIONS SCRIPT ARGS`; returns the job id."""
        proc = self.command("sbatch", "--parsable", *options, str(script), *args, env=env, cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, Restarts, ExitCode, ...)."""
        out = self.command("scontrol", "show", "job", "--oneliner", job_id).stdout
        fields = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait(self, job_id: str, timeout: float, until=None) -> dict[str, str]:
        """Poll the job until it has finished (or `until(job)` holds); returns its fields."""
        until = until or (lambda job: job.get("JobState") in FINISHED)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {job.get('JobState')} after {timeout} s")
            time.sleep(0.2)

    def node_state(self) -> str:
        proc = self.command("sinfo", "--noheader", "--nodes", NODE, "-o", "%T", check=False)
        return proc.stdout.strip()

    def logs(self) -> str:
        """The last lines of both daemons' logs (for error messages)."""
        parts = []
        for name in DAEMONS:
            path = self.root / "log" / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            parts.append(f"--- {name}.log ---\n" + "\n".join(text.splitlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, wait for them to go, then end both daemons by their pid files."""
        with contextlib.suppress(Exception):
            self.command("scancel", "--full", "--partition", PARTITION, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                out = self.command("squeue", "--noheader", "-o", "%i", check=False).stdout
                if not out.strip():
                    break
                time.sleep(0.2)
        for name in reversed(DAEMONS):
            _terminate(self.root / f"{name}.pid")


def _terminate(pid_file: Path, timeout: float = 15) -> None:
    if not pid_file.exists():
        return
    try:
        pid = int(pid_file.read_text().split()[0])
    except (ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


def start(root: Path, cpus: int = 16, timeout: float = 60) -> SlurmCluster:
    """Write slurm.conf under `root`, start slurmctld and slurmd, wait until the node is idle."""
    root = Path(root)
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, slurmd_port = _free_ports(2)
    (root / "slurm.conf").write_text(_slurm_conf(root, cpus, ctld_port, slurmd_port))
    sbin = os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")])
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"), PATH=sbin)
    for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if name != "SLURM_CONF":
            del env[name]
    cluster = SlurmCluster(root, env)
    try:
        # -c: a cold start that ignores any saved state; both detach once they are up.
        for argv in (["slurmctld", "-c"], ["slurmd", "-N", NODE]):
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise SlurmError(f"{argv[0]} exited {proc.returncode}: {proc.stderr.strip()}")
        deadline = time.monotonic() + timeout
        while (state := cluster.node_state()) != "idle":
            if time.monotonic() > deadline:
                raise SlurmError(f"node {NODE} is {state!r}, not idle, after {timeout} s")
            time.sleep(0.2)
    except BaseException as exc:
        logs = cluster.logs()
        cluster.stop()
        if isinstance(exc, SlurmError):
            raise SlurmError(f"{exc}\n{logs}") from None
        raise
    return cluster


@contextlib.contextmanager
def slurm_cluster(root: Path, cpus: int = 16) -> Iterator[SlurmCluster]:
    """A running cluster for the `with` block; the daemons are stopped however it ends."""
    cluster = start(root, cpus)
    try:
        yield cluster
    finally:
        cluster.stop()
