"""The `dcr` checkpoint engine driven by verl 0.9.1 itself (tests/helpers/verl.py: verl's config,
plugin import, registry, worker methods and the manager's sequence of calls, without Ray):
every version lands on the rollout side bit for bit, only the tensors it changed are handed to
the inference engine, and a sync that cannot deliver its version fails with the reason and
changes nothing there."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs verl (make test-verl builds .venv-verl)")

import torch  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402

from nemo_dcr_callback.protocol import commit, keys  # noqa: E402
from nemo_dcr_callback.transport.store import FileStore  # noqa: E402
from tests.helpers.verl import VerlJob, engine_config, tiny_qwen2  # noqa: E402

FAST = {"ack_timeout": 5, "timeout": 20}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def assert_landed(job: VerlJob, before: dict[str, torch.Tensor] | None) -> None:
    """Every rollout worker holds the trainer's bits now, and was handed exactly the tensors
    that changed since `before` (all of them the first time)."""
    now = job.engine.bits()
    changed = sorted(now) if before is None else sorted(n for n in now if not torch.equal(now[n], before[n]))
    for a in job.adapters():
        assert bits_equal(a.bits(), now)
        assert sorted(a.names) == changed


def replicas_hold(job: VerlJob, expect: dict[str, torch.Tensor]) -> None:
    for w in job.rollouts:
        rep = w.checkpoint_engine.replica
        assert bits_equal({n: t.view(torch.int16) for n, t in rep.items()}, expect)


def test_the_config_lines_select_the_engine(tmp_path):
    cfg = engine_config(f"file://{tmp_path}/store", commit_policy="wait")
    assert (cfg.backend, cfg.custom_backend_module) == ("dcr", "nemo_dcr_callback.integrations.verl")
    assert cfg.engine_kwargs == {"dcr": {"store": f"file://{tmp_path}/store", "commit_policy": "wait"}}
    job = VerlJob(cfg, tiny_qwen2(), actors=1, rollouts=1)  # imports the module as verl's workers do
    engine = job.actors[0].checkpoint_engine
    assert type(engine) is CheckpointEngineRegistry.get("dcr") and engine.is_master
    assert engine.policy.mode == "wait" and not job.rollouts[0].checkpoint_engine.is_master
    with pytest.raises(ValueError, match="engine_kwargs.dcr.store"):
        CheckpointEngineRegistry.new("dcr", bucket_size=1 << 20)


def test_context_options_reach_the_publisher_and_bad_ones_are_refused(tmp_path):
    store_url = f"file://{tmp_path}/store"
    job = VerlJob(engine_config(store_url, context="on", link_mbit=100.0, **FAST), tiny_qwen2(), actors=1,
                  rollouts=1)
    job.sync(0)
    sender = job.actors[0].checkpoint_engine.publisher.sender
    assert (sender.context, sender.link_mbit) == ("on", 100.0)
    for bad, match in (({"context": "sometimes"}, "context must be"), ({"link_mbit": 0}, "link_mbit must be")):
        with pytest.raises(ValueError, match=match):
            CheckpointEngineRegistry.new("dcr", bucket_size=1 << 20, store=store_url, **bad)


def test_five_versions_reach_every_rollout_worker_bit_exact(tmp_path):
    store_url = f"file://{tmp_path}/store"
    job = VerlJob(engine_config(store_url, **FAST), tiny_qwen2(), actors=2, rollouts=2)
    job.sync(0)  # verl's first sync, before training: keyframe 0 and version 1 (no change)
    assert_landed(job, None)
    for step in range(1, 6):
        before = job.engine.bits()
        # steps 2 and 4 leave the second layer and the norms alone: those tensors are not sent
        job.engine.step(rate=0.03, skip=("layers.1.", "norm") if step % 2 == 0 else ())
        job.sync(step)
        assert_landed(job, before)
        if step % 2 == 0:
            assert not any("layers.1." in n or "norm" in n for n in job.adapters()[0].names)
        m = job.metrics[-1]
        assert m["dcr/committed"] == 1.0 and 0 < m["dcr/changed"] < 0.1 * m["dcr/params"]
    store = FileStore(tmp_path / "store")
    assert commit.list_versions(store) == [1, 2, 3, 4, 5, 6]  # one version per sync, numbered after the steps
    for v in range(1, 7):
        d = commit.read_decision(store, v)
        assert d["decision"] == "commit" and d["acked"] == ["verl-rollout-0", "verl-rollout-1"]
    replicas_hold(job, job.engine.bits())


def test_a_restarted_job_resumes_from_the_store(tmp_path):
    """The trainer and the rollout restart, the trainer from an older checkpoint than the
    store's newest version (global_steps 1 while the store holds 3): the store's history is the
    baseline, the sync's version is the next number, and the rollout lands on the checkpoint."""
    store_url = f"file://{tmp_path}/store"
    model = tiny_qwen2()
    job = VerlJob(engine_config(store_url, **FAST), model, rollouts=1)
    checkpoint = {n: t.clone() for n, t in model.state_dict().items()}
    for step in range(2):
        job.sync(step)
        job.engine.step()
    job.sync(2)
    restarted = VerlJob(engine_config(store_url, **FAST), tiny_qwen2(seed=5), rollouts=2)
    restarted.engine.model.load_state_dict(checkpoint)
    restarted.sync(1)
    assert_landed(restarted, None)
    assert commit.read_decision(FileStore(tmp_path / "store"), 4)["decision"] == "commit"
    before = restarted.engine.bits()
    restarted.engine.step()
    restarted.sync(2)
    assert_landed(restarted, before)


def test_an_unreachable_store_fails_with_its_reason(tmp_path):
    job = VerlJob(engine_config("relay://127.0.0.1:1", timeout=0.5), tiny_qwen2(), rollouts=1)
    # verl's build_process_group fails: the rollout worker cannot register in the joint commit
    with pytest.raises(Exception, match=r"dcr: store relay://127.0.0.1:1 unreachable for 0.5 s \(.*refused.*\): "
                                        r"receiver verl-rollout-0 could not register"):
        job.sync(0)
    assert job.adapters()[0].weights == {} and job.rollouts[0].checkpoint_engine.replica is None


def test_an_empty_store_fails_with_its_reason(tmp_path):
    """The trainer's file:// path is another folder on the rollout's machines (not shared)."""
    empty = engine_config(f"file://{tmp_path}/elsewhere", timeout=0.5)
    job = VerlJob(engine_config(f"file://{tmp_path}/store", ack_timeout=0.5), tiny_qwen2(), rollouts=1,
                  rollout_config=empty)
    with pytest.raises(Exception, match="no committed keyframe: an empty or wrong store"):
        job.sync(0)
    assert job.adapters()[0].weights == {} and job.rollouts[0].checkpoint_engine.replica is None
    assert job.metrics[-1]["dcr/committed"] == 1.0  # nobody registered in the trainer's store


def test_a_version_not_committed_is_not_applied(tmp_path):
    store_url = f"file://{tmp_path}/store"
    job = VerlJob(engine_config(store_url, commit_policy="abort", ack_timeout=0.5, timeout=20), tiny_qwen2())
    job.sync(0)
    held = job.engine.bits()
    store = FileStore(tmp_path / "store")
    commit.register(store, "ghost", 1)  # a receiver that never answers: the policy aborts past 0.5 s
    job.engine.step()
    with pytest.raises(Exception, match=r"version 2 was aborted by the joint commit \(no ack from \['ghost'\]"):
        job.sync(1)
    assert job.metrics[-1]["dcr/committed"] == 0.0
    for a in job.adapters():
        assert bits_equal(a.bits(), held)
    replicas_hold(job, held)
    store.delete([keys.receiver_key("ghost")])
    job.sync(2)  # the next version carries the aborted one's changes
    assert_landed(job, held)


async def _damage_when_sealed(root: Path, v: int, what: str) -> None:
    """Wait for version v's record, then flip a byte of its first part, or one digest of its record."""
    vdir = root / "versions" / f"{v:010d}"
    for _ in range(2000):
        if (vdir / "VERSION.json").exists():
            break
        await asyncio.sleep(0.005)
    if what == "part":
        part = sorted(vdir.glob("rank-*/part-*.dcr"))[0]
        data = bytearray(part.read_bytes())
        data[-3] ^= 0x40
        part.write_bytes(bytes(data))
    else:
        rec = json.loads((vdir / "VERSION.json").read_text())
        name = "model.layers.0.mlp.down_proj.weight"
        rec["digests"][name] = f"{(int(rec['digests'][name], 16) + 1) % (1 << 64):016x}"
        (vdir / "VERSION.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("what,why", [("part", r"refused version 2: chunk checksum mismatch \(corrupt or truncated\)"),
                                      ("digest", r"refused version 2: .*does not match the version's digest")])
def test_a_damaged_version_is_refused_and_changes_nothing(tmp_path, what, why):
    store_url = f"file://{tmp_path}/store"
    job = VerlJob(engine_config(store_url, **FAST), tiny_qwen2())
    job.sync(0)
    held = job.engine.bits()
    job.engine.step()
    with pytest.raises(Exception, match=why):
        job.sync(1, during=_damage_when_sealed(tmp_path / "store", 2, what))
    d = commit.read_decision(FileStore(tmp_path / "store"), 2)
    assert d["decision"] == "abort" and d["reason"].startswith("no quorum: 0/2")  # both refused
    for a in job.adapters():
        assert bits_equal(a.bits(), held)
    replicas_hold(job, held)  # (a bad digest is found after an apply: undone exactly)
    job.sync(2)
    assert_landed(job, held)
