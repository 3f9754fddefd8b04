"""300 validation questions per language (QQP's and LCQMC's dev files, the validation split
`bench.semantic_train.split` holds out; never LCQMC's test split), each stored through the real
gateway and then asked again in every trivial form: letter case, full width, whitespace anywhere
(spaces between Chinese characters, around punctuation, runs, tabs, line breaks, at the ends),
punctuation dropped, added or changed inside and at the end. Every form is a semantic hit on its own
question's answer, served as a trivial variant (`semantic/variants.py`), without the judge.

Skipped where the evaluation data is not at `../shared/data` (the data's README: read it there,
never copy it into the project)."""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.responsecache.keys import is_trivial
from gateway.responsecache.semantic.language import Language, language_of
from gateway.responsecache.semantic.variants import QUESTION_CHARS, normalized_question
from gateway.responsecache.settings import ResponseCacheSettings
from tests.conftest import Gateway
from tests.responsecache.conftest import MODEL, Client, cache_gateway

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
FILES = {Language.ENGLISH: DATA / "qqp" / "dev.jsonl.gz", Language.CHINESE: DATA / "lcqmc" / "dev.jsonl.gz"}
NUM_QUESTIONS = 300
pytestmark = pytest.mark.skipif(not all(p.is_file() for p in FILES.values()), reason=f"no evaluation data at {DATA}")

_SENTENCE_MARKS = re.compile(r"(?<!\d)[,.;:!?](?!\d)|[，。；：！？、“”《》]")
_SPACED_WORD = re.compile(r"[A-Za-z0-9]")


def validation_questions(language: Language) -> list[str]:
    """NUM_QUESTIONS questions of `language` from the validation split, each its own question (no two
    share a normalized form), in a seeded order."""
    from bench.semantic_eval import Pair
    from bench.semantic_train import split

    with gzip.open(FILES[language], "rt", encoding="utf-8") as lines:
        pairs = [Pair(str(row["a"]), str(row["b"]), int(row["label"])) for row in map(json.loads, lines)]
    texts = sorted({t for p in split(pairs)[2] for t in (p.a, p.b)})
    random.Random(53).shuffle(texts)
    minimum = ResponseCacheSettings().min_query_words
    chosen: dict[str, str] = {}
    for text in texts:
        form = normalized_question(text)
        if language_of(text) is not language or is_trivial(text, minimum) or len(text) > QUESTION_CHARS \
                or form in chosen:
            continue
        chosen[form] = text
        if len(chosen) == NUM_QUESTIONS:
            break
    return list(chosen.values())


def _full_width(text: str) -> str:
    return "".join("\u3000" if c == " " else chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


def _inside_a_word(text: str, i: int) -> bool:
    """Whether position `i` (between characters i - 1 and i) is inside a Latin word or a number,
    an apostrophe between letters and a stop or comma between digits counting as part of it: a
    space or a mark there would make other words."""
    def word(j: int) -> bool:
        if not 0 <= j < len(text):
            return False
        if _SPACED_WORD.match(text[j]):
            return True
        around = text[j - 1:j + 2] if j > 0 else ""
        apostrophe = text[j] in "'\u2019" and around[0].isalpha() and around[2].isalpha()
        separator = text[j] in ",." and around[0].isdigit() and around[2].isdigit()
        return len(around) == 3 and (apostrophe or separator)
    return word(i - 1) and word(i)


def _spaced_everywhere(text: str) -> str:
    """A space between every two characters, except inside a Latin word or number."""
    return "".join(c if i == 0 or _inside_a_word(text, i) else " " + c for i, c in enumerate(text))


def _inner_mark_added(text: str, language: Language) -> str:
    if language is Language.CHINESE:
        at = next((i for i in range(2, len(text) - 1) if not _inside_a_word(text, i)), 1)
        return text[:at] + "，" + text[at:]
    first, _, rest = text.partition(" ")
    return f"{first}, {rest}" if rest else text


def _inner_marks_dropped(text: str) -> str:
    """Sentence marks inside the text dropped (a space left where they joined two Latin words)."""
    def drop(m: re.Match[str]) -> str:
        joined = m.start() > 0 and m.end() < len(text) and _SPACED_WORD.match(text[m.start() - 1]) \
            and _SPACED_WORD.match(text[m.end()])
        return " " if joined else ""

    end = _end(text)
    return _SENTENCE_MARKS.sub(drop, end) + text[len(end):]


def _end(text: str) -> str:
    return text.rstrip("?？.。!！ ")


FORMS: dict[str, Callable[[str, Language], str]] = {
    "lower case": lambda t, _: t.lower(),
    "upper case": lambda t, _: t.upper(),
    "no end punctuation": lambda t, _: _end(t),
    "other end punctuation": lambda t, _: _end(t) + " ?!",
    "full-width end mark": lambda t, _: _end(t) + "？",
    "full width": lambda t, _: _full_width(t),
    "whitespace runs, tabs, line breaks, ends": lambda t, _: "\n  " + "\t  ".join(t.split()) + " \n",
    "spaces everywhere": lambda t, _: _spaced_everywhere(t),
    "space before the end mark": lambda t, _: _end(t) + " ?",
    "inner marks dropped": lambda t, _: _inner_marks_dropped(t),
    "inner mark added": _inner_mark_added,
    "inner mark added, end dropped": lambda t, lang: _end(_inner_mark_added(t, lang)),
    "lower case, full width, no end": lambda t, _: _full_width(_end(t).lower()),
}


def forms(text: str, language: Language) -> Iterator[tuple[str, str]]:
    """Every trivial form of `text` that differs from it (an identical one is the exact cache's)."""
    seen = {text}
    for name, form in FORMS.items():
        variant = form(text, language)
        if variant not in seen:
            seen.add(variant)
            yield name, variant


@pytest.mark.parametrize("language", [Language.ENGLISH, Language.CHINESE])
def test_every_trivial_form_of_a_question_is_normalized_alike(language: Language) -> None:
    for text in validation_questions(language):
        for name, variant in forms(text, language):
            assert normalized_question(variant) == normalized_question(text), (name, text, variant)


@pytest.fixture(scope="module")
def gw(fake_upstream: str, tmp_path_factory: pytest.TempPathFactory, embedding_model: object) -> Iterator[Gateway]:
    """SQLite only: a variant is a dict read in memory, the same on either database (test_variants.py
    runs both)."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('forms') / 'kvgate.db'}"
    with cache_gateway(fake_upstream, url) as gateway:
        yield gateway


def _ask(http: httpx.Client, gateway: Gateway, text: str, namespace: str) -> httpx.Response:
    reply = http.post(gateway.v1 + "/chat/completions",
                      json={"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": text}]},
                      headers={"authorization": f"Bearer {gateway.api_key}", "x-kvgate-cache-namespace": namespace,
                               "cache-control": "no-store"})
    reply.raise_for_status()
    return reply


@pytest.mark.parametrize("language", [Language.ENGLISH, Language.CHINESE])
def test_300_validation_questions_hit_in_every_trivial_form(gw: Gateway, language: Language) -> None:
    questions = validation_questions(language)
    assert len(questions) == NUM_QUESTIONS
    namespace = f"variant-forms-{language}"
    client = Client(gw)
    before = client.entries()
    answers: dict[str, str] = {}
    with httpx.Client(timeout=30) as http:
        for text in questions:
            stored = http.post(gw.v1 + "/chat/completions",
                               json={"model": MODEL, "temperature": 0,
                                     "messages": [{"role": "user", "content": text}]},
                               # A bar no judge reaches: each is stored, none served another's answer.
                               headers={"authorization": f"Bearer {gw.api_key}",
                                        "x-kvgate-cache-namespace": namespace,
                                        "x-kvgate-semantic-threshold": "1.0"})
            assert stored.headers["x-kvgate-cache"] == "miss", text
            answers[text] = stored.json()["choices"][0]["message"]["content"]
        client.wait_entries(before + NUM_QUESTIONS, timeout_s=60)
        failed = []
        num_asked = 0
        for text in questions:
            for name, variant in forms(text, language):
                reply = _ask(http, gw, variant, namespace)
                num_asked += 1
                served = reply.json()["choices"][0]["message"]["content"]
                if reply.headers["x-kvgate-cache"] != "hit-semantic" \
                        or reply.headers.get("x-kvgate-semantic-stage") != "variant" or served != answers[text]:
                    failed.append((name, text, variant, dict(reply.headers)))
    assert not failed, f"{len(failed)} of {num_asked} forms missed; first: {failed[:3]}"
    assert num_asked >= NUM_QUESTIONS * 6
