"""Pydantic models of Anthropic's Messages API: the bodies the bridge accepts and the JSON it answers.

Kept apart from ``schemas.py`` (OpenAI's shapes): the same chat request, spelled
Anthropic's way. A request is checked here as Anthropic checks it (``max_tokens``
required, temperature in [0, 1], tool_use only from the assistant and tool_result
only from the user), so a bad one is refused before it is converted.

Fields are sorted three ways. Supported ones are converted (``cache_control``
breakpoints set the KV retention of the prefix up to them). Ones that change
nothing here (``metadata``, ``service_tier``...) are accepted and dropped. ``thinking`` and ``output_config.effort`` are the chat
template's reasoning controls (a template without them refuses them). Ones that
would change the answer but that Cachet cannot honour (server tools, ``container``,
``mcp_servers``, a final assistant turn to continue) are refused with a 400 naming
them, never dropped in silence. Fields this version of the API does
not know are kept in ``model_extra`` for the route to log, then ignored, as the
OpenAI routes ignore SDKs' newer fields.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator

from cachet.bridge.schemas import UINT32_MAX, ThinkingConfig, sampling_field

# Anthropic's and Cachet's tool-name rule (common.proto's Tool.name).
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- content blocks


class CacheControl(_Block):
    """A prompt-cache breakpoint. Cachet caches every prefix by itself; a breakpoint keeps the
    prefix up to it for ``ttl`` (default 5 minutes) in preference to other KV
    (``anthropic_convert.cache_breakpoints``)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64ImageSource(_Block):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLImageSource(_Block):
    type: Literal["url"]
    url: str = Field(min_length=1)


ImageSource = Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None

    def url(self) -> str:
        """The image as the URL the chat path takes: a data URL for inline bytes."""
        source = self.source
        if isinstance(source, Base64ImageSource):
            return f"data:{source.media_type};base64,{source.data}"
        return source.url


class ToolUseBlock(_Block):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ToolResultContent = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Block):
    """What a tool returned, answering the assistant's ``tool_use`` of the same id."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultContent] | None = None
    # Chat templates have no slot for it: the model reads the content alone (docs/anthropic_api.md).
    is_error: bool = False
    cache_control: CacheControl | None = None

    def list_content(self) -> list[TextBlock | ImageBlock]:
        return self.content if isinstance(self.content, list) else []


class ThinkingBlock(_Block):
    """Reasoning from an earlier assistant turn, as this API answered it; replayed to templates
    that render reasoning. Its signature is Cachet's empty one, so it is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]

_BLOCKS_BY_ROLE = {
    "user": frozenset({"text", "image", "tool_result"}),
    "assistant": frozenset({"text", "tool_use", "thinking"}),
}


class MessageParam(_Block):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        if isinstance(self.content, list):
            allowed = _BLOCKS_BY_ROLE[self.role]
            for block in self.content:
                if block.type not in allowed:
                    raise ValueError(
                        f"a {self.role} message cannot carry {block.type} blocks "
                        f"(only {', '.join(sorted(allowed))})"
                    )
        return self


# ---------------------------------------------------------------- tools


class ToolDefinition(_Block):
    """A custom (client) tool. Anthropic's server tools (web search, bash, text editor...) run
    on Anthropic's side and have no counterpart here."""

    # Server tools are named by a dated type ("web_search_20250305"); custom tools by none.
    type: str | None = None
    name: str = Field(pattern=TOOL_NAME)
    # Optional at Anthropic; some clients send null for none.
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool = False
    cache_control: CacheControl | None = None

    @field_validator("type")
    @classmethod
    def _custom_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(f"server tool {value!r} is not supported; only custom tools (type 'custom')")
        return value


class ToolChoiceAuto(_Block):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Block):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Block):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Block):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class JsonOutputFormat(_Block):
    type: Literal["json_schema"]
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    format: JsonOutputFormat | None = None
    # OpenAI's reasoning_effort under Anthropic's name: rendered by the chat template.
    effort: Literal["low", "medium", "high"] | None = None


# ---------------------------------------------------------------- request bodies

# Fields of Anthropic's API that would change the answer but that Cachet cannot honour.
_UNSUPPORTED = ("container", "mcp_servers", "context_management")
# Anthropic's limit on blocks carrying cache_control in one request (the top-level one included).
MAX_CACHE_BREAKPOINTS = 4


class MessagesInput(BaseModel):
    """What a prompt is made of: shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    # Unknown fields are kept (model_extra) so the route can log them before ignoring them.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    # The chat template's thinking switch, on or off (refused where the template has none).
    thinking: ThinkingConfig | None = None
    # Structured output: format (a JSON schema, enforced by constrained decoding).
    output_config: OutputConfig | None = None
    # Automatic caching: a breakpoint at the prompt's end (kept with the answer, for the next turn).
    cache_control: CacheControl | None = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by Cachet")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> MessagesInput:
        if self.messages[-1].role == "assistant":
            raise ValueError(
                "the last message must be the user's: continuing a final assistant turn "
                "(prefill) is not supported"
            )
        if isinstance(self.tool_choice, ToolChoiceTool):
            names = {tool.name for tool in self.tools or []}
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        breakpoints = sum(1 for _ in self.cache_controls())
        if breakpoints > MAX_CACHE_BREAKPOINTS:
            raise ValueError(
                f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {breakpoints}."
            )
        return self

    def cache_controls(self) -> Iterator[CacheControl]:
        """Every cache_control of the request, the top-level one included."""
        blocks: list[Any] = [*(self.tools or []), *(self.system if isinstance(self.system, list) else [])]
        for message in self.messages:
            if isinstance(message.content, list):
                blocks += message.content
                blocks += [
                    c for b in message.content if isinstance(b, ToolResultBlock) for c in b.list_content()
                ]
        if self.cache_control is not None:
            yield self.cache_control
        for block in blocks:
            if getattr(block, "cache_control", None) is not None:
                yield block.cache_control


class MessagesBody(MessagesInput):
    """The body of ``POST /v1/messages``."""

    # Required, as Anthropic requires it.
    max_tokens: int = sampling_field("max_tokens", default=..., wire_max=UINT32_MAX)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    # Anthropic's range, narrower than the platform's [0, 2].
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k", wire_max=UINT32_MAX)
    # Accepted and ignored: they change who is billed how, or where and how fast it runs, at
    # Anthropic, not the answer.
    metadata: dict[str, Any] | None = None
    service_tier: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


class CountTokensBody(MessagesInput):
    """The body of ``POST /v1/messages/count_tokens``: a prompt, nothing about sampling."""


# ---------------------------------------------------------------- responses


class TextBlockOut(_Answer):
    type: Literal["text"]
    text: str


class ThinkingBlockOut(_Answer):
    type: Literal["thinking"]
    thinking: str
    # Anthropic signs its thinking; Cachet has nothing to sign it with.
    signature: str


class ToolUseBlockOut(_Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    # The arguments object ({} when the model was cut short before it finished one).
    input: dict[str, Any]


ContentBlockOut = Annotated[TextBlockOut | ThinkingBlockOut | ToolUseBlockOut, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class UsageOut(_Answer):
    # Anthropic's split: input_tokens are the prompt tokens NOT read from cache;
    # prompt = input_tokens + cache_read_input_tokens + cache_creation_input_tokens.
    input_tokens: int
    # Prompt tokens whose KV came from the prefix cache (billed at the cached price).
    cache_read_input_tokens: int
    # Always 0: writing the cache costs nothing extra here; uncached input is input_tokens.
    cache_creation_input_tokens: int
    output_tokens: int


class MessageResponse(_Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlockOut]
    stop_reason: StopReason | None
    # Always null: the router does not say which stop sequence matched (docs/anthropic_api.md).
    stop_sequence: str | None
    usage: UsageOut


class CountTokensResponse(_Answer):
    input_tokens: int


class TextDelta(_Answer):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(_Answer):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(_Answer):
    type: Literal["input_json_delta"]
    partial_json: str


class MessageStartEvent(_Answer):
    type: Literal["message_start"]
    # Empty content, no stop reason, and zero usage: the counts come with message_delta.
    message: MessageResponse


class ContentBlockStartEvent(_Answer):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlockOut


class ContentBlockDeltaEvent(_Answer):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStopEvent(_Answer):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(_Answer):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaEvent(_Answer):
    type: Literal["message_delta"]
    delta: MessageDelta
    # Cumulative totals, as Anthropic's message_delta carries them.
    usage: UsageOut


class MessageStopEvent(_Answer):
    type: Literal["message_stop"]


class PingEvent(_Answer):
    type: Literal["ping"]


class AnthropicErrorDetail(_Answer):
    type: str
    message: str


class AnthropicErrorResponse(_Answer):
    """An error answer, and the ``error`` event that ends a stream that failed midway."""

    type: Literal["error"]
    error: AnthropicErrorDetail


MessageStreamEvent = Annotated[
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
    | AnthropicErrorResponse,
    Field(discriminator="type"),
]


class MessageStreamEventOut(RootModel[MessageStreamEvent]):
    """One SSE event of a streamed message: ``event: <type>`` then ``data: <this JSON>``."""
