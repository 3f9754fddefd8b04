"""A small RAG-style prompt set, generated from a seed: fictional towns, one document each, and
questions whose answer sits in exactly one of the documents given with it.

Each document states about 20 facts on its town in plain sentences (about 512 tokens with the
SmolLM2 tokenizer at the default `num_facts`), so that the documents are alike in form and a
question can only be answered from the right one. Nothing here is tuned: the set exists to compare
fused prefill against full prefill on the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_SYLLABLES = ["var", "mir", "ten", "hol", "bra", "quin", "dor", "sel", "ath", "lun", "kes", "or", "vel",
              "thar", "mon", "ris", "gal", "fen", "tor", "wyn", "cal", "bel", "nor", "ost"]
_FIRST = ["Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira",
          "Lorenz", "Mara", "Nils", "Odile", "Pavel", "Rosa", "Soren", "Tilde", "Viktor"]
_LAST = ["Aldana", "Berg", "Castell", "Duarte", "Eklund", "Falk", "Gruber", "Hale", "Ivers", "Janssen",
         "Kovac", "Lind", "Moreau", "Nagy", "Ortega", "Petrov", "Quist", "Rask", "Stahl", "Toma"]
_GOODS = ["copper", "wool", "salt", "amber", "timber", "glass", "cheese", "silk", "tin", "honey", "paper",
          "linen", "clay pots", "olive oil", "rope", "dyes", "barley", "iron nails", "wax candles", "saffron"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_ANIMALS = ["heron", "fox", "otter", "lynx", "crane", "badger", "falcon", "stag", "owl", "hare", "wolf", "swan"]
_COLORS = ["green", "crimson", "blue", "golden", "white", "violet", "black", "orange"]

# (question, fact sentence template, filler sentence templates); each fact has a short answer.
_FACTS: list[tuple[str, str, str]] = [
    ("export", "What is the chief export of {town}?", "The chief export of {town} is {export}."),
    ("founder", "Who founded {town}?", "{town} was founded by {founder}."),
    ("founded", "In which year was {town} founded?", "The town was founded in the year {founded}."),
    ("river", "Which river flows through {town}?", "The river {river} flows through the middle of {town}."),
    ("mayor", "Who is the mayor of {town}?", "The current mayor of {town} is {mayor}."),
    ("festival", "In which month is the festival of {town} held?",
     "Every year the great festival of {town} is held in {festival}."),
    ("animal", "What animal is on the banner of {town}?", "The banner of {town} shows a {color} {animal}."),
    ("population", "How many people live in {town}?", "About {population} people live in {town} today."),
    ("mountain", "Which mountain overlooks {town}?", "The mountain {mountain} overlooks {town} from the north."),
    ("bridges", "How many bridges does {town} have?", "{town} has {bridges} stone bridges."),
]
_FILLER = [
    "The streets of {town} are narrow and paved with grey stones from the old quarry.",
    "Travellers often stop in {town} to rest their horses and buy bread at the market.",
    "The market square of {town} fills with traders every morning except on rest days.",
    "Children in {town} learn to read at the small school beside the town hall.",
    "The winters in {town} are long, and the people keep warm with wood from the forest.",
    "Many houses in {town} have red roofs and small gardens with herbs and flowers.",
    "An old library in {town} keeps maps, letters and records of the town's history.",
    "The people of {town} are known for their patience and their love of music.",
    "In spring, the fields around {town} turn bright with wild flowers and young wheat.",
    "A road of packed earth connects {town} with the villages of the valley.",
    "The town council of {town} meets once a month in a hall with tall windows.",
    "Fishermen in {town} mend their nets on the river bank in the evening.",
]


@dataclass(slots=True, frozen=True)
class Document:
    town: str
    text: str
    facts: dict[str, str]


@dataclass(slots=True, frozen=True)
class RagPrompt:
    """Documents in prompt order (indices into the corpus), the question and which document answers."""

    docs: tuple[int, ...]
    answer_doc: int
    question: str


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice([2, 3]))).capitalize()
        if name not in used:
            used.add(name)
            return name


def build_corpus(num_docs: int, seed: int = 17, num_filler: int = 22) -> list[Document]:
    rng = random.Random(seed)
    used: set[str] = set()
    docs = []
    for _ in range(num_docs):
        town = _name(rng, used)
        facts = {
            "town": town, "export": rng.choice(_GOODS),
            "founder": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", "founded": str(rng.randrange(1100, 1900)),
            "river": _name(rng, used), "mayor": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "festival": rng.choice(_MONTHS), "animal": rng.choice(_ANIMALS), "color": rng.choice(_COLORS),
            "population": f"{rng.randrange(2, 90)},{rng.randrange(100, 999)}", "mountain": _name(rng, used),
            "bridges": str(rng.randrange(2, 19)),
        }
        sentences = [f.format(**facts) for _, _, f in _FACTS]
        fillers = [rng.choice(_FILLER).format(**facts) for _ in range(num_filler)]
        body = sentences + fillers
        rng.shuffle(body)
        text = f"Document about the town of {town}.\n" + " ".join(body) + "\n\n"
        docs.append(Document(town, text, facts))
    return docs


def build_prompts(corpus: list[Document], num_prompts: int, docs_per_prompt: int = 4,
                  seed: int = 23) -> list[RagPrompt]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        docs = tuple(rng.sample(range(len(corpus)), docs_per_prompt))
        answer_doc = rng.choice(docs)
        _, question, _ = rng.choice(_FACTS)
        prompts.append(RagPrompt(docs, answer_doc, question.format(**corpus[answer_doc].facts)))
    return prompts


SYSTEM = "Answer the question using only the documents. Reply with a few words."


def messages(corpus: list[Document], prompt: RagPrompt) -> list[dict[str, Any]]:
    """Chat messages: the documents as one content part each, then the question."""
    parts = [{"type": "text", "text": corpus[i].text} for i in prompt.docs]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": parts},
        {"role": "user", "content": prompt.question},
    ]
