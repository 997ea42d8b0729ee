"""Pydantic models of OpenAI's Responses API: the body of ``POST /v1/responses`` and what it answers.

Kept apart from ``schemas.py`` (chat completions): the same chat request, spelled
as Responses items. Fields are sorted as the Anthropic API's are
(``anthropic_schemas``): supported ones are converted; ones that change nothing
here (``metadata``, ``service_tier``, ``user``...) are accepted and kept or
dropped; ``reasoning.effort`` is the chat template's reasoning control (refused by
a template that does not read it); ones that would change the answer but that Cachet cannot honour
(``background``, ``conversation``, hosted tools, ``truncation: auto``...) are refused with a 400 naming them; fields this version
of the API does not know are kept in ``model_extra`` for the route to log, then
ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cachet.bridge.schemas import UINT32_MAX, PromptCacheRetention, ReasoningEffort, sampling_field

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- input items


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class OutputText(_Item):
    """An assistant's text from an earlier turn (as this API answered it)."""

    type: Literal["output_text"]
    text: str


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Item):
    type: Literal["input_image"]
    # A data: or https URL; uploaded files (file_id) are not kept by Cachet.
    image_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _url_only(self) -> InputImage:
        if self.file_id is not None:
            raise ValueError("input_image.file_id is not supported: send the image as image_url")
        if self.image_url is None:
            raise ValueError("input_image needs image_url")
        return self


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]

_PARTS_BY_ROLE = {
    "user": frozenset({"input_text", "input_image"}),
    "system": frozenset({"input_text"}),
    "developer": frozenset({"input_text"}),
    "assistant": frozenset({"output_text", "refusal"}),
}


class MessageItem(_Item):
    # The type may be left out of a message (EasyInputMessage).
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @model_validator(mode="after")
    def _parts_fit_the_role(self) -> MessageItem:
        if isinstance(self.content, list):
            allowed = _PARTS_BY_ROLE[self.role]
            for part in self.content:
                if part.type not in allowed:
                    raise ValueError(
                        f"a {self.role} message cannot carry {part.type} parts "
                        f"(only {', '.join(sorted(allowed))})"
                    )
        return self


class FunctionCallItem(_Item):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    """What a function returned, answering the call of the same ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    """Reasoning from an earlier turn, replayed to templates that render it. Its
    ``encrypted_content`` is OpenAI's and means nothing here: it is refused."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("encrypted reasoning is not supported: send the reasoning text as content")
        return value

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


def _as_items(value: Any) -> Any:
    """Input as a list of items: a string is one user message, and a message item may omit
    its "type" (EasyInputMessage), which the discriminator needs."""
    if isinstance(value, str):
        if not value:
            raise ValueError("input must not be empty")
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if isinstance(value, list):
        return [
            {**item, "type": "message"} if isinstance(item, dict) and "type" not in item else item
            for item in value
        ]
    return value


# ---------------------------------------------------------------- tools and formats


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # The Responses API's default is strict.
    strict: bool | None = True


class NamedFunctionChoice(_Item):
    type: Literal["function"]
    name: str = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class TextFormatText(_Item):
    type: Literal["text"]


class TextFormatJsonObject(_Item):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Item):
    type: Literal["json_schema"]
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Item):
    format: TextFormat | None = None
    # Only the default: a verbosity control would change the answer.
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(_Item):
    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _no_summaries(self) -> ReasoningConfig:
        if self.summary not in (None, "auto") or self.generate_summary not in (None, "auto"):
            raise ValueError("reasoning summaries are not supported (the reasoning comes as it is)")
        return self


# ---------------------------------------------------------------- the request body

# Fields of OpenAI's API that would change the answer but that Cachet cannot honour.
_UNSUPPORTED = (
    "background",
    "conversation",
    "prompt",
    "max_tool_calls",
    "top_logprobs",
    "context_management",
    "moderation",
)
# What `include` may ask for: the only item Cachet could add is absent either way (no
# encrypted reasoning exists here), so it is accepted; the others would add data it lacks.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


class ResponsesBody(BaseModel):
    """The body of ``POST /v1/responses``."""

    # Unknown fields are kept (model_extra) so the route can log them before ignoring them.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    # A string is taken as one user message (_as_items).
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = sampling_field("max_tokens", wire_max=UINT32_MAX)
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # OpenAI's routing key for prefix-cache hits: Cachet's session id (x-session-affinity wins).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    # How long the prompt's cached prefix is kept, as on chat completions.
    prompt_cache_retention: PromptCacheRetention | None = None
    # Accepted; metadata is kept with the response and answered back.
    metadata: dict[str, str] | None = None
    # Accepted and ignored: they say who asks or how it is billed at OpenAI, not what is answered.
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Any = None
    stream_options: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    moderation: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _message_type(cls, value: Any) -> Any:
        return _as_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        # Hosted tools (web search, file search, MCP, computer use...) run at OpenAI, not here.
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported; only function tools")
        return value

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        # `is`, not `in`: 0 equals False, and max_tool_calls: 0 would change the answer.
        if value is not None and value is not False:
            raise ValueError("not supported by Cachet")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in _INCLUDABLE:
                raise ValueError(f"include {name!r} is not supported")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesBody:
        if isinstance(self.tool_choice, NamedFunctionChoice):
            names = {tool.name for tool in self.tools or []}
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        return self


# ---------------------------------------------------------------- responses


class OutputTextOut(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningTextOut(_Answer):
    type: Literal["reasoning_text"]
    text: str


class MessageOut(_Answer):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputTextOut]


class FunctionCallOut(_Answer):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningOut(_Answer):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningTextOut]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItemOut = Annotated[MessageOut | FunctionCallOut | ReasoningOut, Field(discriminator="type")]


class InputTokensDetails(_Answer):
    # Prompt tokens whose KV came from the prefix cache (billed at the cached price).
    cached_tokens: int


class OutputTokensDetails(_Answer):
    reasoning_tokens: int


class ResponseUsageOut(_Answer):
    # OpenAI's meaning: input_tokens includes the cached ones.
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Answer):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: Any
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItemOut]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsageOut | None
    metadata: dict[str, str]
    user: str | None


class DeletedResponse(_Answer):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(_Answer):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseStreamEventOut(_Answer):
    """One SSE event of a streamed response: ``event: <type>`` then ``data: <this JSON>``; which
    other fields it carries depends on the type (docs/responses_api.md lists them)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
