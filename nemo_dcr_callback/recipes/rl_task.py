"""The RL loop's tasks (`nemo-dcr demo --rl`): guessing games with the environment in the loop.

An episode is a conversation in token ids (the loop's engine runs without a tokenizer):

    prompt   [BOS, ASK]  or  [BOS, a, b, ASK]   (a task whose secret is a function of two digits)
    turn t   g_t                                 the policy's guess (sampling restricted to the values)
    env      HIGHER | LOWER | RIGHT              the environment compares g_t with the secret
    ...      up to the task's turns; the episode ends at RIGHT or after the last guess

TASKS is the table of games. `search` (the default): a secret among 16 values, drawn per
episode and kept out of the prompt, found in up to 5 turns, the reward falling with the turns
used (1.0, 0.9, ... 0.6). A policy that ignores the answers finds it at most 5/16 of the time
(no_feedback_ceiling: a reward of at most 0.25; uniform guessing, the untrained policy, gets
0.223); a reward clearly above that can only come from conditioning on the environment's
answers (guessing uniformly within what the answers leave gets 0.58, halving it 0.76).
`first`, `max` and `sum` are the fast option: the secret is a function of two prompt digits,
two turns, rewards 1 and 0.5 (a tiny GPT learns `first` within minutes). Both sides import
this module: the rollout worker plays episodes, the trainer turns them into token batches with
the advantages, the behaviour policy's logprobs and versions, and the mask of the policy's own
tokens.
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
SEQ = 8  # the longest episode of the two-turn tasks: prompt 4, g1, the answer, g2; plus one pad
VOCAB = DIGIT0 + 16  # the tasks' tokens (16 values at most); the model's vocabulary may be larger
SECRETS = {"first": lambda a, b: a, "max": max, "sum": lambda a, b: (a + b) % 10}
LOGPROB_MIN = -1e4  # a behaviour logprob below this is no sampled token's (refused)


@dataclass(frozen=True)
class Task:
    """A guessing game: the policy names one of `values` tokens a turn, for up to `turns`
    turns; the environment answers HIGHER, LOWER or RIGHT. rewards[t - 1]: a find at turn t
    (none: 0). secret: a SECRETS key (the secret follows from the prompt's two digits) or None
    (drawn per episode by the environment, never in the prompt)."""

    name: str
    values: int
    turns: int
    rewards: tuple[float, ...]
    secret: str | None = None

    @property
    def allowed(self) -> list[int]:
        """The tokens a guess may be (the engine samples only these; the trainer's logprobs
        are normalised over them too, as the engine's processed logprobs are)."""
        return list(range(DIGIT0, DIGIT0 + self.values))

    @property
    def prompt_len(self) -> int:
        return 4 if self.secret else 2

    @property
    def seq(self) -> int:
        """The longest episode: the prompt, every guess, an answer between two guesses."""
        return self.prompt_len + 2 * self.turns - 1

    def no_feedback_ceiling(self) -> float:
        """The best mean reward of a policy that ignores the answers (distinct guesses, each
        finding a uniform secret with probability 1/values); None-secret tasks only."""
        return sum(self.rewards[:min(self.turns, self.values)]) / self.values

    def random_reward(self) -> float:
        """The mean reward of uniform guessing (repeats allowed): the untrained policy's."""
        miss = 1.0 - 1.0 / self.values
        return sum(r * miss ** t / self.values for t, r in enumerate(self.rewards[:self.turns]))


TASKS = {
    "search": Task("search", 16, 5, (1.0, 0.9, 0.8, 0.7, 0.6)),
    **{k: Task(k, 10, 2, (1.0, 0.5), secret=k) for k in SECRETS},
}


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


def check_episode(e: Any, version: int, max_tokens: int, vocab: int, current: int | None = None) -> dict:
    """One episode's fields, checked against the task and the model (ValueError why). Its
    version (the oldest policy version among its tokens) lies in [the batch's version, current];
    the behaviour policy's `logprobs` and `versions`, one per token of its own, are optional (the
    two-turn writers of old had none) and checked where present."""
    if not isinstance(e, dict):
        raise ValueError(f"not an object but {type(e).__name__}")
    missing = [f for f in _FIELDS if f not in e]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    a, b, v, tokens, mine, reward, group = (e[f] for f in _FIELDS)
    current = version if current is None else current
    if not (_is_int(a) and _is_int(b) and 0 <= a < 10 and 0 <= b < 10):
        raise ValueError("a and b must be digits")
    if not _is_int(v) or not version <= v <= current:
        raise ValueError(f"version {_show(v)}, not in [its batch's {version}, the trainer's {current}]")
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
    out = {"a": a, "b": b, "version": v, "tokens": list(tokens), "mine": list(mine), "reward": reward,
           "group": group}
    lp, vs = e.get("logprobs"), e.get("versions")
    if (lp is None) != (vs is None):
        raise ValueError("logprobs and versions come together or not at all")
    if lp is not None:
        if not (isinstance(lp, list) and isinstance(vs, list) and len(lp) == len(vs) == len(mine)):
            raise ValueError(f"logprobs and versions: not lists of one entry per token of its own ({len(mine)})")
        lp = [float(x) if _is_int(x) and abs(x) <= -LOGPROB_MIN else x for x in lp]
        if not all(isinstance(x, float) and LOGPROB_MIN <= x <= 0.0 for x in lp):
            raise ValueError(f"logprobs: an entry that is not a number in [{LOGPROB_MIN:g}, 0]")
        if not all(_is_int(x) and v <= x <= current for x in vs) or (vs and min(vs) != v):
            raise ValueError(f"versions: not integers in [{v}, {current}] whose oldest is the episode's version")
        out["logprobs"], out["versions"] = lp, list(vs)
    return out


def read_batch(folder: str | Path, i: int, current: int, max_tokens: int = SEQ + 1,
               vocab: int = VOCAB) -> dict:
    """Rollout batch i of `folder`, as the trainer takes it: read without following a link,
    refused over BATCH_MAX unread, its version (the oldest of its episodes') one the trainer has
    published (an integer in [0, current]), each episode checked (check_episode). Returns {"batch", "version",
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
            good.append(check_episode(e, v, max_tokens, vocab, current))
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
    """One conversation and its reward. `version`: the oldest policy version that sampled a
    token of it; `logprobs` and `versions`: the behaviour policy's logprob of each of its own
    tokens and the version that sampled it, as the engine reported them (empty: not recorded)."""

    a: int
    b: int
    version: int
    tokens: list[int] = field(default_factory=list)  # the whole conversation
    mine: list[int] = field(default_factory=list)  # indices of the policy's tokens in it
    reward: float = 0.0
    group: int = 0  # episodes of one prompt share a group (the GRPO baseline)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        if not self.versions:  # (not recorded: absent, as check_episode reads it)
            del d["logprobs"], d["versions"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Episode:
        return cls(**d)


def prompt(a: int, b: int) -> list[int]:
    return [BOS, DIGIT0 + a, DIGIT0 + b, ASK]


def digit(token: int, values: int = 10) -> int | None:
    return token - DIGIT0 if DIGIT0 <= token < DIGIT0 + values else None


def answer(secret: int, guess: int | None) -> int:
    """The environment's turn: where the secret lies from the guess."""
    if guess == secret:
        return RIGHT
    return HIGHER if guess is None or secret > guess else LOWER


def prompts(n: int, rng: random.Random) -> list[tuple[int, int]]:
    return [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]


def start_group(task: Task, rng: random.Random, group: int, n: int) -> tuple[list[Episode], int]:
    """`n` new episodes of `task` and their secret (the environment's: never in an episode).
    A group shares its prompt and its secret: GRPO's baseline compares like with like."""
    if task.secret:
        a, b = rng.randrange(10), rng.randrange(10)
        return [Episode(a, b, 0, prompt(a, b), [], 0.0, group) for _ in range(n)], SECRETS[task.secret](a, b)
    return [Episode(0, 0, 0, [BOS, ASK], [], 0.0, group) for _ in range(n)], rng.randrange(task.values)


def play(task: Task, ep: Episode, secret: int, token: int, logprob: float | None = None,
         version: int | None = None) -> bool:
    """The policy's guess `token` and the environment's answer; True while the episode goes on.
    The answer follows every guess but the last turn's; a find ends the episode with its reward."""
    turn = len(ep.mine) + 1
    ep.tokens.append(token)
    ep.mine.append(len(ep.tokens) - 1)
    if version is not None:
        ep.logprobs.append(float(logprob))
        ep.versions.append(int(version))
        ep.version = min(ep.versions)
    reply = answer(secret, digit(token, task.values))
    if reply == RIGHT:
        ep.reward = task.rewards[turn - 1]
    if turn == task.turns:
        return False
    ep.tokens.append(reply)
    return reply != RIGHT


def first_turn(a: int, b: int, g1: int, version: int, group: int, secret: str = "first") -> Episode:
    """The two-turn task's episode after the first guess, with the environment's answer (and
    its reward if it was right: then there is no second turn)."""
    task = TASKS[secret]
    ep = Episode(a, b, version, prompt(a, b), [], 0.0, group)
    play(task, ep, SECRETS[secret](a, b), g1)
    return ep


def second_turn(ep: Episode, g2: int, secret: str = "first") -> Episode:
    play(TASKS[secret], ep, SECRETS[secret](ep.a, ep.b), g2)
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


def batch(episodes: list[Episode], micro_batches: int, seq: int = SEQ):
    """Token ids [micro, batch, seq + 1] and per-label weights [micro, batch, seq] (the
    advantage at the labels that are the policy's tokens, 0 elsewhere) for the trainer's
    policy-gradient step; len(episodes) must divide into micro_batches."""
    t = tensors(episodes, micro_batches, seq)
    return t["tokens"], t["weights"]


def tensors(episodes: list[Episode], micro_batches: int, seq: int = SEQ) -> dict:
    """What the trainer's step takes, per label position (the label at j - 1 predicts token j),
    each [micro, batch, seq] (tokens: [micro, batch, seq + 1]): the advantage at the policy's
    tokens ("weights", 0 elsewhere), the behaviour logprob ("mu") and version ("versions", -1
    where none was recorded or the token is not the policy's) and "mask" (1 at the policy's
    tokens)."""
    import torch

    if not episodes or len(episodes) % micro_batches:
        raise ValueError(f"{len(episodes)} episodes do not split into {micro_batches} micro-batches")
    adv = advantages(episodes)
    n = len(episodes)
    tokens = torch.full((n, seq + 1), PAD, dtype=torch.long)
    weights, mu, mask = torch.zeros(n, seq), torch.zeros(n, seq), torch.zeros(n, seq)
    versions = torch.full((n, seq), -1, dtype=torch.long)
    for i, (e, a) in enumerate(zip(episodes, adv, strict=True)):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        for k, j in enumerate(e.mine):
            weights[i, j - 1], mask[i, j - 1] = a, 1.0
            if e.versions:
                mu[i, j - 1], versions[i, j - 1] = e.logprobs[k], e.versions[k]
    mb = n // micro_batches
    return {"tokens": tokens.reshape(micro_batches, mb, seq + 1),
            **{k: x.reshape(micro_batches, mb, seq) for k, x in
               (("weights", weights), ("mu", mu), ("versions", versions), ("mask", mask))}}
