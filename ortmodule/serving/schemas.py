"""The wire schemas: SGLang's and vLLM's score requests and OpenAI's completions and chat requests.

Types are strict: `"5"`, `5.0` or `true` is not a token id, `"0"` or `true` not a temperature,
`"yes"` not a boolean. Text holds no lone surrogate (it could be neither tokenized nor written
back). Counts and ranges that only the server's settings decide (items, stop lengths, sizes) are
checked by the routes; the ranges OpenAI's API fixes are checked here, so that every bad value is
a 400 naming its field. Fields OpenAI defines that this server does not carry out are refused
unless neutral; fields it does not know are ignored on the OpenAI routes (clients send extras) and
refused on `/v1/score` (SGLang's API is small and a typo there changes no output silently).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr


def _no_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_no_surrogates)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**63)]
# torch.Generator takes seeds in [-2**63, 2**64).
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32

class ScoreRequest(BaseModel):
    """SGLang's `/v1/score` (as of SGLang 0.5.23): the probability of each label token after query + item
    (or item + query); `label_token_ids` one list for every item or a list per item; `temperature` over
    the labels' softmax; `return_token_logprobs`. Its fields for embedding overrides, pooled hidden
    states and setwise readouts are taken at their neutral values only (score_routes.NEUTRAL)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    query: Text | list[TokenId]
    items: Text | list[Text] | list[list[TokenId]]
    label_token_ids: list[TokenId] | list[list[TokenId]]
    apply_softmax: StrictBool = False
    temperature: StrictFloat | StrictInt = 1.0
    return_token_logprobs: StrictBool = False
    item_first: StrictBool = False
    model: Text | None = None
    return_pooled_hidden_states: StrictBool = False
    embed_override_token_id: StrictInt | None = None
    query_embed_overrides: list[Any] | None = None
    item_embed_overrides: list[Any] | None = None
    score_extraction_token: Text | None = None


class GenerativeScoringRequest(BaseModel):
    """vLLM's `/generative_scoring`: the probability of the first label token after query + item (or
    item + query), the query and each item tokenized apart (the query with the tokenizer's special tokens
    unless `add_special_tokens` is false, the items without). vLLM's scheduling fields (`priority`,
    `cache_salt`, `request_id`) change no score and are taken; fields it does not know are ignored, as
    vLLM ignores them."""

    model_config = ConfigDict(strict=True, extra="ignore")

    query: Text | list[TokenId]
    items: list[Text] | list[list[TokenId]]
    label_token_ids: list[TokenId]
    apply_softmax: StrictBool = True
    item_first: StrictBool = False
    add_special_tokens: StrictBool = True
    model: Text | None = None
    cache_salt: Text | None = None
    priority: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] = 0
    request_id: Text | None = None


class _Options(BaseModel):
    """What completions and chat completions share. Fields it does not know are kept aside
    (`model_extra`): those of vLLM and SGLang that would change the output are refused unless
    neutral (openai_routes.UNSUPPORTED_EXTRAS), the rest ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Text | None = None  # vLLM's: left out, the served model (lm-eval's gguf backend sends none)
    max_tokens: StrictInt | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    logit_bias: dict[str, Any] | None = None
    user: Text | None = None
    # vLLM's and SGLang's sampling extras, carried out as transformers' processors (jobs.Row).
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0, le=100, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    no_stop_trim: StrictBool = False  # SGLang's name of include_stop_str_in_output
    skip_special_tokens: StrictBool = True
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: the only tokens the output may hold
    bad_words: list[Text] | None = None  # vLLM's: words the output never completes
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None  # vLLM's: the prompt's last k tokens
    logprob_token_ids: list[TokenId] | None = None  # vLLM's: the alternatives each generated token's logprobs give
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: log-probabilities' tokens written `token_id:N`
    request_id: Text | None = None  # vLLM's: the answer's id after its prefix, where no X-Request-Id header names one


class CompletionRequest(_Options):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    # vLLM's: each prompt token's log-probability, rank and alternatives
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    return_token_ids: StrictBool | None = None  # vLLM's: the prompt's and each choice's token ids
    add_special_tokens: StrictBool = True  # vLLM's: false tokenizes a text prompt without BOS and the like
    best_of: StrictInt | None = None
    suffix: Text | None = None


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    url: Text
    detail: Text | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Text
    text: Text | None = None
    image_url: ImageURL | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text
    arguments: Text  # JSON text, as OpenAI writes a call's arguments


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's `tool_calls` entry)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: Text | None = None
    type: Text = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message's: the call it answers
    name: Text | None = None
    reasoning_content: Text | None = None  # an assistant's earlier reasoning (SGLang's and DeepSeek's name)
    reasoning: Text | None = None  # the same, by vLLM's name


class ChatRequest(_Options):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None  # vLLM's, as on completions
    return_token_ids: StrictBool | None = None  # vLLM's, as on completions
    add_special_tokens: StrictBool = False  # vLLM's default for messages; true is refused (the template places them)
    # OpenAI's tool calling (serving/tools.py); its older `functions` form refused unless neutral.
    tools: list[Any] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Text | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's and SGLang's: what the chat template renders.
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Text | None = None  # vLLM's: the request's own template, if the server trusts it
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: image processor options, if the server takes them
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    echo: StrictBool = False  # vLLM's: the answer's content begins with the last message's, where its role is the same
    reasoning_effort: Text | None = None  # OpenAI's, as vLLM renders it (serving/chat_prompts.py)
    documents: list[dict[str, Any]] | None = None  # vLLM's: the template's documents
    include_reasoning: StrictBool = True  # vLLM's: false leaves the reasoning out (serving/reasoning.py)
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = None  # vLLM's (serving/reasoning.py)


class ResponsePart(BaseModel):
    """A part of a Responses input message's content: `input_text` / `output_text` (`text`), `input_image`
    (`image_url`, a URL or a data URL; a `file_id` is refused: this server keeps no files)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Text
    text: Text | None = None
    image_url: Text | None = None
    file_id: Text | None = None
    detail: Text | None = None


class ResponseItem(BaseModel):
    """An item of a Responses `input` list: a message (`type` "message" or left out), its `content` text or
    parts; a `function_call` the model made (`call_id`, `name`, `arguments`) and its `function_call_output`
    (`call_id`, `output` a text or text parts). Other items (reasoning, a reference to a stored item) are
    refused."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Text | None = None
    role: Text | None = None
    content: Text | list[ResponsePart] | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Text | list[ResponsePart] | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's `POST /v1/responses`, served statelessly (as vLLM serves it without its store): `input`
    (a text: one user message; or message items), `instructions` (a system message first),
    `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` with `include` naming
    "message.output_text.logprobs", `stream`, `metadata` (echoed). What needs stored state, tools or
    constrained output is refused unless neutral (responses_routes.py); other fields are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Text | None = None  # vLLM's: left out, the served model (lm-eval's gguf backend sends none)
    input: Text | list[ResponseItem]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    include: list[Text] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    parallel_tool_calls: StrictBool | None = None
    # refused unless neutral: stored state, tools, constrained or reasoning output, a truncated prompt
    previous_response_id: Text | None = None
    conversation: Any = None
    prompt: Any = None
    background: StrictBool | None = None
    tools: list[Any] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Text | None = None


class AnthropicBlock(BaseModel):
    """A content block of Anthropic's Messages API: `text` (`text`), `image` (`source`: `{"type": "base64",
    "media_type", "data"}` or `{"type": "url", "url"}`), `tool_use` (an assistant's call: `id`, `name`, `input`),
    `tool_result` (the user's answer to one: `tool_use_id`, `content` a text or text blocks, `is_error`); others
    (documents, thinking) are refused by messages_routes.py."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Text
    text: Text | None = None
    source: dict[str, Any] | None = None
    id: Text | None = None
    name: Text | None = None
    input: dict[str, Any] | None = None
    tool_use_id: Text | None = None
    content: Text | list[AnthropicBlock] | None = None
    is_error: StrictBool | None = None
    thinking: Text | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Text
    content: Text | list[AnthropicBlock]


class MessagesRequest(BaseModel):
    """Anthropic's `POST /v1/messages` (as vLLM serves it): `messages`, `system`, `max_tokens` (required, as
    Anthropic's API has it), `temperature`, `top_p`, `top_k` (which Anthropic's newer SDKs send in `extra_body`),
    `stop_sequences`, `stream`, `metadata`, `output_config.format`, `tools` and `tool_choice`; extended thinking and
    an effort refused unless neutral (messages_routes.py); other fields ignored. `count_tokens` takes the same without
    `max_tokens`."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Text | None = None
    messages: list[AnthropicMessage]
    system: Text | list[AnthropicBlock] | None = None
    max_tokens: StrictInt | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema): structured output


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered as `/v1/chat/completions` renders them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: StrictBool = False
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Text | None = None
    tools: list[Any] | None = None


class EmbeddingRequest(BaseModel):
    """OpenAI's `POST /v1/embeddings` with vLLM's fields: `input` (a text, texts, token ids or lists of them)
    or vLLM's chat form, `messages` rendered as `/v1/chat/completions` renders them (without the
    assistant's turn unless `add_generation_prompt`). Each input's embedding is the final norm's output at
    its last token, L2-normalized unless `normalize` is false (vLLM's pooling of a decoder model). vLLM's
    scheduling fields (`priority`, `request_id`) change no number and are taken; unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Text = "float"
    dimensions: StrictInt | None = None
    user: Text | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for input, false for messages (vLLM's)
    normalize: StrictBool | None = None
    embed_dtype: Text = "float32"
    endianness: Text = "native"
    priority: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] = 0
    request_id: Text | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    tokens: list[TokenId]


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` of `/generate` (as of SGLang 0.5.23), with its defaults; of its constrained
    decoding `regex`, `json_schema`, `ebnf` and `structural_tag` are carried out (serving/constraints.py),
    `custom_params` refused unless neutral (generate_routes.py); a field it does not know is a 400, as SGLang's
    `SamplingParams(**...)`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: Annotated[StrictInt, Field(ge=0)] = 128
    # past float32's largest the logits would be divided by infinity: 0 where they were finite, NaN where a grammar,
    # min_new_tokens or a token mask had set -inf (a 500 from sampling, before this bound)
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0, le=FLOAT32_MAX, allow_inf_nan=False)] = 1.0
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    min_p: Annotated[StrictFloat | StrictInt, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    presence_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[StrictFloat | StrictInt, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0
    min_new_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1)] = 1
    sampling_seed: Seed | None = None
    logit_bias: dict[str, Any] | None = None
    stream_interval: StrictInt | None = None
    regex: Text | None = None
    json_schema: Text | None = None
    ebnf: Text | None = None
    structural_tag: Text | None = None
    custom_params: dict[str, Any] | None = None
    stop_regex: Any = None
    beam_width: Any = None
    watermark: Any = None
    ebnf_full_assistant: Any = False


class GenerateRequest(BaseModel):
    """SGLang's native `POST /generate` (as of SGLang 0.5.23): `text` or `input_ids`, one prompt or a
    batch; `sampling_params`; the log-probabilities of the output (`return_logprob`, `top_logprobs_num`)
    and of the prompt from `logprob_start_len`. Its fields for media, embeddings, LoRA, sessions,
    hidden states and disaggregation are taken at their neutral values only (generate_routes.NEUTRAL)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: Text | list[Text] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: Annotated[StrictInt, Field(ge=-1)] | list[Annotated[StrictInt, Field(ge=-1)]] | None = None
    top_logprobs_num: Annotated[StrictInt, Field(ge=0)] | list[Annotated[StrictInt, Field(ge=0)]] | None = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    rid: Text | list[Text] | None = None
    # scheduling, routing, caching and bookkeeping, without effect on the output here
    log_metrics: StrictBool = True
    priority: StrictInt | None = None
    data_parallel_rank: StrictInt | None = None
    routed_dp_rank: StrictInt | None = None
    disagg_prefill_dp_rank: StrictInt | None = None
    session_id: Text | None = None
    routing_key: Text | None = None
    conversation_id: Text | None = None
    kv_hints: Any = None
    no_logs: StrictBool = False
    custom_labels: dict[str, Any] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: StrictFloat | StrictInt | None = None
    http_worker_ipc: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    # taken at their neutral values only
    input_embeds: list[Any] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    token_ids_logprob: list[Any] | None = None
    return_hidden_states: Any = False
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: dict[str, Any] | None = None
    modalities: list[Any] | None = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    watermark: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    lora_id: Any = None
    positional_embed_overrides: Any = None
    background: Any = False
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    return_bytes: Any = False
    return_entropy: Any = False
    return_prompt_token_ids: Any = False
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    cache_salt: Any = None  # a prefix-cache namespace: refused, this server's prefix cache has one
    extra_key: Any = None
