"""A one-node Slurm cluster for the engine tests: munged, slurmctld and slurmd started in a private state
directory (own munge key and socket, own ports), as root without cgroups, stopped by PID.

    with SlurmCluster(tmp) as slurm:
        subprocess.run(["sbatch", "--wait", "--wrap", "true"], env=slurm.env(), check=True)

Needs ``slurm-wlm`` and ``munge`` (Debian/Ubuntu: ``apt-get install -y slurm-wlm munge``) and root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MISSING = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "scontrol", "sinfo") if shutil.which(b) is None]


def available() -> str | None:
    """None when a cluster can start here, else why not."""
    if MISSING:
        return f"Slurm is not installed ({', '.join(MISSING)} missing): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs its daemons as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, root: Path, *, kill_wait: int = 2, max_array_size: int = 1001):
        self.root = Path(root)
        self.kill_wait = kill_wait
        self.max_array_size = max_array_size  # Slurm's default: array indices 0-1000
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.munge_pid: int | None = None

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
            env.pop(k)  # a test run inside a Slurm job must not leak that job's variables
        return env

    def start(self) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        # munged runs as munge: its folder sits outside the (root-only) test directory, the socket's folder
        # searchable by all (munged insists), the key's, pid's and log's munge's alone
        munge = self.munge_dir = Path(tempfile.mkdtemp(prefix="sinkwatch-munge-"))
        (munge / "key").mkdir(exist_ok=True)
        key = munge / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for path in (munge, munge / "key", key):
            shutil.chown(path, "munge", "munge")
        os.chmod(munge, 0o755)
        os.chmod(munge / "key", 0o700)
        sock = munge / "munge.socket"
        subprocess.run(
            ["runuser", "-u", "munge", "--", "munged", "--key-file", str(key), "--socket", str(sock),
             "--pid-file", str(munge / "key" / "munged.pid"), "--log-file", str(munge / "key" / "munged.log"),
             "--seed-file", str(munge / "key" / "seed")],
            check=True, timeout=30,
        )  # fmt: skip
        self.munge_pid = int((munge / "key" / "munged.pid").read_text())
        ctld, slurmd = _free_ports(2)
        cpus = os.cpu_count() or 1
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=sinkwatch-test",
                    f"SlurmctldHost={self.host}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={ctld}",
                    f"SlurmdPort={slurmd}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={sock}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    f"KillWait={self.kill_wait}",
                    f"MaxArraySize={self.max_array_size}",
                    "OverTimeLimit=0",
                    "InactiveLimit=0",
                    "MinJobAge=300",
                    "SchedulerParameters=defer_batch=0",
                    "SchedulerType=sched/backfill",
                    "MessageTimeout=20",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        env = self.env()
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)], env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))  # fmt: skip
        self.procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(self.conf)], env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))  # fmt: skip
        deadline = time.time() + 60
        while time.time() < deadline:
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if res.returncode == 0 and res.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.3)
        logs = "".join((r / "log" / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log") if (r / "log" / f).exists())
        self.stop()
        raise RuntimeError(f"the one-node Slurm cluster did not come up: {logs}")

    def stop(self) -> None:
        if self.procs and all(p.poll() is None for p in self.procs):  # jobs still running end with the cluster, not after it
            env = self.env()
            subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True, timeout=30)
            deadline = time.time() + 20
            while time.time() < deadline:
                res = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        if self.munge_pid is not None:
            try:
                os.kill(self.munge_pid, 15)
            except ProcessLookupError:
                pass
            self.munge_pid = None
        if getattr(self, "munge_dir", None) is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers the tests use ----
    def sbatch(self, args: list[str], *, cwd, env: dict | None = None) -> str:
        res = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def states(self, job: str) -> dict[str, str]:
        """array index (or job id) -> state, from scontrol (there is no accounting: sacct does not work here)."""
        res = subprocess.run(["scontrol", "-o", "show", "job", job], env=self.env(), capture_output=True, text=True, timeout=30)
        out = {}
        for line in res.stdout.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            out[fields.get("ArrayTaskId", fields.get("JobId"))] = fields.get("JobState")
        return out

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        """Wait until every task of ``job`` is in a final state; returns them."""
        final = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.states(job)
            if st and all(s in final for s in st.values()):
                return st
            time.sleep(0.5)
        raise TimeoutError(f"Slurm job {job} not done after {timeout} s: {self.states(job)}")
