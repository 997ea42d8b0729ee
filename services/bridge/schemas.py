"""Pydantic models of the REST bodies the bridge accepts and the JSON it answers.

Request models validate what OpenAI (and Workers AI) validate, so a bad request
is refused here with the field named, before it costs a gRPC hop; sampling values are bounded
by the ranges the router validates with (``cachet.sampling_ranges``, through
``sampling_field``), not by a copy of them. A field of OpenAI's that would change the answer
but that Cachet cannot honour is refused naming it; one that changes nothing here (``store``,
``metadata``...) is accepted, and a field OpenAI does not have either (another vendor's) is
ignored with a log line. Response models exist so that ``/openapi.json`` describes what the
converters really produce; they forbid extra fields so the tests that validate converter output
against them fail when the two drift apart.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from cachet.sampling_ranges import MAX_CHOICES, SAMPLING_RANGES

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# A prompt's token id: the proto's uint32, so one outside it is a 400 here rather than a failed conversion
# (ids past the model's vocabulary are the engine's to refuse, naming their place).
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]


def sampling_field(name: str, *, default: Any = None, wire_max: int | None = None) -> Any:
    """A sampling value's field, bounded by its range in ``SAMPLING_RANGES``; ``wire_max``: its
    proto type's largest value, for a range with no upper end. ``default=...``: required."""
    allowed = SAMPLING_RANGES[name]
    return Field(
        default=default, gt=allowed.gt, ge=allowed.ge, le=allowed.le if allowed.le is not None else wire_max
    )


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- chat messages


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    # OpenAI sends arguments as JSON text; it is passed on unparsed.
    arguments: str = ""


class ToolCall(_Body):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None is legal for an assistant turn that only called tools.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Reasoning from an earlier turn, given back to templates that render it.
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required unless an assistant message carries tool_calls")
        return self


# ---------------------------------------------------------------- tools and formats


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Body):
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool = False


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Body):
    """Cachet extension: output matching a regular expression."""

    type: Literal["regex"]
    regex: str = Field(min_length=1)


class EbnfFormat(_Body):
    """Cachet extension: output derived from a GBNF grammar."""

    type: Literal["ebnf"]
    ebnf: str = Field(min_length=1)


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | EbnfFormat, Field(discriminator="type")
]


class StreamOptions(_Body):
    include_usage: bool = False


class ThinkingConfig(_Body):
    """Anthropic's ``thinking`` (Moonshot and Zhipu take it on chat completions too): the
    template's thinking switch on or off. The budget is accepted, as Anthropic requires it
    with ``enabled``, but not enforced beyond ``max_tokens``, which bounds the whole answer."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    @property
    def on(self) -> bool:
        return self.type != "disabled"


# vLLM's chat_template_kwargs, as typed template variables: scalars only (Strict, so true stays a
# bool and 1 an int rather than one turning into the other).
TemplateValue = StrictBool | StrictInt | StrictFloat | StrictStr
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# Fields of OpenAI's API that would change the answer but that Cachet cannot honour: a 400
# naming the field, never a silent answer to another question.
UNSUPPORTED_CHAT_FIELDS = (
    "audio",
    "functions",
    "function_call",
    "logit_bias",
    "prediction",
    "web_search_options",
)
# Fields of OpenAI's API that change nothing here (who is billed how, what OpenAI keeps): accepted
# without a word. Any other field Cachet does not know is a vendor's, ignored with a log line.
QUIET_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier"})
# OpenAI's prompt_cache_retention: how long the prompt's cached prefix is kept in preference to
# other KV (docs/ARCHITECTURE.md, "KV retention"): "in_memory" 10 minutes, "24h" a day; and
# Cachet's "none" (OpenAI has no opt-out): nothing kept, not even the router's session default.
PromptCacheRetention = Literal["in_memory", "24h", "none"]


# ---------------------------------------------------------------- request bodies


class _SamplingBody(_Body):
    """Sampling fields shared by chat and text completions (OpenAI ranges, plus vLLM's extras)."""

    # Fields no model here knows are kept (model_extra) so the route can log them, then ignored.
    model_config = ConfigDict(extra="allow")

    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k", wire_max=UINT32_MAX)
    min_p: float | None = sampling_field("min_p")
    repetition_penalty: float | None = sampling_field("repetition_penalty")
    # vLLM's extension: generate past end-of-sequence (benchmarks, fixed-length tests).
    ignore_eos: bool = False
    presence_penalty: float | None = sampling_field("presence_penalty")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    stop: str | list[str] | None = None
    # Choices sharing one prompt (its KV computed once, on one replica).
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: only requests with the same salt (and account) share cached prefixes.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's routing key for prefix-cache hits: the same session key as x-session-affinity,
    # which wins when a request carries both.
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    # Unset: the router's default for a request with a session key, else none.
    prompt_cache_retention: PromptCacheRetention | None = None


class ChatCompletionBody(_SamplingBody):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = sampling_field("max_tokens", wire_max=UINT32_MAX)
    # OpenAI's newer name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = sampling_field("max_tokens", wire_max=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("top_logprobs")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Reasoning controls, rendered by the model's chat template (refused when it reads none).
    reasoning_effort: ReasoningEffort | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    # Accepted only at its default: another verbosity would change the answer.
    verbosity: Literal["medium"] | None = None
    # Accepted only as text: Cachet answers in text.
    modalities: list[Literal["text"]] | None = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator(*UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by Cachet")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
                )
        return self


class CompletionBody(_SamplingBody):
    model: str = Field(min_length=1)
    # Text, a one-element list of texts, or token ids; one prompt per request.
    prompt: str | list[str] | list[TokenId] = Field(min_length=1)
    # OpenAI's legacy default for /v1/completions.
    max_tokens: int | None = sampling_field("max_tokens", default=16, wire_max=UINT32_MAX)
    # The legacy API's logprobs is a count of alternatives (0-5), not a flag.
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None
    logit_bias: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by Cachet")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionBody:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        return self


class WorkersAITool(_Body):
    """Workers AI accepts tools flat (name, description, parameters) or OpenAI-style."""

    type: Literal["function"] | None = None
    function: FunctionDefinition | None = None
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> WorkersAITool:
        if (self.function is None) == (self.name is None):
            raise ValueError("a tool needs either function or name")
        return self

    def definition(self) -> FunctionDefinition:
        if self.function is not None:
            return self.function
        return FunctionDefinition(
            name=self.name or "", description=self.description, parameters=self.parameters
        )


class WorkersAIRunBody(_Body):
    """One ``/ai/run/{model}`` request: ``messages`` (chat) or ``prompt`` (one user turn, or raw text)."""

    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = Field(default=None, min_length=1)
    # With raw, prompt goes to the model untemplated (a text completion).
    raw: bool = False
    stream: bool = False
    # Workers AI's documented default for text generation.
    max_tokens: int = sampling_field("max_tokens", default=256, wire_max=UINT32_MAX)
    # Workers AI's documented ranges, wider than the platform's: the router refuses a temperature
    # past 2 or a top_p past 1 with its own 400 naming the field.
    temperature: float | None = Field(default=None, ge=0, le=5)
    top_p: float | None = Field(default=None, gt=0, le=2)
    top_k: int | None = sampling_field("top_k", wire_max=UINT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    # Workers AI's own ceiling, inside the platform's (> 0).
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    presence_penalty: float | None = sampling_field("presence_penalty")
    stop: str | list[str] | None = None
    tools: list[WorkersAITool] | None = None
    # OpenAI's shapes: "none" / "auto" / "required" or {"type": "function", "function": {"name": ...}}.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # A vision model's picture, in Workers AI's shape: the image file's bytes as integers 0-255,
    # or as base64 text (a data: URL too). It joins the last user turn, after its text.
    image: list[Annotated[int, Field(ge=0, le=255)]] | str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> WorkersAIRunBody:
        _check_messages_or_prompt(self)
        return self

    @model_validator(mode="after")
    def _image_joins_a_user_turn(self) -> WorkersAIRunBody:
        if self.image is None:
            return self
        if self.raw:
            raise ValueError("image needs a templated prompt or messages, not raw")
        if self.messages is not None and not any(m.role == "user" for m in self.messages):
            raise ValueError("image joins the last user message, and messages has none")
        return self

    @model_validator(mode="after")
    def _tools_apply(self) -> WorkersAIRunBody:
        if self.raw and (self.tools or self.tool_choice is not None):
            raise ValueError("tools and tool_choice need a templated prompt or messages, not raw")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.definition().name for tool in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
                )
        return self


def _check_messages_or_prompt(body: WorkersAIRunBody) -> None:
    if (body.messages is None) == (body.prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    if body.raw and body.prompt is None:
        raise ValueError("raw applies to prompt, not to messages")


class WorkersAIBody(WorkersAIRunBody):
    """The body of ``/ai/run/{model}``: a run, or with ``?queueRequest=true`` a batch or a poll."""

    # Batch to queue (queueRequest=true).
    requests: list[WorkersAIRunBody] | None = Field(default=None, min_length=1)
    # Batch to poll (queueRequest=true).
    request_id: str | None = Field(default=None, min_length=1)
    # Where to announce the batch's end; the account default when absent.
    webhook_url: str | None = None
    # Workers AI accepts the flag in the body as well as in the query string.
    queue_request: bool = Field(default=False, alias="queueRequest")

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> WorkersAIBody:
        # A batch or a poll carries its runs in requests (each checked on its own), not at the top.
        if self.requests is None and self.request_id is None:
            _check_messages_or_prompt(self)
        return self


# ---------------------------------------------------------------- responses


class PromptTokensDetails(_Answer):
    cached_tokens: int


class UsageInfo(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobInfo(_Answer):
    # The proto carries token ids, not texts; tokens are rendered "token_id:<id>" (vLLM's convention).
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(_Answer):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobInfo]


class ChoiceLogprobs(_Answer):
    content: list[TokenLogprobInfo]


class FunctionCallOut(_Answer):
    name: str
    arguments: str


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


FinishReasonOut = Literal["stop", "length", "tool_calls", "abort", "error"]


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReasonOut | None


class ChatCompletionResponse(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionCallDelta(_Answer):
    name: str | None = None
    arguments: str


class ToolCallDeltaOut(_Answer):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReasonOut | None


class ChatCompletionChunkResponse(_Answer):
    """One SSE event of a streamed chat completion (``data: <this JSON>``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    # Present (null until the last event) only with stream_options.include_usage.
    usage: UsageInfo | None = None


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None


class TextChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonOut | None


class TextCompletionResponse(_Answer):
    """A text completion, and (without usage until the last) each SSE event of a streamed one."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageInfo | None = None


class ModelInfo(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # Cachet extension: longest prompt plus completion.
    context_window: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelInfo]


class WorkersAIToolCall(_Answer):
    name: str
    # A whole answer's call carries its arguments as an object (Workers AI's shape; the text as
    # written only when it is not one, e.g. cut short). A stream's carry text fragments, which
    # join by index: the first of a call has its name and "", the rest name "".
    arguments: dict[str, Any] | str
    index: int | None = None


class WorkersAIResult(_Answer):
    response: str
    tool_calls: list[WorkersAIToolCall] | None = None
    usage: UsageInfo


class WorkersAIQueuedResult(_Answer):
    request_id: str
    status: Literal["unspecified", "queued", "running", "done", "cancelled", "cancelling"]
    model: str | None = None
    # Per request, in order, once the batch has finished.
    responses: list[WorkersAIBatchItem] | None = None


class WorkersAIBatchItem(_Answer):
    id: int
    success: bool
    result: WorkersAIResult | None = None
    errors: list[WorkersAIMessage]


class WorkersAIMessage(_Answer):
    code: int
    message: str


class WorkersAIResponse(_Answer):
    result: WorkersAIResult | WorkersAIQueuedResult
    success: Literal[True]
    errors: list[WorkersAIMessage]
    messages: list[WorkersAIMessage]


class WorkersAIStreamEvent(_Answer):
    """One SSE event of a streamed ``/ai/run`` (``data: <this JSON>``); usage on the last."""

    response: str
    tool_calls: list[WorkersAIToolCall] | None = None
    usage: UsageInfo | None = None


class UsageRowOut(_Answer):
    account_id: str | None
    model: str | None
    day: str | None
    session_id: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Exact integers in pico-USD (1e-12 USD), and the same as a decimal string in USD.
    cost_picousd: int
    cost_usd: str
    cache_savings_picousd: int


class UsageReport(_Answer):
    object: Literal["list"]
    data: list[UsageRowOut]


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Answer):
    error: ErrorDetail


class HealthResponse(_Answer):
    status: Literal["ok"]


WorkersAIQueuedResult.model_rebuild()
