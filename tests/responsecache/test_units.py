"""The pure parts: keys, controls, replay, the verifier's vetoes."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from gateway.errors import InvalidField
from gateway.responsecache.controls import read_controls
from gateway.responsecache.keys import exact_key, is_trivial, last_user_text, partition_key
from gateway.responsecache.replay import assemble_stream, is_complete, replay_json, replay_sse
from gateway.responsecache.semantic.judge import hard_negative, threshold_for
from gateway.upstream.sse import SSESplitter, event_data

BODY = {"model": "m", "temperature": 0, "messages": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "What is the capital of France?"}]}


def test_exact_key_is_canonical_and_scoped() -> None:
    reordered = {"messages": BODY["messages"], "temperature": 0, "model": "m", "stream": True, "user": "u1"}
    assert exact_key("t", "default", BODY) == exact_key("t", "default", reordered)
    assert exact_key("t", "default", BODY) != exact_key("t2", "default", BODY)
    assert exact_key("t", "default", BODY) != exact_key("t", "other", BODY)
    for change in ({"temperature": 0.5}, {"seed": 1}, {"tools": [{"type": "function"}]}, {"response_format": {}},
                   {"tool_choice": "none"}, {"top_p": 0.5}, {"vendor_knob": 1}):
        assert exact_key("t", "default", BODY) != exact_key("t", "default", {**BODY, **change}), change
    assert len(exact_key("t", "default", BODY)) == 64


def test_partition_ignores_only_the_last_user_turn() -> None:
    other_question = {**BODY, "messages": [BODY["messages"][0], {"role": "user", "content": "Capital of Spain?"}]}
    assert partition_key("t", "n", BODY) == partition_key("t", "n", other_question)
    assert partition_key("t", "n", BODY) == partition_key("t", "n", {**BODY, "temperature": 0.9})
    other_system = {**BODY, "messages": [{"role": "system", "content": "be long"}, BODY["messages"][1]]}
    assert partition_key("t", "n", BODY) != partition_key("t", "n", other_system)
    assert partition_key("t", "n", BODY) != partition_key("t", "n", {**BODY, "tools": [{"type": "function"}]})
    assert partition_key("t", "n", BODY) != partition_key("t", "n", {**BODY, "model": "m2"})
    assert partition_key("t", "n", BODY) != partition_key("u", "n", BODY)


def test_last_user_text_and_trivial_turns() -> None:
    assert last_user_text(BODY) == "What is the capital of France?"
    assert last_user_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]}) == "a\nb"
    assert last_user_text({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) is None
    assert last_user_text({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}) is None
    for text in ("", "   ", "ok", "go on", "?!"):
        assert is_trivial(text, 3), text
    assert not is_trivial("how are you", 3)


def test_controls_from_headers_and_body() -> None:
    body = {"model": "m", "kvgate": {"cache": {"no_store": True, "namespace": "ns1", "ttl": 5, "semantic": False}}}
    controls = read_controls({}, body)
    assert "kvgate" not in body
    assert (controls.read, controls.write, controls.semantic, controls.namespace, controls.ttl_s) == (
        True, False, False, "ns1", 5.0)
    headers = {"cache-control": "no-cache, no-store", "x-kvgate-semantic": "off",
               "x-kvgate-cache-namespace": "ns2", "x-kvgate-cache-ttl": "60"}
    controls = read_controls(headers, {})
    assert (controls.read, controls.write, controls.semantic, controls.namespace, controls.ttl_s) == (
        False, False, False, "ns2", 60.0)
    for bad_headers, bad_body in (({"x-kvgate-cache-ttl": "-1"}, {}), ({"x-kvgate-cache-namespace": "a b"}, {}),
                                  ({}, {"kvgate": {"cache": {"nope": 1}}}), ({}, {"kvgate": 3})):
        with pytest.raises(InvalidField):
            read_controls(bad_headers, bad_body)


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_stream_assembly_and_replay_round_trip() -> None:
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hello"}), chunk({"content": " world"}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
              chunk({}, "tool_calls")]
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    completion = assemble_stream(chunks, usage)
    assert completion is not None and is_complete(completion)
    message = completion["choices"][0]["message"]
    assert message["content"] == "Hello world"
    function = {"name": "f", "arguments": "{\"a\":1}"}
    assert message["tool_calls"] == [{"id": "c1", "type": "function", "function": function}]

    replayed = replay_json(completion, "exact", None)
    assert replayed["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert replayed["usage"]["cache_read_input_tokens"] == 7 and replayed["usage"]["cache_creation_input_tokens"] == 0
    assert replayed["kvgate"] == {"cache": "exact", "cost": 0}

    splitter = SSESplitter()
    events = splitter.feed(b"".join(replay_sse(completion, "semantic", 0.91, include_usage=True)))
    datas = [event_data(e) for e in events]
    assert datas[-1] == b"[DONE]"
    payloads = [orjson.loads(d) for d in datas[:-1] if d is not None]
    again = assemble_stream(payloads, payloads[-1]["usage"])
    assert again is not None and again["choices"] == completion["choices"]
    assert payloads[-1]["kvgate"] == {"cache": "semantic", "cost": 0, "similarity": 0.91}


def test_incomplete_answers_are_not_complete() -> None:
    assert not is_complete({"choices": [{"finish_reason": "length"}]})
    assert not is_complete({"choices": []})
    assert not is_complete({"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]})


@pytest.mark.parametrize("a, b, reason", [
    ("How do I turn on dark mode in Windows?", "How do I turn off dark mode in Windows?", "antonym"),
    ("Is coffee bad for you?", "Is coffee not bad for you?", "negation"),
    ("How do I convert USD to EUR?", "How do I convert EUR to USD?", "order"),
    ("Flights from Paris to London", "Flights from London to Paris", "order"),
    ("What is 5 miles in km?", "What is 6 miles in km?", "number"),
    ("What happened in 1999?", "What happened in 2001?", "number"),
    ("Weather in Paris on Monday", "Weather in Paris on Tuesday", "date"),
    ("How far is 10 km?", "How far is 10 miles?", "unit"),
    ("Should I buy Tesla stock now?", "Should I sell Tesla stock now?", "antonym"),
])
def test_hard_negatives_are_vetoed(a: str, b: str, reason: str) -> None:
    assert hard_negative(a, b) == reason
    assert hard_negative(b, a) == reason


def test_paraphrases_are_not_vetoed() -> None:
    assert hard_negative("How do I reset my router password?", "How can I reset the password of my router?") is None
    assert hard_negative("What is the capital of France?", "What's the capital city of France?") is None
    assert hard_negative("How can you define life in 2 words?", "What is life in two words?") is None
    assert hard_negative("Best laptops within 30k?", "Which laptop is best within 30000?") is None
    assert hard_negative("How can one learn to code?", "How do I learn to code?") is None  # "one", the pronoun


def test_one_is_still_a_number_against_another_number() -> None:
    assert hard_negative("How many calories are in one egg?", "How many calories are in 2 eggs?") == "number"
    assert hard_negative("How do I lose 10 pounds?", "How do I lose weight?") == "number"


def test_threshold_from_curve() -> None:
    curve = [{"threshold": 0.5, "false_hit_rate": 0.05}, {"threshold": 0.7, "false_hit_rate": 0.01},
             {"threshold": 0.9, "false_hit_rate": 0.002}]
    assert threshold_for(curve, 0.01) == 0.7
    assert threshold_for(curve, 0.001) == 1.0


@pytest.mark.parametrize("a, b", [
    ("What do men find attractive in women?", "What do women find attractive in men?"),
    ("Can dogs eat cat food?", "Can cats eat dog food?"),
])
def test_entities_swapped_around_a_shared_word_are_vetoed(a: str, b: str) -> None:
    assert hard_negative(a, b) == "order"


@pytest.mark.parametrize("a, b", [
    ("How can I earn money online easily?", "How can I earn money easily online?"),
    ("What is the difference between PHP and Node.js?", "What is the difference between Node.js and PHP?"),
    ("Which is better: whey protein or mass gainer?", "Which is better: mass gainer or whey protein?"),
])
def test_reordering_that_keeps_the_question_is_not_vetoed(a: str, b: str) -> None:
    assert hard_negative(a, b) is None


def test_verifier_trees_match_their_export() -> None:
    """The shipped weights load, evaluate to probabilities, and pick a threshold from the curve."""
    from gateway.responsecache.semantic.judge import Verifier
    from gateway.responsecache.semantic.language import Language

    verifier = Verifier.load(0.01)
    assert set(verifier.thresholds) == {"en", "zh"}
    assert all(0.5 < t < 1.0 for t in verifier.thresholds.values())
    english, u = Language.ENGLISH, _unit(0)
    text = "how do i reset my router"
    features = verifier.features(u, u, text, text, 0, [1.0], english)
    assert 0.0 < verifier.probability(features, english) < 1.0
    lower = verifier.features(u, u, text, text, 0, [0.9], english)
    assert verifier.probability(lower, english) <= verifier.probability(features, english)  # monotonic in cosine


def _unit(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return vector / np.linalg.norm(vector)


def test_pair_head_is_symmetric_and_feeds_the_trees() -> None:
    """The shipped weights carry a pair head per language. It reads both embeddings, in either
    order alike, and the trees rise with its logit (monotonic): a head that sees two embeddings as
    a paraphrase can only raise the probability of the same candidate."""
    import json

    from gateway.responsecache.semantic.judge import WEIGHTS_PATH, PairHead, Verifier
    from gateway.responsecache.semantic.language import Language

    data = json.loads(WEIGHTS_PATH.read_text())
    assert set(data["heads"]) == {"en", "zh"}
    head = PairHead(data["heads"]["en"])
    u, v = _unit(1), _unit(2)
    assert head.logit(u, v) == pytest.approx(head.logit(v, u), abs=1e-5)
    verifier = Verifier.load(0.01)
    text, other = "how do i reset my router", "how can i reset my wifi router"
    features = verifier.features(u, v, text, other, 0, [0.9, 0.8], Language.ENGLISH)
    assert len(features) == len(verifier.features(u, v, text, other, 0, [0.9, 0.8], Language.CHINESE))
    assert features[-1] == pytest.approx(head.logit(u, v), abs=1e-5)
    sure, doubtful = features.copy(), features.copy()
    sure[-1], doubtful[-1] = 20.0, -20.0
    assert verifier.probability(sure, Language.ENGLISH) > verifier.probability(doubtful, Language.ENGLISH)


@pytest.mark.parametrize("a, b, reason", [
    ("怎么开启手机的蓝牙功能？", "怎么关闭手机的蓝牙功能？", "antonym"),
    ("现在适合买房吗？", "现在适合卖房吗？", "antonym"),
    ("这款手机支持无线充电吗？", "这款手机不支持无线充电吗？", "negation"),
    ("北京到上海的高铁要多长时间？", "上海到北京的高铁要多长时间？", "order"),
    ("猫为什么怕狗？", "狗为什么怕猫？", "order"),
    ("年薪5万要交多少个人所得税？", "年薪50万要交多少个人所得税？", "number"),
    ("五千块钱买什么手机好？", "一万块钱买什么手机好？", "number"),
    ("走5公里需要多长时间？", "走5英里需要多长时间？", "unit"),
    ("良药苦口利于病的下一句", "良药苦口利于病的上一句", "antonym"),
    ("八上英语配套练习册答案", "八下英语配套练习册答案", "antonym"),
])
def test_chinese_hard_negatives_are_vetoed(a: str, b: str, reason: str) -> None:
    assert hard_negative(a, b) == reason
    assert hard_negative(b, a) == reason


@pytest.mark.parametrize("a, b", [
    ("如何重置密码？", "重置密码流程？"),
    ("怎么做蛋糕？", "蛋糕怎么做？"),
    ("两个鸡蛋有多少卡路里？", "2个鸡蛋含有多少卡路里？"),
    ("百度网盘怎么用？", "怎么使用百度网盘？"),
    ("一个人怎么去北京？", "一个人如何去北京？"),
])
def test_chinese_paraphrases_are_not_vetoed(a: str, b: str) -> None:
    assert hard_negative(a, b) is None


def test_trivial_turns_count_han_characters() -> None:
    for text in ("好的", "继续", "谢谢"):
        assert is_trivial(text, 3), text
    for text in ("如何重置密码？", "重置密码流程？"):
        assert not is_trivial(text, 3), text


def test_language_of() -> None:
    from gateway.responsecache.semantic.language import Language, language_of

    assert language_of("How do I reset my password?") is Language.ENGLISH
    assert language_of("如何重置密码？") is language_of("iPhone 13怎么截屏") is Language.CHINESE
    for text in ("Comment réinitialiser mon mot de passe ?", "Wie setze ich mein Passwort zurück?",
                 "パスワードをリセットする方法", "비밀번호를 재설정하는 방법"):
        assert language_of(text) is None, text
    # Short English commands with no English function word read as English (issue 27) ...
    for text in ("Name three primary colors.", "List five fruits.", "Describe photosynthesis briefly.",
                 "Generate a haiku about autumn."):
        assert language_of(text) is Language.ENGLISH, text
    # ... and short commands in other Latin languages, ASCII or not, still do not.
    for text in ("Comment changer le mot de passe", "Nombra tres colores primarios.", "Elenca tre colori primari.",
                 "Noem drie primaire kleuren.", "Lista tres frutas.", "Resume este articulo.",
                 "Nomme trois couleurs primaires.", "Schreibe ein kurzes Gedicht."):
        assert language_of(text) is None, text
    # A question in another language that happens to hold an English function word ("a", "do",
    # "was", or the "a" that [A-Za-z] words would cut out of "ça") is not English: the English judge
    # would score it (0.009% of QQP's English questions read as other languages by this rule) ...
    for text in ("Qual é a capital do Brasil?", "Was ist die Hauptstadt von Frankreich?", "Bonjour, comment ça va?",
                 "Cuál es la capital de España y por qué?"):
        assert language_of(text) is None, text
    # ... while English that borrows their words stays English.
    for text in ("Was Hitler a great orator?", "Is non-woven bag making profitable?", "How do Pokémon die?",
                 "Should José Mourinho take over Manchester United?", "If 3x-y=9 and x+y=7, what is y?"):
        assert language_of(text) is Language.ENGLISH, text


def test_differing_parts_of_long_shared_contexts() -> None:
    from gateway.responsecache.semantic.match import differing_parts

    context = "The sky is blue and the grass is green. " * 10
    assert differing_parts(context + "What is the capital of France? Be brief.",
                           context + "How many legs does a spider have? Be brief.") == (
        "What is the capital of France?", "How many legs does a spider have?")
    assert differing_parts("What is the capital of France?", "What is the capital of Spain?") is None
    assert differing_parts(context, context + "And more.") == ("", "And more.")


def test_verifier_scores_each_language_with_its_own_trees(tmp_path) -> None:
    """A weights file may hold one model per language (what `semantic_train` writes): each
    question is scored by its own language's trees."""
    import json

    from gateway.responsecache.semantic.judge import WEIGHTS_PATH, Verifier
    from gateway.responsecache.semantic.language import Language

    data = json.loads(WEIGHTS_PATH.read_text())
    assert set(data["trees"]) == {"en", "zh"}, "the shipped weights hold one model per language"
    english = data["trees"]["en"]
    shifted = {**english, "baseline": english["baseline"] - 3.0}  # a much stricter Chinese model
    (tmp_path / "joint.json").write_text(json.dumps({**data, "trees": english}))  # one model for both
    (tmp_path / "split.json").write_text(json.dumps({**data, "trees": {"en": english, "zh": shifted}}))
    joint, split = Verifier.load(0.01, tmp_path / "joint.json"), Verifier.load(0.01, tmp_path / "split.json")
    u, text = _unit(0), "how do i reset my router"
    features = split.features(u, u, text, text, 0, [1.0], Language.ENGLISH)
    assert split.probability(features, Language.ENGLISH) == joint.probability(features, Language.ENGLISH)
    assert split.probability(features, Language.CHINESE) < joint.probability(features, Language.CHINESE)
