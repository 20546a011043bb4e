"""Deterministic answers of the LLM simulator: a schema-valid instance derived from the text.

The same comment always yields the same answer, and the sentiment follows a
small English/Chinese lexicon, so tests can assert on labels.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_NEGATED = [
    "not good", "not great", "not happy", "not worth", "not recommend", "doesn't work",
    "does not work", "didn't work", "stopped working", "not working", "不好", "不满意",
    "不喜欢", "不推荐", "不值", "不能用",
]  # fmt: skip
_POSITIVE = [
    "great", "love", "excellent", "good", "perfect", "amazing", "happy", "recommend", "nice",
    "awesome", "satisfied", "works well", "fantastic", "beautiful", "worth it", "👍", "😍", "❤",
    "好", "喜欢", "满意", "不错", "推荐", "棒", "赞", "完美", "值得",
]  # fmt: skip
_NEGATIVE = [
    "bad", "broken", "broke", "terrible", "awful", "late", "slow", "poor", "disappointed",
    "refund", "worst", "crushed", "damaged", "rude", "expensive", "leak", "defect", "missing",
    "useless", "waste", "overpriced", "scratched", "👎", "😡",
    "差", "坏", "慢", "失望", "退货", "破", "垃圾", "贵", "难用", "问题", "漏", "瑕疵", "假货",
]  # fmt: skip
_TOPICS: dict[str, list[str]] = {
    "quality": ["quality", "broke", "material", "sturdy", "defect", "flimsy", "build", "质量",
                "做工", "材质", "瑕疵", "坏"],
    "delivery": ["deliver", "shipping", "shipped", "arrived", "late", "courier", "快递", "物流",
                 "发货", "送货", "到货"],
    "price": ["price", "expensive", "cheap", "worth", "value", "money", "overpriced", "价格",
              "贵", "便宜", "性价比", "值"],
    "service": ["service", "support", "seller", "refund", "rude", "客服", "服务", "退货", "售后",
                "商家"],
    "packaging": ["box", "package", "packaging", "packed", "crushed", "wrap", "包装", "盒子"],
    "usability": ["easy", "setup", "instructions", "manual", "app", "to use", "使用", "操作",
                  "好用", "难用", "方便"],
}  # fmt: skip
_CJK = re.compile(r"[\u4e00-\u9fff]")
_SENTENCE = re.compile(r"[^.!?。！？\n]+[.!?。！？]?")
# The text under analysis sits in a tag of the template's own naming (<comment>, <review>).
_COMMENT = re.compile(r"<([a-z][a-z_-]*)>(.*?)</\1>", re.S)


def comment_text(messages: list[dict[str, Any]]) -> str:
    """The text under analysis: inside the last tag pair (<comment>…</comment>, <review>…)
    of the last user message, else all of it."""
    user = [m for m in messages if m.get("role") == "user"]
    content = str(user[-1].get("content", "")) if user else ""
    found = _COMMENT.findall(content)
    return found[-1][1] if found else content


def _digest(text: str, salt: str = "") -> int:
    return int.from_bytes(hashlib.sha256((salt + "\0" + text).encode()).digest()[:8], "big")


def _hits(text: str, words: list[str]) -> int:
    return sum(text.count(w) for w in words)


def sentiment(text: str) -> str:
    low = text.lower()
    negated = _hits(low, _NEGATED)
    for phrase in _NEGATED:
        low = low.replace(phrase, " ")
    pos = _hits(low, _POSITIVE)
    neg = _hits(low, _NEGATIVE) + negated
    if pos and neg:
        return "mixed"
    if pos:
        return "positive"
    if neg:
        return "negative"
    return "neutral"


def topics(text: str) -> list[str]:
    low = text.lower()
    found = [t for t, words in _TOPICS.items() if any(w in low for w in words)]
    return found or ["other"]


def issues(text: str) -> list[dict[str, str]]:
    """One issue per topic with a negative sentence; evidence is that sentence, verbatim."""
    out: dict[str, str] = {}
    for match in _SENTENCE.finditer(text):
        sentence = match.group(0).strip()
        if not sentence or sentiment(sentence) not in {"negative", "mixed"}:
            continue
        category = topics(sentence)[0]
        out.setdefault(category, sentence[:500])
    return [{"category": c, "evidence": e} for c, e in out.items()]


def language(text: str) -> str:
    return "zh" if _CJK.search(text) else "en"


def analysis(text: str) -> dict[str, Any]:
    """The comment-analysis answer for `text`."""
    label = sentiment(text)
    found = topics(text)
    return {
        "sentiment": label,
        "confidence": round(0.6 + (_digest(text, "confidence") % 40) / 100, 2),
        "topics": found,
        "issues": issues(text) if label in {"negative", "mixed"} else [],
        "summary": f"{label} comment about {', '.join(found)}"[:200],
        "language": language(text),
    }


def padded(answer: dict[str, Any], chars: int) -> dict[str, Any]:
    """The answer with its first string field repeated to `chars` characters (a model
    that writes far more than asked; the schema must leave that field unbounded)."""
    for key, value in answer.items():
        if isinstance(value, str) and value:
            return {**answer, key: (value * (chars // len(value) + 1))[:chars]}
    return answer


def instance(schema: dict[str, Any], text: str) -> Any:
    """A valid instance of `schema`, chosen deterministically from `text`."""
    return _Gen(schema, text).make(schema, name="", path="")


def instance_at(root: dict[str, Any], schema: dict[str, Any], text: str) -> Any:
    """A valid instance of `schema`, a part of `root` (where its $refs point)."""
    return _Gen(root, text).make(schema, name="", path="")


class _Gen:
    def __init__(self, root: dict[str, Any], text: str) -> None:
        self.root = root
        self.text = text
        self.known = analysis(text)

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            ref = str(schema["$ref"])
            if not ref.startswith("#"):
                return {}
            node: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                node = node[part]
            schema = node
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                return self.resolve(schema[key][0])
        return schema

    def make(self, schema: dict[str, Any], name: str, path: str) -> Any:
        schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            choices = list(schema["enum"])
            hint = self.known.get(name)
            if hint in choices:
                return hint
            return choices[_digest(self.text, path) % len(choices)]
        kind = schema.get("type", "object" if "properties" in schema else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object":
            props = schema.get("properties", {})
            return {k: self.make(v, k, f"{path}.{k}") for k, v in props.items()}
        if kind == "array":
            return self.array(schema, name, path)
        if kind == "string":
            return self.string(schema, name, path)
        if kind in ("number", "integer"):
            return self.number(schema, name, path, kind)
        if kind == "boolean":
            return bool(_digest(self.text, path) % 2)
        return None

    def array(self, schema: dict[str, Any], name: str, path: str) -> list[Any]:
        items = self.resolve(schema.get("items", {}))
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", 10))
        if name == "issues" and items.get("type") == "object":
            values: list[Any] = []
            for issue in self.known["issues"]:
                entry = self.make(items, "", f"{path}[]")
                if isinstance(entry, dict):
                    entry.update({k: v for k, v in issue.items() if k in entry})
                values.append(entry)
        elif name == "topics" or "enum" in items:
            allowed = items.get("enum")
            values = [t for t in self.known["topics"] if allowed is None or t in allowed]
            if not values and allowed:
                values = [allowed[_digest(self.text, path) % len(allowed)]]
        else:
            values = [self.make(items, name, f"{path}[]")] if lo > 0 else []
        while len(values) < lo:
            values.append(self.make(items, name, f"{path}[{len(values)}]"))
        return values[:hi]

    def string(self, schema: dict[str, Any], name: str, path: str) -> str:
        hint = self.known.get(name)
        value = hint if isinstance(hint, str) else (self.text.strip()[:80] or "n/a")
        lo = int(schema.get("minLength", 0))
        hi = int(schema.get("maxLength", 10_000))
        value = value[:hi]
        if len(value) < lo:
            value = value + "x" * (lo - len(value))
        return value

    def number(self, schema: dict[str, Any], name: str, path: str, kind: str) -> float | int:
        lo = float(schema.get("minimum", 0))
        hi = float(schema.get("maximum", max(lo, 1.0 if kind == "number" else 100.0)))
        hint = self.known.get(name)
        frac = (_digest(self.text, path) % 1000) / 1000
        value = (
            float(hint)
            if isinstance(hint, int | float) and lo <= hint <= hi
            else lo + (hi - lo) * frac
        )
        if kind == "integer":
            return round(value)
        return round(value, 3)
