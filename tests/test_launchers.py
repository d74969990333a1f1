"""External launchers: the worker entry under torchrun (two agents as two "nodes" on
localhost) and srun (Slurm's variables faked), a run prepared once for them, and Hydra
multiruns through hydra-submitit-launcher.

Every process starts in its own session and is stopped with its children on failure or
timeout (torchrun's and submitit's children included)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from src.errors import ConfigError
from src.plan_io import VERSION, read_settings
from src.runtime.driver import free_port, launch, stop
from src.prepare import layout
from tests.conftest import REPO_ROOT, cli_env
from tests.runtime.support import CLIP

TWO_NODES = ["backend=torch", "cluster=local", "cluster.nodes=2", "cluster.devices_per_node=1", "logger=none"]
RUN = [*CLIP, "strategy=ddp", "train.steps=2"]
TIMEOUT_S = 120


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for all; whatever is still running on a timeout or error is stopped."""
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        stop(procs)


def _prepare(*overrides: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "src.prepare", *overrides],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("launchers") / "prepared"
    code, out, err = _prepare(*TWO_NODES, *RUN, f"hydra.run.dir={run_dir}")
    assert code == 0, err
    assert out.splitlines()[-1] == str(run_dir)
    assert (run_dir / "launch.env").read_text().split() == ["NNODES=2", "NPROC_PER_NODE=1", "WORLD=2"]
    return run_dir


@pytest.fixture(scope="module")
def driver_losses(prepared) -> list[float]:
    """The same written plan, run through our own driver."""
    run_dir = _copy(prepared, "driver")
    backend = read_settings(run_dir).torch
    assert backend is not None
    launch([run_dir], 2, backend)
    return _summary(run_dir)["measured"]["loss"]


def _copy(prepared: Path, name: str) -> Path:
    return Path(shutil.copytree(prepared, prepared.parent / name))


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_the_driver(prepared, driver_losses):
    run_dir = _copy(prepared, "torchrun")
    endpoint = f"127.0.0.1:{free_port()}"
    results = _finish([_start(["bash", "launchers/torchrun.sh", str(run_dir), endpoint]) for _ in range(2)])
    for code, output in results:
        assert code == 0, output[-3000:]
    summary = _summary(run_dir)
    assert summary["devices"] == 2 and summary["backend"] == "torch"
    assert summary["measured"]["loss"] == pytest.approx(driver_losses, rel=1e-4)


@pytest.mark.slow
def test_srun_tasks_train_like_the_driver(prepared, driver_losses):
    run_dir = _copy(prepared, "srun")
    port = str(free_port())
    procs = [
        _start(
            ["bash", "launchers/srun.sh", str(run_dir)],
            {
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_ID": "7",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    for code, output in _finish(procs):
        assert code == 0, output[-3000:]
    assert _summary(run_dir)["measured"]["loss"] == pytest.approx(driver_losses, rel=1e-4)


@pytest.mark.slow
def test_srun_refuses_a_task_count_the_plan_does_not_use(prepared):
    env = {**cli_env(), "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0"}
    proc = subprocess.run(
        ["bash", "launchers/srun.sh", str(prepared)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: the plan needs 2 workers but srun started 3 tasks (use --nodes=2 --ntasks-per-node=1)")


def _worker(run_dir: Path, world: int) -> subprocess.CompletedProcess:
    env = {**cli_env(), "RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return subprocess.run(
        [sys.executable, "-m", "src.runtime.worker", str(run_dir)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow  # starts a worker process
def test_a_worker_refuses_a_plan_for_other_workers_or_a_truncated_one_before_joining(prepared):
    run_dir = _copy(prepared, "bad_plan")
    proc = _worker(run_dir, 3)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: rank 0: {run_dir}/plan.json plans 2 ranks, not the launcher's 3 (WORLD_SIZE)"
    plan = run_dir / "plan.json"
    plan.write_text(plan.read_text()[:1000])
    proc = _worker(run_dir, 2)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert re.fullmatch(rf"error: rank 0: {run_dir}/plan.json is not a whole plan file \(truncated .* of 1000\)", proc.stderr.strip())
    assert not (run_dir / "errors").exists() and not (run_dir / "summary.json").exists()


@pytest.mark.slow  # runs the launcher's check
def test_torchrun_refuses_a_plan_of_another_version_before_starting(prepared):
    run_dir = _copy(prepared, "newer_plan")
    plan = run_dir / "plan.json"
    plan.write_text(plan.read_text().replace(f'"version":{VERSION}', f'"version":{VERSION + 1}', 1))
    proc = subprocess.run(
        ["bash", "launchers/torchrun.sh", str(run_dir), f"127.0.0.1:{free_port()}"],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {plan} is plan format version {VERSION + 1}; this mmdist reads version {VERSION} only "
        "(plan the run again with this version)"
    )


@pytest.mark.slow
def test_prepare_refuses_a_simulator_run(tmp_path):
    code, _, err = _prepare("backend=sim", f"hydra.run.dir={tmp_path}")
    assert code == 2
    assert err.strip() == "error: only backend=torch runs are prepared for a launcher, got backend=sim"


def test_torchrun_starts_as_many_workers_on_every_node():
    assert layout(SimpleNamespace(devices=2, strategy="ddp"), 4) == (1, 2)
    assert layout(SimpleNamespace(devices=8, strategy="ddp"), 4) == (2, 4)
    with pytest.raises(ConfigError, match="6 devices, which do not fill whole nodes of 4"):
        layout(SimpleNamespace(devices=6, strategy="ddp"), 4)


@pytest.mark.slow
def test_a_multirun_through_the_submitit_local_launcher_writes_one_summary_per_job(tmp_path):
    # hydra.launcher.timeout_min: submitit stops a stuck job itself.
    [(code, output)] = _finish(
        [
            _start(
                [
                    sys.executable,
                    "-m",
                    "src.run",
                    "-m",
                    "hydra/launcher=submitit_local",
                    "hydra.launcher.timeout_min=2",
                    "model=clip,lit",
                    "model.scale=tiny",
                    "cluster=local",
                    "strategy=ddp",
                    "logger=none",
                    f"hydra.sweep.dir={tmp_path}",
                ]
            )
        ]
    )
    assert code == 0, output[-3000:]
    assert (tmp_path / ".submitit").is_dir()  # the jobs ran as submitit jobs, not in this process
    models = sorted(_summary(p.parent)["model"] for p in tmp_path.glob("*/summary.json"))
    assert models == ["clip", "lit"]


def test_the_slurm_launcher_preset_runs_one_front_door_per_job():
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "backend=torch"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.cpus_per_task) == (1, 1, cfg.backend.workers)
