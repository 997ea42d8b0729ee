"""Texts that break naive tokenization and streaming: multi-byte UTF-8, combining marks, whitespace."""

from __future__ import annotations

SAMPLES = [
    "Hello world",
    " leading space, and a trailing one ",
    "The capital of France is Paris.",
    "🙂👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 🤗",
    "价格是 100 元，二〇二四年。日本語のテキストも。",
    "한국어 문장입니다",
    "e\u0301 a\u0308 combining: Z\u0324\u0354\u0367\u0311a\u0308\u0356\u032dl\u036e\u0312g\u0306\u0317o\u0319",
    "naïve café Ünïcödé ﾃｽﾄ",
    "עברית ו-العربية mixed with English",
    "    four spaces\t\ttabs\n\n\nnewlines\r\n  \u00a0nbsp  ",
    "def f(x: int) -> int:\n    return x**2  # ²³ ½\n\n\tpass\n",
    '{"key": [1, 2.5e-3, null], "nested": {"a": "b"}}',
    "a1b2c3 x 12345  678  42",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "\u200b zero width \ufeff and a literal \ufffd replacement character",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝐁𝐨𝐥𝐝 and 𓀀 hieroglyph",
]
