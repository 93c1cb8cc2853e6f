"""Request bodies of the OpenAI-compatible API (pydantic models; FastAPI validates against them
and publishes them in ``/openapi.json``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``type``, the ``param`` it is about, a message."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as the OpenAI API shapes it."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: these statuses with the error body."""
    what = {400: "Invalid request (the message names the field)", 401: "Missing or wrong API key",
            404: "Unknown model (or adapter)", 409: "The adapter is in use by running requests",
            503: "The engine is not running"}
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the reply must validate against."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(BaseModel):
    """The sampling fields completions and chat share (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's extra body field: StructuredOutputsParams' fields (json, regex, choice, grammar, json_object).
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extra body field for disaggregated prefill/decode (set by ``pagellm proxy``).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    # vLLM's extra field: each choice carries ``prompt_logprobs`` (token id -> logprob, rank, text).
    prompt_logprobs: int | None = None


ROLES = ("system", "developer", "user", "assistant", "tool")
# How message content reaches the chat template (vLLM's --chat-template-content-format): "string"
# joins the text parts with newlines (what most templates, SmolLM2's among them, expect), "openai"
# passes the list of parts as sent; "auto" is "string" (text parts are all pagellm accepts).
CONTENT_FORMATS = ("auto", "string", "openai")


class ContentPart(BaseModel):
    """An OpenAI content part: text (``{"type": "text", "text": "..."}``), or an image
    (``{"type": "image_url", "image_url": {"url": "data:..." | "https://..." | "file://..."}}``)
    for a model that takes images."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: handed to the template
    role: str
    content: str | list[ContentPart] | None = None


def normalize_message(m: ChatMessage, index: int, content_format: str = "auto") -> dict[str, Any]:
    """A message as the chat template gets it: role checked, ``developer`` (OpenAI's newer name for
    ``system``) renamed, content parts checked and, unless ``content_format`` is ``openai``, joined.
    An ``APIError`` (400) naming ``messages[i]...`` for anything else."""
    if m.role not in ROLES:
        raise APIError(f"messages[{index}].role must be one of {ROLES}, got {m.role!r}",
                       param=f"messages[{index}].role")
    out = m.model_dump(exclude_none=True)
    if m.role == "developer":
        out["role"] = "system"
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.type == "image_url" and part.image_url is not None:
                continue
            if part.type != "text" or part.text is None:
                raise APIError(f"messages[{index}].content[{j}]: only text and image_url parts are supported "
                               f"(type 'text' with a 'text' field), got type {part.type!r}",
                               param=f"messages[{index}].content[{j}]")
        if any(p.type == "image_url" for p in m.content):  # (chat_utils.extract_images formats it)
            out["content"] = [p.model_dump(exclude_none=True) for p in m.content]
        elif content_format == "openai":
            out["content"] = [{"type": "text", "text": p.text} for p in m.content]
        else:
            out["content"] = "\n".join(p.text or "" for p in m.content)
    return out


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # OpenAI's tools: [{"type": "function", "function": {"name", "description", "parameters"}}];
    # tool_choice "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    # (pagellm.entrypoints.tool_calls checks them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra field: variables for the chat template (``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's): one input or a batch, as text or token ids."""

    model_config = ConfigDict(extra="ignore")  # (``user`` and vLLM's extras are accepted, unused)
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


class ScoreRequest(BaseModel):
    """``POST /v1/score`` (vLLM's): one ``text_1`` against each ``text_2``, or two lists zipped."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    """``POST /rerank`` (vLLM's, Jina's and Cohere's): the documents ordered by relevance to the query."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # (None or 0: all)
    return_documents: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): a PEFT adapter directory served under ``lora_name``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``: refused (409) while requests of the adapter run."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
