"""Vetoes: rules that say two questions cannot be the same one, exact by construction.

Embeddings place "how do I turn on X" next to "how do I turn off X", and "北京到上海" next to
"上海到北京". A candidate is rejected, whatever its score, for a different negation, different
numbers, dates or units, an antonym swapped in (on/off, buy/sell, 开启/关闭, 买/卖), or the same
words in another order (entities or direction swapped: "USD to EUR" / "EUR to USD", "北京到上海" /
"上海到北京").

Text is tokenized once for both languages (`tokens`): Latin words and numbers as words, every Han
character as a token of its own (Chinese has no spaces, and a character is its smallest unit of
meaning), numbers written with Chinese numerals or a 万/千/亿 multiplier as one number ("5万" is
50000, "五十万" 500000), so the same rules read both languages.
"""

from __future__ import annotations

import itertools
import re


def _words(text: str) -> list[str]:
    return text.split()


_CN_DIGITS = "零〇一二两三四五六七八九"
_CN_DIGIT_VALUE = {c: float(v) for c, v in zip(_CN_DIGITS, (0, 0, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9), strict=True)}
_CN_UNITS = {"十": 10, "百": 100, "千": 1000, "万": 10_000, "亿": 100_000_000}
_TOKEN = re.compile(
    r"[0-9]+(?:[.,][0-9]+)*[万千亿]"  # 5万, 1.5亿: a number with a Chinese multiplier
    r"|[a-z0-9]+(?:[.,][0-9]+)*%?"
    r"|[零〇一二两三四五六七八九十百千万亿]{2,}|[零〇二两三四五六七八九十]"  # 五十万, 三; a lone 一 is "a"
    r"|[\u3400-\u9fff\uf900-\ufaff]|[$€£¥%°]")
STOPWORDS = frozenset(_words(
    """a an the is are was were be been being am do does did doing have has had having i me my we
our you your he she it its they them their this that these those what which who whom whose how why when where
of in on at by for with about as into through to from up down out over under again further then once here there
all any both each few more most other some such only own same so too very s t can will just should would could
may might must shall also if or and but because until while than vs versus get got one ones someone something
anyone anything way ways best good
的 了 吗 呢 吧 啊 呀 么 什 怎 样 如 何 哪 是 在 有 和 与 或 及 请 问 我 你 他 她 它 们 这 那 个 一 些 就 都 也 还 会 能
可 以 要 想 得 地 着 过 给 让 把 被 对 为 从 到 去 比"""))
NEGATIONS = frozenset(_words(
    "not no never none nobody nothing neither nor without cannot cant dont doesnt didnt isnt arent "
    "wasnt werent wont wouldnt shouldnt couldnt hasnt havent hadnt unable 不 没 未 别 勿 莫 非 无"))
NUMBER_WORDS = {w: str(i) for i, w in enumerate(_words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"))}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                     "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1e6", "billion": "1e9",
                     "first": "1", "second": "2", "third": "3", "half": "0.5", "dozen": "12"})
DATE_WORDS = frozenset(_words(
    "january february march april june july august september october november december jan feb "
    "mar apr jun jul aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday "
    "sunday today tomorrow yesterday tonight weekend morning evening night noon midnight spring "
    "summer autumn winter"))
UNIT_WORDS = frozenset(_words(
    "km kilometer kilometers kilometre kilometres mile miles meter meters metre metres cm mm inch "
    "inches foot feet ft yard yards kg kilogram kilograms gram grams lb lbs pound pounds ounce "
    "ounces oz ton tons tonne liter liters litre litres ml gallon gallons celsius fahrenheit "
    "kelvin degrees mph kph kmh hour hours minute minutes second seconds sec day days week "
    "weeks month months year years usd eur gbp jpy inr dollar dollars euro euros rupee rupees yen "
    "pound sterling bitcoin btc gb mb kb tb ghz mhz % $ € £ ¥ ° percent"))
ANTONYMS = [("on", "off"), ("up", "down"), ("open", "close"), ("enable", "disable"), ("increase", "decrease"),
            ("buy", "sell"), ("before", "after"), ("above", "below"), ("more", "less"), ("maximum", "minimum"),
            ("max", "min"), ("start", "stop"), ("import", "export"), ("upload", "download"), ("encrypt", "decrypt"),
            ("add", "remove"), ("install", "uninstall"), ("win", "lose"), ("best", "worst"), ("lock", "unlock"),
            ("connect", "disconnect"), ("hot", "cold"), ("high", "low"), ("fast", "slow"), ("cheap", "expensive"),
            ("positive", "negative"), ("true", "false"), ("male", "female"), ("men", "women"), ("boy", "girl"),
            ("legal", "illegal"), ("possible", "impossible"), ("like", "dislike"), ("love", "hate"),
            ("encode", "decode"), ("push", "pull"), ("send", "receive"), ("input", "output"), ("left", "right"),
            ("north", "south"), ("east", "west"), ("inside", "outside"), ("always", "never"), ("first", "last"),
            ("old", "new"), ("young", "old"), ("rich", "poor"), ("advantages", "disadvantages"), ("pros", "cons"),
            ("good", "bad"), ("better", "worse"), ("easy", "hard"), ("long", "short"), ("big", "small")]
_ANTONYM_OF: dict[str, set[str]] = {}
for _x, _y in ANTONYMS:
    _ANTONYM_OF.setdefault(_x, set()).add(_y)
    _ANTONYM_OF.setdefault(_y, set()).add(_x)
CONNECTORS = frozenset(_words(
    "to from than vs versus into onto against toward towards beats before after 到 至 往 去 比 换 转 兑"))
SYMMETRIC = frozenset(_words(
    "and or between vs versus with difference differences compare comparison same 和 与 或 跟 同 区 别"))
# Chinese antonyms, compared as substrings (a word may be one character or several). A pair counts
# only when each side holds its word and lacks the other's, so "多少" (many-few: how many) never
# fires on its own.
CN_ANTONYMS = [("开启", "关闭"), ("打开", "关闭"), ("开通", "关闭"), ("启用", "禁用"), ("开", "关"), ("上传", "下载"),
               ("登录", "退出"), ("安装", "卸载"), ("加密", "解密"), ("买", "卖"), ("涨", "跌"), ("增加", "减少"),
               ("提高", "降低"), ("升", "降"), ("多", "少"), ("大", "小"), ("高", "低"), ("长", "短"), ("男", "女"),
               ("前", "后"), ("左", "右"), ("进", "出"), ("入", "出"), ("加", "减"), ("贵", "便宜"), ("好", "坏"),
               ("快", "慢"), ("冷", "热"), ("胖", "瘦"), ("早", "晚"), ("新", "旧"), ("真", "假"), ("对", "错"),
               ("南", "北"), ("优点", "缺点"), ("好处", "坏处"), ("最好", "最差"), ("以前", "以后"), ("之前", "之后"),
               ("借", "还"), ("收", "发"), ("存", "取"), ("充值", "提现"), ("充值", "退款"), ("哥", "姐"), ("弟", "妹"),
               ("难", "简单"), ("难", "容易"), ("成功", "失败"), ("赢", "输"), ("支持", "反对"), ("喜欢", "讨厌"),
               # 上/下 as previous/next and first/second half; alone they are too common (上海, 一下).
               # On all 8,802 LCQMC pairs these veto 4 different questions (上一句/下一句 of a poem,
               # 八上/八下 textbook volumes) and no paraphrase.
               ("上一", "下一"), ("上册", "下册"), ("上学期", "下学期"), ("上半", "下半"), ("上午", "下午"),
               ("上周", "下周"), ("上个月", "下个月"), ("上旬", "下旬"), ("七上", "七下"), ("八上", "八下"),
               ("九上", "九下")]
# Chinese units, compared as substrings; ambiguous single characters (米 in 小米, 度 in 百度, 克 in
# 巧克力) are left out.
CN_UNIT_WORDS = ("公里", "英里", "千米", "厘米", "毫米", "公斤", "千克", "斤", "磅", "毫升", "摄氏", "华氏", "小时",
                 "分钟", "美元", "人民币", "欧元", "英镑", "日元", "港币", "韩元", "比特币", "英寸", "英尺", "平方米")
# Chinese negation characters, compared by count: "无线" (wireless) holds 无 on both sides, "不支持"
# adds a 不 on one.
CN_NEGATIONS = "不没未别勿莫非无"
NUM_LEXICAL = 8


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower().replace("'", "").replace("\u2019", ""))


def _cn_number(word: str) -> float | None:
    """Chinese numerals ("五十万", "两千", "十五") or digits with a multiplier ("5万") as a number."""
    if word[0].isdigit():
        try:
            return float(word[:-1].replace(",", "")) * _CN_UNITS[word[-1]]
        except (KeyError, ValueError):
            return None
    total = section = digit = 0.0
    for char in word:
        if char in _CN_DIGIT_VALUE:
            digit = _CN_DIGIT_VALUE[char]
        elif char in ("万", "亿"):
            total = (total + section + digit) * _CN_UNITS[char]
            section = digit = 0.0
        elif char in _CN_UNITS:
            section += (digit or 1.0) * _CN_UNITS[char]
            digit = 0.0
        else:
            return None
    return total + section + digit


# Numeral words that are not amounts: "万一" (in case), "千万" (by all means), "一一" (one by one).
_CN_NOT_NUMBERS = frozenset({"万一", "千万", "一一"})


def _is_cn_number(word: str) -> bool:
    """A lone 一 is the article ("一个"), a lone 百/千/万 starts a name ("百度"); both are skipped."""
    if word[0].isdigit():
        return word[-1] in _CN_UNITS
    if word in _CN_NOT_NUMBERS or (word[0] not in _CN_DIGIT_VALUE and word[0] not in _CN_UNITS):
        return False
    return len(word) >= 2 or word in "零〇二两三四五六七八九十"


def _numbers(words: list[str]) -> set[str]:
    found = set()
    for word in words:
        if _is_cn_number(word):
            value = _cn_number(word)
            if value is not None:
                found.add(repr(value))
        elif word in NUMBER_WORDS:  # "two" and "2" are the same number
            found.add(repr(float(NUMBER_WORDS[word])))
        elif word[0].isdigit():
            digits = re.sub(r"(st|nd|rd|th|s)$", "", word.rstrip("%")).replace(",", "")
            scale = 1000.0 if digits.endswith("k") else 1.0  # "15k" is 15000
            try:
                found.add(repr(float(digits.removesuffix("k")) * scale))
            except ValueError:
                found.add(word)
    return found


def _numbers_differ(ta: list[str], tb: list[str]) -> bool:
    """Different numbers, except that the word "one" facing no number at all is the pronoun
    ("how can one learn ..." / "how do I learn ..."), not a count."""
    na, nb = _numbers(ta), _numbers(tb)
    if na == nb:
        return False
    if not na and not _numbers([w for w in tb if w != "one"]):
        return False
    return bool(nb or _numbers([w for w in ta if w != "one"]))


def hard_negative(a: str, b: str) -> str | None:
    """Why `a` and `b` cannot be the same question, or None when no rule says so."""
    ta, tb = tokens(a), tokens(b)
    sa, sb = set(ta), set(tb)
    if bool(sa & NEGATIONS) != bool(sb & NEGATIONS) or _cn_negations(a) != _cn_negations(b):
        return "negation"
    if _numbers_differ(ta, tb):
        return "number"
    if sa & DATE_WORDS != sb & DATE_WORDS:
        return "date"
    if sa & UNIT_WORDS != sb & UNIT_WORDS or _cn_units(a) != _cn_units(b):
        return "unit"
    for word in sa - sb:
        if _ANTONYM_OF.get(word, set()) & (sb - sa):
            return "antonym"
    if _cn_antonym(a, b):
        return "antonym"
    if _directed_pairs(ta) & {(y, x) for x, y in _directed_pairs(tb)} or _swapped_around_pivot(ta, tb):
        return "order"
    return None


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _swapped_around_pivot(ta: list[str], tb: list[str]) -> bool:
    """Two content words that trade places across a word both texts share once: "what do men find
    attractive in women" / "what do women find attractive in men", "can dogs eat cat food" / "can
    cats eat dog food". The pivot is a content word ("find", "eat"), never a symmetric one ("and",
"or", "between", "with"), and adjacent words swapping ("online easily" / "easily online") is rephrasing."""
    sa, sb = [_stem(w) for w in ta[:64]], [_stem(w) for w in tb[:64]]
    once_a = {w: i for i, w in enumerate(sa) if sa.count(w) == 1}
    once_b = {w: i for i, w in enumerate(sb) if sb.count(w) == 1}
    shared = once_a.keys() & once_b.keys()
    content = [w for w in shared if w not in STOPWORDS and w not in NEGATIONS]
    pivots = [w for w in content if w not in SYMMETRIC]
    for x, y in itertools.combinations(content, 2):
        if (once_a[x] < once_a[y]) == (once_b[x] < once_b[y]):
            continue
        lo_a, hi_a = sorted((once_a[x], once_a[y]))
        lo_b, hi_b = sorted((once_b[x], once_b[y]))
        if any(lo_a < once_a[p] < hi_a and lo_b < once_b[p] < hi_b for p in pivots if p not in (x, y)):
            return True
    return False


def _directed_pairs(words: list[str]) -> set[tuple[str, str]]:
    """(x, y) for content words with a directional connector between them, x first: "USD to EUR"
    gives (usd, eur), so its reverse shows up in "EUR to USD"."""
    words = words[:64]
    pairs: set[tuple[str, str]] = set()
    for i, word in enumerate(words):
        if word not in CONNECTORS:
            continue
        before = [w for w in words[:i] if w not in STOPWORDS and w not in CONNECTORS]
        after = [w for w in words[i + 1:] if w not in STOPWORDS and w not in CONNECTORS]
        pairs.update((x, y) for x in before for y in after if x != y)
    return pairs




def _cn_negations(text: str) -> list[int]:
    return [text.count(c) for c in CN_NEGATIONS] if _HAN.search(text) else []


def _cn_units(text: str) -> set[str]:
    return {u for u in CN_UNIT_WORDS if u in text} if _HAN.search(text) else set()


def _cn_antonym(a: str, b: str) -> bool:
    if not _HAN.search(a) or not _HAN.search(b):
        return False
    return any((x in a and x not in b and y in b and y not in a) or (y in a and y not in b and x in b and x not in a)
               for x, y in CN_ANTONYMS)


_HAN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def variants(word: str) -> list[str]:
    """Forms `word` may take in the table: without a plural, -ing or -ed ending (crude English)."""
    if not word.isascii() or len(word) <= 3:
        return []
    out: list[str] = []
    for suffix, replacements in (("ies", ("y",)), ("es", ("", "e")), ("s", ("",)), ("ing", ("", "e")),
                                 ("ed", ("", "e"))):
        if word.endswith(suffix) and not word.endswith("ss") and len(word) - len(suffix) >= 3:
            out.extend(word[: len(word) - len(suffix)] + r for r in replacements)
    return out
