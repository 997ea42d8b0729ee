from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachet.models import find_default_gguf, write_tiny_model

# Strings that stress byte-level BPE: multi-byte UTF-8, ZWJ emoji sequences, CJK, code indentation,
# digits next to whitespace (where the digit pre-split matters), special-token markers in raw text.
TOKENIZER_SAMPLES = [
    "Hello world",
    "What is the capital of France?",
    "🙂👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵",
    "价格是 100 元，二〇二四年。日本語のテキストも。",
    "한국어 문장입니다",
    "def f(x: int) -> int:\n    return x**2  # ²³ ½\n\n\tpass",
    '{"key": [1, 2.5e-3, null], "nested": {"a": "b"}}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   ",
    "tabs\t\tand\n\n\nnewlines\r\n",
    "naïve café Ünïcödé",
    "ﾃｽﾄ half-width",
    "٣٤٥ arabic-indic digits",
    "a1b2c3 x 12345  678  42",
    "SELECT * FROM users WHERE id = 7;",
    "https://example.com/path?q=1&r=2#frag",
    "",
    " ",
    "\u200b zero width",
    "<repo_name>cachet<file_sep>main.py",
]


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Code paths without an explicit cache_dir (the catalog's tiny-llama) use the XDG cache; point it
    # into the test session so nothing lands in the real ~/.cache.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="session")
def tokenizer_samples() -> list[str]:
    return list(TOKENIZER_SAMPLES)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return find_default_gguf()


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A private cache keeps tests independent of whatever ~/.cache holds.
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_cache: Path) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_cache_dir=tokenizer_cache
    )
