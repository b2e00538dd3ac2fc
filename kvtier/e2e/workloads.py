"""Workloads of the end-to-end harness, as token ids drawn from a seed (no tokenizer, nothing downloaded).

* :func:`long_prompts`: FlexKV-style long prompts (lengths log-normal around a median, clipped to a maximum; groups of
  prompts share a long prefix, the rest are unique).
* :func:`multi_turn`: chat conversations under one shared system prompt; each turn's prompt is the whole history
  (built by the caller from the turns and the outputs it got).
* :func:`fixed_prefix`: one prefix of a given length and distinct suffixes of a given length (one per repetition),
  for TTFT at fixed sizes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["long_prompts", "Conversation", "multi_turn", "fixed_prefix"]


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, size=n).tolist()


def long_prompts(n: int = 120, *, vocab: int, seed: int = 0, median: int = 7000, max_len: int = 28672,
                 min_len: int = 1024, sigma: float = 0.6, groups: int = 8, group_size: int = 5,
                 shared_fraction: tuple[float, float] = (0.6, 0.9)) -> list[list[int]]:
    """``n`` prompts: lengths log-normal (``median``, ``sigma``) clipped to ``[min_len, max_len]``, the longest
    set to ``max_len``; ``groups`` groups of ``group_size`` prompts share a prefix of a random fraction of the
    group's shortest prompt, the other prompts share nothing. Order shuffled."""
    if groups * group_size > n:
        raise ValueError(f"{groups} groups of {group_size} need at least {groups * group_size} prompts, got {n}")
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), min_len, max_len).astype(int)
    lengths[int(np.argmax(lengths))] = max_len
    prompts: list[list[int]] = []
    for g in range(groups):
        members = lengths[g * group_size:(g + 1) * group_size]
        shared = _tokens(rng, int(members.min() * rng.uniform(*shared_fraction)), vocab)
        prompts += [shared + _tokens(rng, int(m) - len(shared), vocab) for m in members]
    prompts += [_tokens(rng, int(m), vocab) for m in lengths[groups * group_size:]]
    order = rng.permutation(n)
    return [prompts[i] for i in order]


@dataclasses.dataclass
class Conversation:
    """A chat: the shared system prompt and the user's messages, one per turn."""

    system: list[int]
    user_turns: list[list[int]]


def multi_turn(num_conversations: int = 16, *, vocab: int, seed: int = 0, system_len: int = 2048,
               turns: tuple[int, int] = (3, 5), user_len: tuple[int, int] = (100, 600)) -> list[Conversation]:
    """Conversations sharing one ``system_len``-token system prompt, ``turns`` (inclusive) turns each, user
    messages of ``user_len`` (inclusive) tokens."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab)
    out = []
    for _ in range(num_conversations):
        k = int(rng.integers(turns[0], turns[1] + 1))
        out.append(Conversation(system, [_tokens(rng, int(rng.integers(user_len[0], user_len[1] + 1)), vocab)
                                         for _ in range(k)]))
    return out


def fixed_prefix(prefix_len: int, new_tokens: int, reps: int, *, vocab: int, seed: int = 0
                 ) -> tuple[list[int], list[list[int]]]:
    """A ``prefix_len``-token prefix (the same for every ``new_tokens``) and ``reps`` distinct
    ``new_tokens``-token suffixes."""
    prefix = _tokens(np.random.default_rng([seed, prefix_len]), prefix_len, vocab)
    rng = np.random.default_rng([seed, prefix_len, new_tokens])
    return prefix, [_tokens(rng, new_tokens, vocab) for _ in range(reps)]
