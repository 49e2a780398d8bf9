"""The RL loop's task (`nemo-dcr demo --rl`): guess a secret digit in two turns.

An episode is a conversation in token ids (the loop's engine runs without a tokenizer):

    prompt   [BOS, a, b, ASK]          two digits; the secret is a function of them (SECRETS)
    turn 1   g1                         the policy's guess (sampling restricted to the digits)
    env      HIGHER | LOWER | RIGHT     the environment compares g1 with the secret
    turn 2   g2                         a second guess, after the answer (only if g1 missed)

The reward is a program: 1 for a first guess right, 0.5 for a second, else 0. A policy that
guesses at random scores about 0.15; a tiny GPT learns the task within minutes on a CPU,
which is all the loop needs from it (it exists to exercise the weight updates, not to learn
anything hard). Both sides import this module: the rollout worker builds episodes, the
trainer turns them into token batches with the advantages and the mask of the policy's
own tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from nemo_dcr_callback import safe_io

PAD, BOS, ASK, HIGHER, LOWER, RIGHT = 0, 1, 2, 3, 4, 5
DIGIT0 = 10  # digit d is token DIGIT0 + d
DIGITS = list(range(DIGIT0, DIGIT0 + 10))
SEQ = 8  # the longest episode: prompt 4, g1, the answer, g2; plus one pad
VOCAB = DIGIT0 + 10  # the task's tokens; the model's vocabulary may be larger
SECRETS = {"first": lambda a, b: a, "max": max, "sum": lambda a, b: (a + b) % 10}


# The rollout folder both sides share: batch files the worker writes in order, and the
# trainer's cursor (its next batch index), by which the worker paces itself. Whoever else can
# write there must not make either side write through a link or read without bound, and a
# batch is a claim: it is checked against the trainer's versions and model before training.
CURSOR = "cursor"
CURSOR_MAX = 64  # bytes: a decimal index and nothing else
# Far above any batch the worker writes, and small enough that parsing the worst JSON of this
# size (a list of empty objects) stays within the trainer's memory.
BATCH_MAX = 4 << 20
REWARD_MAX = 1e3  # far beyond the task's rewards; keeps the group statistics finite
SKIPPED_SAID = 8  # bad episodes of a batch whose reasons are kept
_FIELDS = ("a", "b", "version", "tokens", "mine", "reward", "group")


class BadBatch(ValueError):
    """A rollout batch that cannot be trained on; the message names its file and why."""


def batch_path(folder: str | Path, i: int) -> Path:
    return Path(folder) / f"r-{i:06d}.json"


def write_whole(path: Path, text: str) -> None:
    """Written aside under an unpredictable name, then renamed into place (safe_io): the other
    side reads whole files only, and a link planted in the folder is never written through."""
    safe_io.write_whole(path, text)


def open_log(path: Path) -> IO[str]:
    """An append-only text log in the shared folder, opened without following a link there."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "a")


def read_cursor(folder: str | Path) -> int:
    """The trainer's cursor (0 before it wrote one). ValueError or OSError if it is not a
    small decimal file of its own (a link, a folder, too large, not a number)."""
    raw = safe_io.read_beneath(folder, CURSOR, CURSOR_MAX)
    text = raw.decode("ascii", errors="strict").strip()
    if not text.isdigit():
        raise ValueError(f"{Path(folder) / CURSOR}: not a batch index: {text[:20]!r}")
    return int(text)


def _is_int(x: Any) -> bool:
    return type(x) is int  # (bool is an int to isinstance)


def _show(x: Any) -> str:
    """A claimed value for a message: a scalar shortened, anything else by its type (the
    repr of deep nesting could itself fail)."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return repr(x)[:40]
    return f"({type(x).__name__})"


def check_episode(e: Any, version: int, max_tokens: int, vocab: int) -> dict:
    """One episode's fields, checked against the task and the model (ValueError why)."""
    if not isinstance(e, dict):
        raise ValueError(f"not an object but {type(e).__name__}")
    missing = [f for f in _FIELDS if f not in e]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    a, b, v, tokens, mine, reward, group = (e[f] for f in _FIELDS)
    if not (_is_int(a) and _is_int(b) and 0 <= a < 10 and 0 <= b < 10):
        raise ValueError("a and b must be digits")
    if not _is_int(v) or v != version:
        raise ValueError(f"version {_show(v)}, not its batch's {version}")
    if not _is_int(group) or not 0 <= group < 1 << 31:
        raise ValueError(f"group {_show(group)}: not a group index")
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= max_tokens:
        n = len(tokens) if isinstance(tokens, list) else type(tokens).__name__
        raise ValueError(f"tokens: {n}, where a sequence holds 1 to {max_tokens}")
    if not all(_is_int(t) and 0 <= t < vocab for t in tokens):
        raise ValueError(f"tokens: an id that is not an integer in [0, {vocab})")
    if not isinstance(mine, list) or not all(_is_int(j) and 1 <= j < len(tokens) for j in mine):
        # (index 0 has no label before it: its weight would land on the sequence's last label)
        raise ValueError(f"mine: not a list of token indices in [1, {len(tokens)})")
    if _is_int(reward) and abs(reward) <= REWARD_MAX:
        reward = float(reward)  # (a larger integer could overflow a float: refused just below)
    if not isinstance(reward, float) or not math.isfinite(reward) or abs(reward) > REWARD_MAX:
        raise ValueError(f"reward {_show(reward)}: not a finite number within +-{REWARD_MAX:g}")
    return {"a": a, "b": b, "version": v, "tokens": list(tokens), "mine": list(mine), "reward": reward,
            "group": group}


def read_batch(folder: str | Path, i: int, current: int, max_tokens: int = SEQ + 1,
               vocab: int = VOCAB) -> dict:
    """Rollout batch i of `folder`, as the trainer takes it: read without following a link,
    refused over BATCH_MAX unread, its version one the trainer has published (an integer in
    [0, current]), each episode checked (check_episode). Returns {"batch", "version",
    "episodes": the good ones, "bad": how many were left out, "skipped": why, for the first few}.
    FileNotFoundError: not written yet; BadBatch (naming the file): nothing in it to train on."""
    path = batch_path(folder, i)
    try:
        raw = safe_io.read_beneath(folder, path.name, BATCH_MAX)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # a link, a folder, a FIFO, too large
        raise BadBatch(f"{path}: {exc}") from None
    try:
        b = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (too deep, or a number of too many digits)
        raise BadBatch(f"{path}: not JSON ({str(exc)[:200]})") from None
    if not isinstance(b, dict):
        raise BadBatch(f"{path}: not a JSON object")
    v = b.get("version")
    if not _is_int(v) or not 0 <= v <= current:
        raise BadBatch(f"{path}: version {_show(v)} is not one the trainer has published (an integer in "
                       f"[0, {current}])")
    eps = b.get("episodes")
    if not isinstance(eps, list):
        raise BadBatch(f"{path}: episodes is not a list")
    good, skipped, bad = [], [], 0
    for k, e in enumerate(eps):
        try:
            good.append(check_episode(e, v, max_tokens, vocab))
        except ValueError as exc:
            bad += 1
            if len(skipped) < SKIPPED_SAID:  # (a file of empty objects must not cost a message each)
                skipped.append(f"episode {k}: {exc}")
    if not good:
        raise BadBatch(f"{path}: no episode to train on" + (f" ({skipped[0]}; {bad} bad)" if bad else ""))
    return {"batch": i, "version": v, "episodes": good, "skipped": skipped, "bad": bad}


def warn(msg: str) -> None:
    print(f"rl: warning: {msg}", file=sys.stderr, flush=True)


@dataclass
class Episode:
    """One conversation and its reward; `version`: the policy version that generated it."""

    a: int
    b: int
    version: int
    tokens: list[int] = field(default_factory=list)  # the whole conversation
    mine: list[int] = field(default_factory=list)  # indices of the policy's tokens in it
    reward: float = 0.0
    group: int = 0  # episodes of one prompt share a group (the GRPO baseline)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Episode:
        return cls(**d)


def prompt(a: int, b: int) -> list[int]:
    return [BOS, DIGIT0 + a, DIGIT0 + b, ASK]


def digit(token: int) -> int | None:
    return token - DIGIT0 if token in DIGITS else None


def answer(secret: int, guess: int | None) -> int:
    """The environment's turn: where the secret lies from the guess."""
    if guess == secret:
        return RIGHT
    return HIGHER if guess is None or secret > guess else LOWER


def prompts(n: int, rng: random.Random) -> list[tuple[int, int]]:
    return [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]


def first_turn(a: int, b: int, g1: int, version: int, group: int, secret: str = "first") -> Episode:
    """The episode after the first guess, with the environment's answer (and its reward if it
    was right: then there is no second turn)."""
    s = SECRETS[secret](a, b)
    reply = answer(s, digit(g1))
    ep = Episode(a, b, version, prompt(a, b) + [g1, reply], [4], 1.0 if reply == RIGHT else 0.0, group)
    return ep


def second_turn(ep: Episode, g2: int, secret: str = "first") -> Episode:
    s = SECRETS[secret](ep.a, ep.b)
    ep.tokens.append(g2)
    ep.mine.append(len(ep.tokens) - 1)
    ep.reward = 0.5 if digit(g2) == s else 0.0
    return ep


def advantages(episodes: list[Episode]) -> list[float]:
    """GRPO's: each reward less its group's mean, over the group's standard deviation (a
    group all right or all wrong teaches nothing: zero)."""
    groups: dict[int, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.group, []).append(e.reward)
    stats = {}  # once per group: a batch of one large group must not cost its square
    for g, rs in groups.items():
        mean = sum(rs) / len(rs)
        stats[g] = mean, (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
    out = []
    for e in episodes:
        mean, std = stats[e.group]
        out.append((e.reward - mean) / (std + 1e-4) if std > 0 else 0.0)
    return out


def batch(episodes: list[Episode], micro_batches: int):
    """Token ids [micro, batch, SEQ + 1] and per-label weights [micro, batch, SEQ] (the
    advantage at the labels that are the policy's tokens, 0 elsewhere) for the trainer's
    policy-gradient step; len(episodes) must divide into micro_batches."""
    import torch

    if not episodes or len(episodes) % micro_batches:
        raise ValueError(f"{len(episodes)} episodes do not split into {micro_batches} micro-batches")
    adv = advantages(episodes)
    tokens = torch.full((len(episodes), SEQ + 1), PAD, dtype=torch.long)
    weights = torch.zeros(len(episodes), SEQ)
    for i, (e, a) in enumerate(zip(episodes, adv, strict=True)):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        for j in e.mine:  # the label at j - 1 predicts token j
            weights[i, j - 1] = a
    mb = len(episodes) // micro_batches
    return tokens.reshape(micro_batches, mb, SEQ + 1), weights.reshape(micro_batches, mb, SEQ)
