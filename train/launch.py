"""Start one ``falcon-train`` per process on this host, joined through ``jax.distributed``.

One process can already drive every GPU of a host; this launcher is for running the
multi-process (multi-host) path on one machine: each process gets ``JAX_COORDINATOR_ADDRESS``
(process 0 on localhost), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and its own devices, loads
only its slice of every batch (see :func:`falcon_jax.train.mesh.host_shard`) and process 0 writes the logs::

    python -m falcon_jax.train.launch --processes 2 --gpus-per-process 1 -- --preset lm-130m --set ...
    python -m falcon_jax.train.launch --processes 2 --cpu-devices 2 -- --preset addition-tiny   # CPU only

On several hosts use the cluster's own launcher (SLURM, Open MPI) or set the three variables
on each host yourself; ``falcon-train`` is the same command everywhere.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def simulated_cpu_env(env: dict, devices: int) -> dict:
    """``env`` with jax on the CPU showing ``devices`` simulated devices (any earlier count replaced)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return dict(env, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]))


def process_env(rank: int, n: int, port: int, gpus_per_process: int | None, cpu_devices: int | None) -> dict:
    env = dict(os.environ)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(rank))
    if gpus_per_process:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(rank * gpus_per_process + i) for i in range(gpus_per_process))
    return simulated_cpu_env(env, cpu_devices) if cpu_devices else env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m falcon_jax.train.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, required=True, help="number of processes to start (>= 1)")
    p.add_argument("--gpus-per-process", type=int, default=None,
                   help="GPUs each process drives (process i gets GPUs i*K .. i*K+K-1)")
    p.add_argument("--cpu-devices", type=int, default=None, help="CPU only: simulated devices per process")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the falcon-train arguments")
    a = p.parse_args(argv)
    if a.processes < 1:
        p.error(f"--processes={a.processes}: need at least 1.")
    if a.gpus_per_process is not None and a.gpus_per_process < 1:
        p.error(f"--gpus-per-process={a.gpus_per_process}: need at least 1 (or leave it out).")
    if a.gpus_per_process and a.cpu_devices:
        p.error("give --gpus-per-process or --cpu-devices, not both.")
    args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    if not args:
        p.error("no falcon-train arguments: add them after '--', e.g. -- --preset addition-tiny.")
    port = a.port or free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "falcon_jax.train", *args],
                              env=process_env(r, a.processes, port, a.gpus_per_process, a.cpu_devices))
             for r in range(a.processes)]
    # one failed process would leave the others waiting on collectives: stop them all
    rc = 0
    while procs:
        for pr in list(procs):
            code = pr.poll()
            if code is None:
                continue
            procs.remove(pr)
            if code != 0:
                rc = rc or code
                for other in procs:
                    other.terminate()
        time.sleep(0.2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
