"""DistMM on the real backend: towers on disjoint process groups train like one process.

With the same seed, initial weights and global batch, the first 5 losses of each plan
equal the single-process reference within 1e-4 relative: towers on 3+1 and 2+2 workers,
pipelined towers under DistMM-Pipe and GPipe with batch-sync, a TP tower, CoCa (the image
tokens cross between towers of different replicas) and LiT (frozen image tower). All
plans run back to back in ONE launch of four workers. The batch-sync's gradients are
checked against one contrastive loss over the whole batch (the oracle) on three tiny
processes.

AdamW runs with eps=1 and lr=1 here: its first updates are then proportional to the
gradients (with the usual eps=1e-8 they are nearly their signs, and a tower whose
gradients were off by its dp degree would still match the reference within 1e-4), so
equal losses mean equal gradients, scale included.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.errors import ConfigError
from src.models.registry import build_model
from src.run import plan_run, validate
from src.runtime.backend import check_runnable
from src.runtime.driver import free_port, launch
from src.runtime.exchange import Layout, Rows, sync_gradients
from src.runtime.modules.contrastive import ContrastiveLoss
from src.runtime.reference import reference_losses
from src.timeline import BREAKDOWN_CATEGORIES
from tests.test_runtime_support import build_deepspeed_ops, composed, prepare_run_dir

STEPS, BATCH, CONTRASTIVE = 5, 12, 6  # two batch-sync groups per step
LR, EPS = 1.0, 1.0
FOUR_WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=4", "logger=none", "strategy=distmm",
                "model.scale=tiny", f"train.global_batch={BATCH}", f"train.contrastive_batch={CONTRASTIVE}",
                f"backend.lr={LR}", f"backend.adam_eps={EPS}"]
PIPELINED = ["strategy.vision.pp=2", "strategy.text.pp=2", "strategy.microbatches=2"]
CASES = {
    "clip_3+1": ["model=clip", "strategy.vision.dp=3", "strategy.text.dp=1"],
    "clip_2+2": ["model=clip", "strategy.vision.dp=2", "strategy.text.dp=2"],
    "clip_2+2_distmm_pipe": ["model=clip", *PIPELINED, "strategy.pipeline=distmm_pipe"],
    "clip_2+2_gpipe_sync": ["model=clip", *PIPELINED, "strategy.pipeline=gpipe_sync"],
    "clip_vision_tp2": ["model=clip", "strategy.vision.tp=2", "strategy.text.dp=2"],
    "coca_3+1": ["model=coca", "strategy.vision.dp=3", "strategy.text.dp=1"],            # fan-in of image tokens
    "coca_vision_pp2": ["model=coca", "strategy.vision.pp=2", "strategy.text.dp=2",      # fan-out, pipelined producer
                        "strategy.microbatches=2"],
    "lit_2+2": ["model=lit", "strategy.vision.dp=2", "strategy.text.dp=2"],               # frozen image tower
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    build_deepspeed_ops()
    root = tmp_path_factory.mktemp("distmm")
    dirs = {}
    for name, overrides in CASES.items():
        dirs[name] = root / name
        config = prepare_run_dir(dirs[name], FOUR_WORKERS + overrides + [f"train.steps={STEPS}"])
    start = time.monotonic()
    launch(list(dirs.values()), 4, config["backend"], [{"run_name": n} for n in dirs])
    print(f"{len(dirs)} real distmm runs in {time.monotonic() - start:.1f} s")
    return dirs


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return {name: reference_losses(build_model({"name": name, "scale": "tiny"}), 0, BATCH, STEPS, LR,
                                   contrastive_batch=CONTRASTIVE, eps=EPS)
            for name in ("clip", "coca", "lit")}


def _model(case: str) -> str:
    return next(o.split("=")[1] for o in CASES[case] if o.startswith("model="))


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["type"] == "step"]


@pytest.mark.parametrize("case", list(CASES))
def test_first_losses_equal_the_single_process_reference(runs, references, case):
    assert _losses(runs[case]) == pytest.approx(references[_model(case)], rel=1e-4)


def test_the_reference_moves_with_the_gradients(references):
    # Otherwise equal losses would not say the gradients are equal.
    for losses in references.values():
        assert max(abs(b - a) for a, b in zip(losses, losses[1:])) > 0.05


def test_each_plan_runs_the_towers_it_was_asked_for_and_reports_like_the_simulator(runs):
    plan = json.loads((runs["clip_3+1"] / "summary.json").read_text())["plan"]["units"]
    assert (plan["vision"]["dp"], plan["text"]["dp"]) == (3, 1)
    assert (plan["vision"]["batch_per_replica"], plan["text"]["batch_per_replica"]) == (4, 12)
    for case, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["strategy"] == "distmm" and summary["backend"] == "torch" and 0 < summary["mfu"] < 1
        breakdown = summary["breakdown_s"]
        assert set(breakdown) == set(BREAKDOWN_CATEGORIES)
        assert sum(breakdown.values()) == pytest.approx(summary["iteration_time_s"], rel=1e-6)
        assert breakdown["comm_interaction"] > 0, case
    coca = json.loads((runs["coca_3+1"] / "summary.json").read_text())["breakdown_s"]
    assert coca["comm_broker"] > 0
    pipe = json.loads((runs["clip_2+2_distmm_pipe"] / "summary.json").read_text())["breakdown_s"]
    assert pipe["bubble_warmup"] + pipe["bubble_cooldown"] + pipe["bubble_imbalance"] > 0


# ---- the oracle: one batch-sync's gradients against one loss over the whole batch ----------
# Two image ranks of 4 and 2 rows, one text rank of all 6: uneven on purpose.
ORACLE = (Rows(0, "vision", 0, 4, 0), Rows(1, "vision", 0, 2, 4), Rows(2, "text", 0, 6, 0))


def _oracle_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)


def _oracle_worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(ORACLE))
    try:
        images, texts = _oracle_batch()
        me = ORACLE[rank]
        features = (images[me.offset:me.offset + me.count] if me.tower == "vision" else texts)
        loss, params, grad = sync_gradients(ContrastiveLoss(), features, me.tower == "vision", Layout(ORACLE, me),
                                            dist.group.WORLD, CONTRASTIVE)
        torch.save({"loss": loss, "params": params, "grad": grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_batch_sync_gradients_equal_one_contrastive_loss_over_the_whole_batch(tmp_path):
    # spawn, not fork: a fork of a process whose OpenMP threads have run hangs in torch ops.
    mp.spawn(_oracle_worker, args=(free_port(), str(tmp_path)), nprocs=len(ORACLE))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(ORACLE))]

    images, texts = (t.requires_grad_() for t in _oracle_batch())
    oracle = ContrastiveLoss()
    loss = oracle(images, texts, images, texts, 0) / CONTRASTIVE  # CLIP's symmetric loss, one process
    loss.backward()

    assert sum(g["loss"] for g in got) == pytest.approx(float(loss.detach()), rel=1e-6)
    for g in got:  # every rank ends with the whole batch's gradient of the temperature
        torch.testing.assert_close(g["params"][0], oracle.logit_scale.grad)
    torch.testing.assert_close(torch.cat([got[0]["grad"], got[1]["grad"]]), images.grad)
    torch.testing.assert_close(got[2]["grad"], texts.grad)


def test_a_program_the_executor_cannot_run_is_refused_before_any_worker_starts():
    # CoCa's text tower pipelined: its contrastive feature leaves stage 0, its batch-sync runs on stage 1.
    config = composed(FOUR_WORKERS + ["model=coca", "strategy.vision.dp=2", "strategy.text.pp=2"])
    with pytest.raises(ConfigError, match=r"rank 3 runs a batch-sync of text whose feature \(layer 2\) is computed "
                                          r"on another pipeline stage"):
        setup = validate(config)
        check_runnable(setup, plan_run(setup))
