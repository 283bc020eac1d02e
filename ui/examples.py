"""Prompts that ship with the studio, each with what to look at.

An example is (prompt, expected answer or "" when there is none, new tokens, the layer to show, one line on what to
look at) and the settings it is meant to run at: the budget, the temperature and the seed, which picking it sets
(an example picked after another does not keep the other's). Several answers separated by "; " must all appear for
a lane to have found them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qevict_core import QEvictConfig

AUSTEN = Path(__file__).resolve().parent / "data" / "austen.txt"
# Written by `python -m bench.studio_data promotion`: a needle whose window QEvict demotes and promotes back.
PROMOTION = Path(__file__).with_name("promotion_example.json")


@dataclass(frozen=True)
class Example:
    prompt: str
    expected: str
    max_new_tokens: int
    layer: int | None  # the layer the tier map should open on (None: the studio's default)
    hint: str
    budget: float = QEvictConfig().budget  # the KV budget it is shown at
    temperature: float = 0.0  # 0: greedy
    seed: int = 0


def austen(start: int, chars: int) -> str:
    """``chars`` characters of Pride and Prejudice from the sentence after ``start``."""
    text = AUSTEN.read_text()
    begin = 0 if start == 0 else text.find(". ", start) + 2
    return text[begin:begin + chars]


def hide(haystack: str, facts: list[tuple[float, str]]) -> str:
    """Each fact inserted at a sentence boundary near its depth (0 = start, 1 = end)."""
    for depth, fact in sorted(facts, reverse=True):  # from the end, so earlier cuts keep their place
        cut = haystack.find(". ", int(len(haystack) * depth)) + 2
        haystack = f"{haystack[:cut]}{fact} {haystack[cut:]}"
    return haystack


def needle_in_austen(chars: int = 8200, key: str = "lantern", value: str = "4738291", start: int = 0,
                     depth: float = 0.5) -> str:
    """~2K tokens of Pride and Prejudice with a magic number hidden at ``depth``, then the question."""
    body = hide(austen(start, chars), [(depth, f"One of the special magic numbers for {key} is: {value}.")])
    return (f"Read the text below and remember the special magic number hidden in it.\n\n{body}\n\n"
            f"What is the special magic number for {key} mentioned in the text?")


def two_facts() -> Example:
    body = hide(austen(30000, 8000), [(0.2, "The special magic number for harbor is: 5190437."),
                                      (0.8, "The special magic city for harbor is: Valparaiso.")])
    prompt = (f"Read the text below and remember the two facts about harbor hidden in it.\n\n{body}\n\n"
              "What are the special magic number and the special magic city for harbor?")
    return Example(prompt, "5190437; Valparaiso", 48, None,
                   "Two facts far apart: does each lane keep both windows? The tier map shows where each one sits.")


def continuation() -> Example:
    prompt = ("Continue this passage of Pride and Prejudice in the same style.\n\n" + austen(60000, 6000))
    # Sampled: greedy, SmolLM2 repeats one sentence for most of the 256 tokens in every lane, which shows no drift
    return Example(prompt, "", 256, None,
                   "Drift over a long run, sampled at temperature 0.85 with one seed for every lane (greedy, this "
                   "model loops): each lane follows FullKV until its own cache changes a token; watch where each "
                   "text first differs and what the tier map demoted by then.", temperature=0.85)


def promotion() -> Example:
    found = json.loads(PROMOTION.read_text())
    prompt = needle_in_austen(start=found["start"], depth=found["depth"], key=found["key"], value=found["value"])
    return Example(prompt, found["value"], found["max_new_tokens"], found["layer"],
                   f"At {found['budget']:.0%} of the bytes, where QEvict keeps full windows, layer {found['layer']}: "
                   f"QEvict demotes window {found['window']} (“{found['text']}”) at step {found['demoted_step']} and "
                   f"promotes it back at step {found['promoted_step']} while it answers (▼ then ▲ in the tier map; "
                   "the moves list names it).", found["budget"])


EXAMPLES = {
    "Needle in ~2K tokens of Austen (retrieval)": lambda: Example(
        needle_in_austen(), "4738291", 64, None,
        "Retrieval at 20% of the bytes: which lanes still find the number? Its window stays in QEvict's tiers."),
    "Two facts far apart (multi-part question)": two_facts,
    "Long continuation (256 tokens)": continuation,
    "A window demoted, then promoted back": promotion,
}
