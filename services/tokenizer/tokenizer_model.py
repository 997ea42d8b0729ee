"""One model's tokenizer and chat template, loaded from a local checkpoint directory.

Everything goes through transformers' ``AutoTokenizer`` with ``local_files_only``
(a tiktoken vocabulary, as Kimi ships, is rebuilt as the same kind of tokenizer:
``tiktoken_files``):
the same tokenizer.json, the same Jinja chat template (rendered by
transformers' own sandboxed renderer, so prompts equal what the model's authors
tested), never a download. Decoding never applies
``clean_up_tokenization_spaces``: that BERT-era heuristic rewrites text (" ." to
".") and would make a streamed decode differ from a full one.

Thread safety: the methods are called from worker threads concurrently. The
Rust tokenizer is shared read-only; transformers only mutates it when a call asks
for truncation or padding, which nothing here does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.incremental_detokenizer import IncrementalDetokenizer
from cachet.tokenizer.generic_tool_prompt import rewrite_for_generic_tools, template_supports_tools
from cachet.tokenizer.model_info import ModelInfo, read_model_info
from cachet.tokenizer.template_variables import NO_CONTROLS, ReasoningControls
from cachet.tokenizer.tiktoken_files import has_tiktoken_files, load_tiktoken_tokenizer

# Any non-empty list makes transformers pick a checkpoint's "tool_use" template
# when it ships several named ones.
_TOOLS_PROBE: list[dict[str, Any]] = [{"type": "function", "function": {"name": "probe"}}]


# Most cache breakpoints one render locates (Anthropic allows 4 per request).
MAX_PREFIX_COUNTS = 8


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered through the chat template, and its tokens."""

    prompt: str
    token_ids: list[int]
    # Leading tokens that render the tools and the first k messages, for each k asked.
    prefix_token_counts: list[int] = field(default_factory=list)
    # The prompt's images in token order, each expanded into its placeholder tokens in
    # ``token_ids`` (``image_placeholders``); ``prompt`` holds each placeholder once.
    images: list[common_pb2.ImageInput] = field(default_factory=list)


class TokenizerModel:
    """Encode, decode, count and chat-template for one model; immutable after ``load``."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, info: ModelInfo, *, sort_tool_keys: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self.info = info
        # Kimi's own tokenizer sorts every key of the tool definitions before rendering them; the
        # model was trained on that order, and it makes equal tools render to equal prefixes.
        self._sort_tool_keys = sort_tool_keys

    @classmethod
    def load(cls, model_id: str, path: Path) -> TokenizerModel:
        """Load the tokenizer files of ``path`` (config.json, tokenizer.json or tiktoken.model,
        tokenizer_config.json)."""
        tiktoken = has_tiktoken_files(Path(path))
        tokenizer: PreTrainedTokenizerBase
        if tiktoken:
            tokenizer = load_tiktoken_tokenizer(Path(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            # ExportTokenizer hands the router this Rust tokenizer: a slow one has none to hand.
            raise ValueError(
                f"{path}: {type(tokenizer).__name__} is not backed by the tokenizers library; "
                "Cachet needs a tokenizer.json (a fast tokenizer)"
            )
        source = _template_source(tokenizer, tools=_TOOLS_PROBE)
        supports_tools = source is not None and template_supports_tools(source)
        info = read_model_info(model_id, Path(path), tokenizer, template_supports_tools=supports_tools)
        return cls(tokenizer, info, sort_tool_keys=tiktoken)

    @property
    def model_id(self) -> str:
        return self.info.model_id

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        # One sequence of ids decodes to one str; transformers types the batch case's list too.
        return self._tokenizer.decode(  # type: ignore[return-value]
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def tokenizer_json(self) -> str:
        """The Rust tokenizer as loaded (special-token flags included): it decodes like ``decode``."""
        return self._tokenizer.backend_tokenizer.to_str()

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> None:
        """Raise ``InvalidArgument`` naming the first id outside the vocabulary."""
        vocab_size = self.info.vocab_size
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(
                    f"{field}[{index}]: token id {token_id} is not in the vocabulary of "
                    f"{self.model_id} (size {vocab_size})",
                    param=f"{field}[{index}]",
                )

    def detokenizer(
        self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> IncrementalDetokenizer:
        """A streaming decoder whose output joins up exactly with ``decode``."""

        def decode(token_ids: Sequence[int]) -> str:
            return self.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return IncrementalDetokenizer(decode, prompt_token_ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        reasoning: ReasoningControls = NO_CONTROLS,
        prefix_messages: Sequence[int] = (),
    ) -> RenderedChat:
        """Render template dicts (see ``chat_messages``) through the model's template, then tokenize.

        ``reasoning`` sets template variables; one the template does not read is refused.
        ``prefix_messages`` asks where cache breakpoints end: for each k, the leading tokens of
        this prompt that the tools and the first k messages render to (``_prefix_chars``)."""
        if add_generation_prompt and continue_final_message:
            raise InvalidArgument(
                "continue_final_message: cannot be combined with add_generation_prompt",
                param="continue_final_message",
            )
        if len(prefix_messages) > MAX_PREFIX_COUNTS or any(k > len(messages) for k in prefix_messages):
            raise InvalidArgument(
                f"prefix_message_counts: at most {MAX_PREFIX_COUNTS}, each at most the "
                f"{len(messages)} messages",
                param="prefix_message_counts",
            )
        if self._sort_tool_keys:
            tools = [_sorted_keys(tool) for tool in tools]
        source = _template_source(self._tokenizer, tools=tools or None)
        if source is None:
            raise InvalidArgument(f"model: {self.model_id} has no chat template; use Encode", param="model")
        variables = reasoning.variables_for(source, self.model_id)
        # Decided per call: a checkpoint with several named templates may use a
        # different one when no tools are offered.
        generic_tools = not template_supports_tools(source)

        # With tokenize=False the template renders a str; transformers' overloads cannot tell
        # through **flags, so the call is typed by what it returns here.
        apply_template = cast(Callable[..., str], self._tokenizer.apply_chat_template)

        def render(conversation: list[dict[str, Any]], **flags: bool) -> str:
            if generic_tools:
                return apply_template(
                    rewrite_for_generic_tools(conversation, tools), tokenize=False, **flags, **variables
                )
            return apply_template(conversation, tools=tools or None, tokenize=False, **flags, **variables)

        try:
            prompt = render(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        except jinja2.TemplateError as error:
            # Templates reject conversations they cannot render with raise_exception().
            raise InvalidArgument(
                f"messages: the chat template of {self.model_id} rejected the conversation: {error}",
                param="messages",
            ) from None
        except ValueError as error:
            # transformers' own checks, e.g. continue_final_message on a message the template hides.
            raise InvalidArgument(f"messages: {error}", param="messages") from None
        # The template wrote the special tokens itself (BOS, turn markers): adding
        # them again would double the BOS. transformers tokenizes the same way.
        if not prefix_messages:
            return RenderedChat(prompt=prompt, token_ids=self.encode(prompt, add_special_tokens=False))
        # The same encode, with each token's character span: where a prefix of the text ends.
        encoding = self._tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ends = [end for _, end in encoding["offset_mapping"]]
        counts = []
        for k in prefix_messages:
            chars = _prefix_chars(prompt, partial(render, messages[:k], add_generation_prompt=False))
            counts.append(_tokens_within(ends, chars))
        return RenderedChat(prompt=prompt, token_ids=list(encoding["input_ids"]), prefix_token_counts=counts)


def _prefix_chars(prompt: str, render_prefix: Callable[[], str]) -> int:
    """How many leading characters of ``prompt`` the template renders for a prefix of its
    conversation alone: the longest run both agree on (a template may render an earlier turn
    differently once later ones follow, e.g. dropping old reasoning)."""
    try:
        text = render_prefix()
    # A template may fail in any way on a conversation cut short (no user turn yet): the
    # breakpoint then covers nothing, and the request goes on.
    except Exception:  # noqa: BLE001 - see above
        return 0
    if prompt.startswith(text):
        return len(text)
    low, high = 0, min(len(text), len(prompt))
    while low < high:  # the longest common prefix, compared in C rather than char by char
        middle = (low + high + 1) // 2
        if prompt[:middle] == text[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _tokens_within(ends: list[int], chars: int) -> int:
    """Leading tokens whose characters all lie in the first ``chars``."""
    count = 0
    for end in ends:
        if end > chars:
            break
        count += 1
    return count


def _template_source(tokenizer: PreTrainedTokenizerBase, *, tools: list[dict[str, Any]] | None) -> str | None:
    """The template transformers would use for this call, or None when the checkpoint has none."""
    if not tokenizer.chat_template:
        return None
    try:
        return tokenizer.get_chat_template(None, tools)
    except ValueError:
        return None


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value
