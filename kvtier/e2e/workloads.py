"""Workloads of the end-to-end harness, as token ids drawn from a seed (no tokenizer, nothing downloaded).

* :func:`long_prompts`: FlexKV-style long prompts (lengths log-normal around a median, clipped to a maximum; groups of
  prompts share a long prefix, the rest are unique).
* :func:`multi_turn`: chat conversations under one shared system prompt; each turn's prompt is the whole history
  (built by the caller from the turns and the outputs it got).
* :func:`fixed_prefix`: one prefix of a given length and distinct suffixes of a given length (one per repetition),
  for TTFT at fixed sizes.
* :func:`swe_bench_like`: FlexKV's serving table's prompts (SWE-bench-Lite: a common instruction, several prompts
  per repository context, a task of their own), its length distribution.
* :func:`multi_turn_rounds`: SGLang's ``bench_multiturn.py`` conversations: each client adds a turn of fixed length
  per round to its whole history.
* :func:`shared_system_prompt`: one system prompt under many distinct questions.
* :func:`distinct_prompts`: prompts that share nothing (what a host tier costs where nothing is reused).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["long_prompts", "Conversation", "multi_turn", "fixed_prefix", "swe_bench_like", "multi_turn_rounds",
           "shared_system_prompt", "distinct_prompts"]


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


def swe_bench_like(n: int = 120, *, vocab: int, seed: int = 0, median: int = 7088, max_len: int = 27961,
                   min_len: int = 1500, sigma: float = 0.6, instruction_len: int = 800, repos: int = 12,
                   repo_fraction: tuple[float, float] = (0.5, 0.8)) -> list[list[int]]:
    """``n`` prompts shaped like FlexKV's SWE-bench-Lite table (p50 7,088 tokens, max 27,961): lengths log-normal
    (``median``, ``sigma``) clipped to ``[min_len, max_len]``, the longest set to ``max_len``; every prompt starts
    with one ``instruction_len``-token instruction, then its repository's context (``repos`` repositories, prompts
    dealt round robin; a context is a random fraction of the repository's shortest prompt), then a task of its own.
    Order shuffled."""
    rng = np.random.default_rng([seed, 53])
    lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), min_len, max_len).astype(int)
    lengths[int(np.argmax(lengths))] = max_len
    instruction = _tokens(rng, instruction_len, vocab)
    members = [np.arange(r, n, repos) for r in range(repos)]
    context = {}
    for r, idx in enumerate(members):
        if idx.size:
            room = int(lengths[idx].min()) - instruction_len
            context[r] = _tokens(rng, max(0, int(room * rng.uniform(*repo_fraction))), vocab)
    prompts = []
    for i, m in enumerate(lengths):
        head = instruction + context[i % repos]
        prompts.append(head + _tokens(rng, max(1, int(m) - len(head)), vocab))
    return [prompts[i] for i in rng.permutation(n)]


def multi_turn_rounds(clients: int = 20, rounds: int = 10, *, turn_len: int = 4096, vocab: int, seed: int = 0
                      ) -> list[list[list[int]]]:
    """``bench_multiturn.py``'s conversations: per client, ``rounds`` user turns of ``turn_len`` tokens. Round
    ``r``'s prompt is the client's whole history (turns and the outputs it got) plus turn ``r``: the caller builds
    it as outputs arrive."""
    rng = np.random.default_rng([seed, 20])
    return [[_tokens(rng, turn_len, vocab) for _ in range(rounds)] for _ in range(clients)]


def shared_system_prompt(n: int = 100, *, vocab: int, seed: int = 0, system_len: int = 2000,
                         question_len: tuple[int, int] = (50, 300)) -> list[list[int]]:
    """``n`` prompts: one ``system_len``-token system prompt, then a question of its own (``question_len``
    inclusive)."""
    rng = np.random.default_rng([seed, 100])
    system = _tokens(rng, system_len, vocab)
    return [system + _tokens(rng, int(rng.integers(question_len[0], question_len[1] + 1)), vocab) for _ in range(n)]


def distinct_prompts(n: int, *, vocab: int, seed: int = 0, lengths: tuple[int, int] = (1000, 4000)
                     ) -> list[list[int]]:
    """``n`` prompts that share no page (lengths uniform in ``lengths``, inclusive)."""
    rng = np.random.default_rng([seed, 0xD15])
    return [_tokens(rng, int(rng.integers(lengths[0], lengths[1] + 1)), vocab) for _ in range(n)]
