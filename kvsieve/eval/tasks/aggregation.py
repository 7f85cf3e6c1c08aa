"""RULER's aggregation tasks, common-words extraction (``cwe``) and frequent-words extraction
(``fwe``), both scored by RULER's string_match_all.

``cwe``: a numbered list of words in which 10 words appear 30 times each and every other word 3
times (below 4,096 tokens: 6 times and once), after one worked example; the answer is the 10
common words. RULER draws its words from the ``wonderwords`` noun, adjective and verb lists; kvsieve
draws them from the words of the Paul Graham essays (:func:`essay_words`: the distinct lowercase
alphabetic words of 4 to 12 letters), which bounds the list, so a length whose list would need
more words is refused.

``fwe``: coded words (6 random lowercase letters) drawn from a vocabulary of ``length // 50`` with
Zipf frequencies (exponent 2: word ``k`` appears ``int(n k^-2 / zeta(2))`` times); the most
frequent is replaced by ``...`` (noise); the answer is the 2nd to 4th most frequent.

Neither task has a needle, so neither has a depth.
"""
from __future__ import annotations

import math
import random
import re
import string
from functools import lru_cache
from typing import Any

from ..haystack import essays_text
from ._prompt import fill_to_length
from .base import Sample, Task, register_task

__all__ = ["CommonWordsTask", "FrequentWordsTask", "essay_words"]

_CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
        " Answer: The top 10 words that appear most often in the list are:")
_FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
        "text above, the three most frequently appeared words are:")
_NUM_COMMON = 10
_SHORT = 4096  # RULER's CWE uses fewer repetitions below this length


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The distinct lowercase words of 4 to 12 letters in the essays, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,12}\b", essays_text()))))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(common: list[str], uncommon: list[str], repeats: tuple[int, int], seed: int) -> list[str]:
    """``common`` words ``repeats[0]`` times and ``uncommon`` ``repeats[1]`` times, shuffled by ``seed``."""
    out = common * repeats[0] + uncommon * repeats[1]
    random.Random(seed).shuffle(out)
    return out


class _Extraction(Task):
    """An aggregation task: no needle, so no depth."""

    uses_depths = False


@register_task
class CommonWordsTask(_Extraction):
    """RULER cwe: the 10 words repeated most often in a long numbered list of essay words."""

    name = "cwe"
    metric = "RULER string_match_all (share of the 10 common words named)"
    max_new_tokens = 64  # ten numbered words (RULER: 120)

    @staticmethod
    def _repeats(length: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(common, uncommon) repeats of the list, and (words, common, uncommon repeats) of the example."""
        return ((6, 1), (20, 3, 1)) if length < _SHORT else ((30, 3), (40, 10, 3))

    def check_length(self, length: int) -> None:
        words = essay_words()
        (common, uncommon), _ = self._repeats(length)
        entries = _NUM_COMMON * common + (len(words) - _NUM_COMMON) * uncommon
        most = entries * (len(str(entries)) + 3 + max(map(len, words))) + len(_CWE)
        if length > most:  # no tokenizer makes more tokens than bytes
            raise ValueError(f"the essay word list ({len(words)} words) cannot fill length={length} tokens: the "
                             f"longest list is under {most} bytes")

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        words = essay_words()
        repeats, (ex_words, *ex_repeats) = self._repeats(length)
        example = rng.sample(words, ex_words)
        shot_list = _word_list(example[:_NUM_COMMON], example[_NUM_COMMON:], tuple(ex_repeats), rng.getrandbits(64))
        shot = f"{_CWE.format(context=_numbered(shot_list))} {_numbered(example[:_NUM_COMMON])}\n"
        order = rng.sample(words, len(words))
        seed = rng.getrandbits(64)

        def prompt(n: int) -> str:
            listed = _word_list(order[:_NUM_COMMON], order[_NUM_COMMON:_NUM_COMMON + n], repeats, seed)
            return shot + _CWE.format(context=_numbered(listed))

        n = fill_to_length(tokenizer, length, prompt, len(words) - _NUM_COMMON, f"task {self.name}")
        return Sample(index, prompt(n), order[:_NUM_COMMON], None, {"uncommon_words": n})


@register_task
class FrequentWordsTask(_Extraction):
    """RULER fwe: the 3 most frequent coded words of a Zipf-distributed coded text (the top one is noise '...')."""

    name = "fwe"
    metric = "RULER string_match_all (share of the 3 frequent words named)"
    max_new_tokens = 32  # three coded words (RULER: 50)
    alpha = 2.0
    word_letters = 6

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        size = max(5, length // 50)  # RULER's vocabulary size: one word per 50 tokens
        vocab: list[str] = []
        while len(vocab) < size:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.word_letters))
            if word not in vocab:
                vocab.append(word)
        vocab[0] = "..."
        zeta = math.pi ** 2 / 6  # zeta(2)
        seed = rng.getrandbits(64)

        def prompt(n: int) -> str:
            text = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -self.alpha / zeta))]
            random.Random(seed).shuffle(text)
            return _FWE.format(context=" ".join(text))

        # every word is at least one token, and the counts keep over 99% of n words once n >> size
        n = fill_to_length(tokenizer, length, prompt, 2 * length + 100 * size, f"task {self.name}")
        return Sample(index, prompt(n), vocab[1:4], None, {"coded_words": n})
