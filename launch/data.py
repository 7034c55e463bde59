"""Deterministic text-like training data, byte-level tokens (vocabulary 256), no downloads.

The corpus is `launch/corpus.txt`, shipped in the repository. It was produced by `generate_corpus()` below
(a seeded grammar of short stories, dialogue, lists, arithmetic and dates), and can be rewritten with
`python launch/data.py --write`; the shipped file is what training reads, so runs do not depend on Python's
random module staying the same across versions.

Batches are a pure function of (seed, step, rank): a resumed run reads exactly the batches an uninterrupted
run reads, with no loader state to checkpoint. The last `VAL_FRACTION` of the corpus is held out.
"""

from __future__ import annotations

import argparse
import pathlib
import random

import torch

from model_config import VOCAB_SIZE  # noqa: F401 (bytes: 256)

CORPUS = pathlib.Path(__file__).with_name("corpus.txt")
VAL_FRACTION = 0.05

# ---- the generator -------------------------------------------------------------------------------

_NAMES = ["Ada", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo",
          "Mira", "Nina", "Omar", "Paula", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yara"]
_ROLES = ["fisherman", "baker", "teacher", "farmer", "sailor", "doctor", "painter", "miller", "weaver",
          "smith", "merchant", "gardener", "captain", "student", "shepherd", "carpenter"]
_ADJ = ["old", "young", "quiet", "clever", "tired", "cheerful", "patient", "curious", "brave", "careful",
        "honest", "busy", "gentle", "proud", "lonely", "kind"]
_PLACES = ["the harbor", "the market", "the old mill", "the village square", "the river bank", "the forest",
           "the library", "the bakery", "the hill", "the school", "the bridge", "the lighthouse", "the garden",
           "the station", "the workshop", "the meadow"]
_THINGS = ["a red boat", "a basket of apples", "a letter", "an old map", "a small dog", "a broken wheel",
           "a loaf of bread", "a silver key", "a wooden box", "a blue kite", "a lantern", "a bag of flour",
           "a book of songs", "a pair of boots", "a clay jar", "a fishing net"]
_VERBS = ["found", "carried", "repaired", "painted", "sold", "bought", "lost", "opened", "cleaned", "hid",
          "gave away", "borrowed", "counted", "wrapped", "studied", "watched"]
_TIMES = ["In the morning", "At noon", "In the evening", "Before dawn", "After the rain", "On Sunday",
          "Late at night", "In the spring", "During the storm", "At the end of the summer"]
_WEATHER = ["The sky was grey and the wind was cold.", "The sun was warm on the stones.",
            "A light rain fell over the roofs.", "Fog covered the water until noon.",
            "The air smelled of salt and pine.", "Snow lay thick on the path."]
_FEEL = ["happy", "worried", "surprised", "tired", "glad", "sad", "hopeful", "calm"]
_SAY = ["said", "asked", "replied", "whispered", "shouted", "answered"]
_LINES = ["Where are you going?", "I will be back before dark.", "Have you seen my brother?",
          "The bread is still warm.", "We should leave now.", "That is a fine boat.", "It looks like rain.",
          "Can you help me carry this?", "Thank you, my friend.", "Let us count them again.",
          "Nobody knows the way.", "The market opens at eight."]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]


def _person(r: random.Random) -> tuple[str, str]:
    name = r.choice(_NAMES)
    return name, f"{name} the {r.choice(_ADJ)} {r.choice(_ROLES)}"


def _story(r: random.Random) -> str:
    name, full = _person(r)
    other, _ = _person(r)
    pron = r.choice(["He", "She"])
    s = [f"{r.choice(_TIMES)}, {full} went to {r.choice(_PLACES)}.", r.choice(_WEATHER)]
    for _ in range(r.randint(2, 5)):
        k = r.random()
        if k < 0.35:
            s.append(f"{pron} {r.choice(_VERBS)} {r.choice(_THINGS)} near {r.choice(_PLACES)}.")
        elif k < 0.6:
            s.append(f"\"{r.choice(_LINES)}\" {r.choice(_SAY)} {other}.")
        elif k < 0.8:
            n = r.randint(2, 12)
            s.append(f"{name} counted {_NUMBERS[n]} {r.choice(['boats', 'apples', 'birds', 'coins', 'stars'])}.")
        else:
            s.append(f"{name} felt {r.choice(_FEEL)}, and {other} {r.choice(_VERBS)} {r.choice(_THINGS)}.")
    s.append(f"Then {pron.lower()} went home.")
    return " ".join(s)


def _arithmetic(r: random.Random) -> str:
    lines = []
    for _ in range(r.randint(3, 6)):
        a, b = r.randint(0, 50), r.randint(0, 50)
        if r.random() < 0.5:
            lines.append(f"{a} + {b} = {a + b}")
        else:
            a, b = max(a, b), min(a, b)
            lines.append(f"{a} - {b} = {a - b}")
    return "\n".join(lines)


def _ledger(r: random.Random) -> str:
    name, _ = _person(r)
    items = r.sample(_THINGS, r.randint(2, 4))
    rows = [f"{name}'s list for {r.randint(1, 28)} {r.choice(_MONTHS)}:"]
    rows += [f"- {it[2:] if it.startswith('a ') else it[3:]}: {r.randint(1, 9)}" for it in items]
    return "\n".join(rows)


def generate_corpus(n_bytes: int = 200_000, seed: int = 1234) -> str:
    r = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        k = r.random()
        p = _story(r) if k < 0.7 else (_arithmetic(r) if k < 0.85 else _ledger(r))
        parts.append(p)
        size += len(p) + 2
    return "\n\n".join(parts)[:n_bytes] + "\n"


# ---- the data ------------------------------------------------------------------------------------

def load_tokens(path: str | pathlib.Path | None = None, corpus_bytes: int = 0) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values (generated in memory if the file is missing).
    `corpus_bytes` > 0: that many bytes generated in memory (~1 s per 20 MB), for runs that would memorize the
    shipped file (its first 200,000 bytes are the shipped corpus, when generated by the same Python `random`)."""
    if corpus_bytes > 0:
        return torch.frombuffer(bytearray(generate_corpus(corpus_bytes).encode("utf-8")), dtype=torch.uint8).long()
    p = pathlib.Path(path) if path else CORPUS
    raw = p.read_bytes() if p.exists() else generate_corpus().encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class ByteBatches:
    """Random windows of `seq + 1` tokens; the global batch of step `step` is `dp * batch` windows drawn
    from a generator seeded by (seed, step), and rank `rank` takes rows [rank*batch, (rank+1)*batch)."""

    def __init__(self, tokens: torch.Tensor, seq: int, batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0):
        n_val = max(int(len(tokens) * VAL_FRACTION), seq + 1)
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]
        if len(self.train) <= seq + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq={seq}")
        self.seq, self.batch, self.dp_rank, self.dp_size, self.seed = seq, batch, dp_rank, dp_size, seed

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq + 1)
        w = data[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq - 1, (self.dp_size * self.batch,), generator=g)
        mine = starts[self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch]
        return self._windows(self.train, mine)

    def val_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`n` fixed held-out batches for this rank (evenly spaced windows, the same every call)."""
        total = n * self.dp_size * self.batch
        hi = len(self.val) - self.seq - 1
        starts = torch.linspace(0, max(hi, 0), total).long()
        out = []
        for i in range(n):
            block = starts[i * self.dp_size * self.batch:(i + 1) * self.dp_size * self.batch]
            out.append(self._windows(self.val, block[self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch]))
        return out


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"(re)write {CORPUS.name} from the generator")
    ap.add_argument("--bytes", type=int, default=200_000)
    a = ap.parse_args()
    if a.write:
        CORPUS.write_text(generate_corpus(a.bytes), encoding="utf-8")
        print(f"wrote {CORPUS} ({CORPUS.stat().st_size} bytes)")
    else:
        print(load_tokens().shape[0], "tokens;", repr(decode(load_tokens()[:400])))
