"""Prompts that ship with the studio."""

from __future__ import annotations

from pathlib import Path

AUSTEN = Path(__file__).resolve().parents[1] / "bench" / "data" / "austen.txt"


def needle_in_austen(chars: int = 8200, key: str = "lantern", value: str = "4738291") -> str:
    """~2K tokens of Pride and Prejudice with a magic number hidden at half depth, then the question."""
    haystack = AUSTEN.read_text()[:chars]
    cut = haystack.find(". ", len(haystack) // 2) + 2
    body = f"{haystack[:cut]} One of the special magic numbers for {key} is: {value}. {haystack[cut:]}"
    return (f"Read the text below and remember the special magic number hidden in it.\n\n{body}\n\n"
            f"What is the special magic number for {key} mentioned in the text?")


MUFFINS = ("A baker makes 4 trays of 12 muffins. She sells 17 muffins in the morning and 2 trays' worth in the "
           "afternoon, then bakes 9 more. How many muffins does she have at the end of the day? Think step by step "
           "and give the final number.")

# name -> () -> (prompt, expected answer or "" when there is no single right answer)
EXAMPLES = {
    "Needle in ~2K tokens of Austen (retrieval)": lambda: (needle_in_austen(), "4738291"),
    "Multi-step reasoning": lambda: (MUFFINS, str(4 * 12 - 17 - 2 * 12 + 9)),
    "Chat question": lambda: ("What are three practical tips for staying focused while studying? Keep it short.", ""),
}
