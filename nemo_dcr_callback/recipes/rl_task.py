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

import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

PAD, BOS, ASK, HIGHER, LOWER, RIGHT = 0, 1, 2, 3, 4, 5
DIGIT0 = 10  # digit d is token DIGIT0 + d
DIGITS = list(range(DIGIT0, DIGIT0 + 10))
SEQ = 8  # the longest episode: prompt 4, g1, the answer, g2; plus one pad
SECRETS = {"first": lambda a, b: a, "max": max, "sum": lambda a, b: (a + b) % 10}


# The rollout folder both sides share: batch files the worker writes in order, and the
# trainer's cursor (its next batch index), by which the worker paces itself.
CURSOR = "cursor"


def batch_path(folder: str | Path, i: int) -> Path:
    return Path(folder) / f"r-{i:06d}.json"


def write_whole(path: Path, text: str) -> None:
    """Written aside, then renamed into place: the other side reads whole files only."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    out = []
    for e in episodes:
        rs = groups[e.group]
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
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
