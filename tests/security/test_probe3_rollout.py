"""Issue 66, finding 9: the RL rollout folder, which the trainer and the rollout worker share
(and whoever else may write there).

- A link planted at `.cursor.tmp` (or at a batch's temporary name) made the trainer's cursor
  write (the worker's batch write) clobber the file it pointed at: writes now go through
  safe_io (an unpredictable name, O_EXCL|O_NOFOLLOW, renamed into place).
- The cursor and the batches were read through links and without bound: refused now.
- A batch claiming `version: 1e18` was trained on (staleness -1e18), and a 50-token episode
  raised RuntimeError and stopped training: each batch is checked against the trainer's
  published versions, each episode against the sequence length and the vocabulary; a bad one
  is skipped with one warning naming the file and why.
- The same writes into other folders users share: the receiver's journal, a checkpoint
  directory patched in place, the training recipe's step checkpoints.

Each test drives the public functions the old code had too (RolloutQueue.take,
rl_task.write_whole, rl_rollout.taken, Journal.done, ...), so it fails there by behaviour."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nemo_dcr_callback.recipes import rl_rollout, rl_task
from nemo_dcr_callback.recipes.rl_train import RolloutQueue

D = rl_task.DIGIT0


def _ep(version: int, group: int = 0, g1: int = D + 3) -> dict:
    return rl_task.first_turn(3, 7, g1, version, group).to_json()


def _put(folder: Path, i: int, version, episodes: list | None = None, **extra) -> Path:
    p = rl_task.batch_path(folder, i)
    eps = [_ep(version, 0), _ep(version, 0, D + 1)] if episodes is None else episodes
    p.write_text(json.dumps({"batch": i, "version": version, "episodes": eps, **extra}))
    return p


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text("precious")
    return v


# ------------------------------------------------------------------ writes through planted links
def test_a_link_at_the_cursor_temporary_name_is_never_written_through(tmp_path):
    roll = tmp_path / "rollouts"
    roll.mkdir()
    victim = _victim(tmp_path)
    os.symlink(victim, roll / ".cursor.tmp")  # the old code's temporary name
    _put(roll, 0, 0)
    assert RolloutQueue(str(roll), 1, 1.0).take(0)["version"] == 0
    assert victim.read_text() == "precious"
    assert not (roll / rl_task.CURSOR).is_symlink() and (roll / rl_task.CURSOR).read_text() == "1"


def test_a_link_at_a_batch_temporary_name_is_never_written_through(tmp_path):
    victim = _victim(tmp_path)
    p = rl_task.batch_path(tmp_path, 0)
    os.symlink(victim, tmp_path / f".{p.name}.tmp")
    rl_task.write_whole(p, '{"batch": 0}')  # the worker's write
    assert victim.read_text() == "precious" and p.read_text() == '{"batch": 0}' and not p.is_symlink()


def test_a_link_at_the_cursor_itself_is_replaced_not_followed(tmp_path):
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / rl_task.CURSOR)
    _put(tmp_path, 0, 0)
    RolloutQueue(str(tmp_path), 1, 1.0).take(0)
    assert victim.read_text() == "precious" and (tmp_path / rl_task.CURSOR).read_text() == "1"


def test_the_logs_in_the_rollout_folder_are_not_opened_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / "trainer.jsonl")
    with pytest.raises(OSError):
        rl_task.open_log(tmp_path / "trainer.jsonl")
    with rl_task.open_log(tmp_path / "rollout.jsonl") as f:
        f.write("x\n")
    with rl_task.open_log(tmp_path / "rollout.jsonl") as f:
        f.write("y\n")
    assert victim.read_text() == "precious" and (tmp_path / "rollout.jsonl").read_text() == "x\ny\n"


def test_the_engine_folder_is_not_written_through_a_link(tmp_path):
    from nemo_dcr_callback.protocol import keys
    from nemo_dcr_callback.safe_io import LinkRefused
    from nemo_dcr_callback.transport.store import open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    store.put(keys.keyframe_config(0), b"{}")
    store.put(keys.keyframe_model(0), b"weights")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    roll = tmp_path / "rollouts"
    roll.mkdir()
    os.symlink(elsewhere, roll / "engine-v0")
    with pytest.raises(LinkRefused):
        rl_rollout.export_keyframe(store, roll / "engine-v0", timeout=1)
    assert list(elsewhere.iterdir()) == []
    out = rl_rollout.export_keyframe(store, roll / "engine-v1", timeout=1)
    assert (out / keys.MODEL_FILE).read_bytes() == b"weights"


# ------------------------------------------------------------------ reads
def test_the_worker_reads_no_linked_cursor(tmp_path, capsys):
    (tmp_path / "elsewhere").write_text("5")
    os.symlink(tmp_path / "elsewhere", tmp_path / rl_task.CURSOR)
    assert rl_rollout.taken(tmp_path) == 0
    assert "cursor is unreadable" in capsys.readouterr().err
    os.unlink(tmp_path / rl_task.CURSOR)
    rl_task.write_whole(tmp_path / rl_task.CURSOR, "5")
    assert rl_rollout.taken(tmp_path) == 5


def test_the_worker_refuses_an_oversized_cursor_unread(tmp_path, capsys):
    with open(tmp_path / rl_task.CURSOR, "wb") as f:
        f.truncate(32 << 20)  # sparse: refused by its size, never read
    assert rl_rollout.taken(tmp_path) == 0
    assert "bytes, more than the 64" in capsys.readouterr().err


def test_the_worker_ignores_files_that_are_no_batch_of_its_own(tmp_path):
    _put(tmp_path, 4, 0)
    (tmp_path / "r-abc.json").write_text("{}")
    (tmp_path / "r-\u0661\u0662\u0663\u0664\u0665\u0666.json").write_text("{}")  # digits, not ASCII ones
    assert rl_rollout._next_batch(tmp_path) == 5


def test_a_linked_or_oversized_batch_is_skipped_unread(tmp_path, capsys):
    (tmp_path / "real.json").write_text(json.dumps({"version": 0, "episodes": [_ep(0)]}))  # a valid batch ...
    os.symlink(tmp_path / "real.json", rl_task.batch_path(tmp_path, 0))  # ... linked in as batch 0
    p = _put(tmp_path, 1, 0)
    with open(p, "a") as f:
        f.write(" " * (5 << 20))  # valid JSON, larger than a batch may be
    _put(tmp_path, 2, 1)
    q = RolloutQueue(str(tmp_path), 1, 1.0)
    got = q.take(1)
    assert got["batch"] == 2 and got["version"] == 1
    err = capsys.readouterr().err
    assert f"skipped rollout batch 0: {rl_task.batch_path(tmp_path, 0)}" in err and "is a link" in err
    assert f"skipped rollout batch 1: {p}" in err and "bytes, more than" in err
    assert [s["batch"] for s in q.skipped] == [0, 1]


# ------------------------------------------------------------------ claims
@pytest.mark.parametrize("version", [1e18, 10**18, 3, -1, "1", True, None, [1], 1.0])
def test_a_batch_of_a_version_the_trainer_has_not_published_is_skipped(tmp_path, capsys, version):
    _put(tmp_path, 0, version)
    _put(tmp_path, 1, 2)
    got = RolloutQueue(str(tmp_path), 1, 1.0).take(2)  # the trainer has published 0..2
    assert got["batch"] == 1 and got["version"] == 2 and got["staleness"] == 0
    err = capsys.readouterr().err
    assert str(rl_task.batch_path(tmp_path, 0)) in err and "not one the trainer has published" in err


def test_a_50_token_episode_is_skipped_and_training_goes_on(tmp_path, capsys):
    long = _ep(0) | {"tokens": [D] * 50, "mine": [4]}
    _put(tmp_path, 0, 0, [long])
    _put(tmp_path, 1, 0)
    got = RolloutQueue(str(tmp_path), 1, 1.0).take(0)
    tokens, weights = rl_task.batch([rl_task.Episode.from_json(e) for e in got["episodes"]], 1)  # no RuntimeError
    assert got["batch"] == 1 and tokens.shape == (1, 2, rl_task.SEQ + 1)
    err = capsys.readouterr().err
    assert "episode 0: tokens: 50, where a sequence holds 1 to 9" in err


def test_the_sequence_limit_is_the_models(tmp_path, capsys):
    _put(tmp_path, 0, 0)  # episodes of 6 tokens
    _put(tmp_path, 1, 0, [_ep(0) | {"tokens": [1, 2, 3], "mine": [2]}] * 2)
    got = RolloutQueue(str(tmp_path), 1, 1.0, max_tokens=4).take(0)  # a model of 3 positions
    assert got["batch"] == 1
    assert "where a sequence holds 1 to 4" in capsys.readouterr().err


BAD_EPISODES = {
    "tokens beyond the vocabulary": {"tokens": [1, 13, 17, 2, 10**6, 5]},
    "a negative token": {"tokens": [1, 13, 17, 2, -1, 5]},
    "a float token": {"tokens": [1, 13, 17, 2, 13.0, 5]},
    "mine beyond the tokens": {"mine": [40]},
    "mine at 0": {"mine": [0]},
    "mine negative": {"mine": [-2]},
    "a NaN reward": {"reward": float("nan")},
    "an infinite reward": {"reward": float("inf")},
    "a huge reward": {"reward": 1e300},
    "a huge integer reward": {"reward": 10**400},
    "a string reward": {"reward": "1"},
    "another version": {"version": 1},
    "a digit out of range": {"a": 12},
    "a list group": {"group": [0]},
    "no tokens": {"tokens": []},
}


def test_bad_episodes_are_skipped_with_one_warning_naming_the_file(tmp_path, capsys):
    good = [_ep(0, 0), _ep(0, 0, D + 1), _ep(0, 1), _ep(0, 1, D + 9)]
    bad = [_ep(0) | change for change in BAD_EPISODES.values()]
    missing = _ep(0)
    del missing["reward"]
    eps = good[:2] + bad + [missing, "episode", None] + good[2:]
    p = _put(tmp_path, 0, 0, eps)
    got = RolloutQueue(str(tmp_path), 1, 1.0).take(0)
    assert got["episodes"] == good
    rl_task.batch([rl_task.Episode.from_json(e) for e in got["episodes"]], 2)
    err = capsys.readouterr().err
    assert err.count("rl: warning") == 1 and str(p) in err
    assert f"training on 4 of {len(eps)} episodes; skipped {len(eps) - 4} bad" in err


def test_what_does_not_split_into_micro_batches_is_left_over_not_a_stop(tmp_path, capsys):
    _put(tmp_path, 0, 0, [_ep(0)])  # one good episode, two micro-batches
    _put(tmp_path, 1, 0, [_ep(0), _ep(0), _ep(0)])
    q = RolloutQueue(str(tmp_path), 1, 1.0, micro=2)
    got = q.take(0)
    assert got["batch"] == 1 and len(got["episodes"]) == 2
    rl_task.batch([rl_task.Episode.from_json(e) for e in got["episodes"]], 2)
    err = capsys.readouterr().err
    assert "fewer than the 2 micro-batches" in err and "1 left over" in err


@pytest.mark.parametrize("body", [b"[", b"not json", b"[]", b'{"version": 0}', b'{"version": 0, "episodes": {}}',
                                  b'{"version": 0, "episodes": []}', b"[" * 100_000 + b"]" * 100_000,
                                  b'{"version": ' + b"9" * 5000 + b"}", b"\xff\xfe"])
def test_garbage_batches_are_skipped(tmp_path, capsys, body):
    rl_task.batch_path(tmp_path, 0).write_bytes(body)
    _put(tmp_path, 1, 0)
    assert RolloutQueue(str(tmp_path), 1, 1.0).take(0)["batch"] == 1
    assert f"skipped rollout batch 0: {rl_task.batch_path(tmp_path, 0)}" in capsys.readouterr().err


# ------------------------------------------------------------------ other writers in shared folders
def test_the_journal_never_writes_through_a_link_at_its_temporary_name(tmp_path):
    from nemo_dcr_callback.receiver.journal import Journal

    victim = _victim(tmp_path)
    j = Journal(tmp_path / "journal", durable=True)
    os.symlink(victim, tmp_path / "journal" / "state.json.tmp")  # the old code's temporary name
    os.symlink(victim, tmp_path / "journal" / "redo-0000000003.pt.tmp")
    j.begin(3, [])
    j.done(3)
    assert victim.read_text() == "precious" and j.held() == 3


def test_a_checkpoint_directory_never_writes_through_a_link_in_its_state_folder(tmp_path):
    from safetensors.torch import save_file

    from nemo_dcr_callback.receiver.targets.checkpoint_dir import CheckpointDirTarget

    victim = _victim(tmp_path)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    t = CheckpointDirTarget(d)
    os.symlink(victim, d / ".nemo-dcr" / "state.json.tmp")
    os.symlink(victim, d / ".nemo-dcr" / "redo-0000000001.pt")  # the redo log's own name
    t.apply([], version=1)
    assert victim.read_text() == "precious"
    assert json.loads((d / ".nemo-dcr" / "state.json").read_text())["version"] == 1
    assert CheckpointDirTarget(d).version == 1


def test_step_checkpoints_never_write_through_a_link(tmp_path):
    from nemo_dcr_callback.recipes.lightning_gpt import StepCheckpoints

    victim = _victim(tmp_path)
    ck = StepCheckpoints(str(tmp_path / "ck"), every=1)
    d = tmp_path / "ck" / "step-00000001"
    d.mkdir(parents=True)
    os.symlink(victim, d / ".rank-0.pt.tmp")
    os.symlink(victim, d / "done")
    model = torch.nn.Linear(2, 2)
    ck.step(model)
    assert victim.read_text() == "precious"
    other = torch.nn.Linear(2, 2)
    StepCheckpoints(str(tmp_path / "ck"), every=1).restore(other)
    assert torch.equal(other.weight, model.weight)
