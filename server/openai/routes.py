"""OpenAI-compatible generation routes: `POST /v1/completions` and `POST /v1/chat/completions`.

Each route only translates: validate (pydantic), tokenize (worker thread), build `SamplingParams`,
start a `GenerationRun`, and let `server.generation.serve` answer as JSON or SSE. Defaults follow OpenAI:
completions `max_tokens` 16, chat `max_tokens` up to the context that is left.
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api.ids import new_id
from server.errors import APIError
from server.generation.formatter import Formatter
from server.generation.reasoning import opens_thinking, speaks_think, template_kwargs
from server.generation.run import GenerationRun
from server.generation.sampling import COMPLETION_DEFAULT_MAX_TOKENS, sampling_params, token_rules, truncated
from server.generation.serve import serve
from server.generation.sse import STREAMED_200
from server.generation.telemetry import Telemetry
from server.generation.tools import call_grammar, format_for, generic_messages, template_tools
from server.openai.chat import ChatFormatter, ToolSetup
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerContext

router = APIRouter()


@router.post("/v1/completions", responses=STREAMED_200)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(len(body.prompt), body.n)
    prompts = [truncated(await ctx.tokens.prompt_ids(p), body) for p in body.prompt]
    prefixes = None
    if body.echo:
        prefixes = [p if isinstance(p, str) else await ctx.tokens.decode(p) for p in body.prompt]
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    engine.check_fits([len(p) for p in prompts], max_tokens, body.n)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                             prompt_logprobs=body.prompt_logprobs_k(), **await token_rules(ctx, body))
    run = GenerationRun(engine, new_id("cmpl"), prompts, params, metrics=ctx.metrics)
    fmt = Formatter(run, model=ctx.model_name, token_str=ctx.tokens.token_str, n=body.n,
                    want_logprobs=body.logprobs is not None, include_usage=body.include_usage(),
                    prefixes=prefixes, vllm_prompt_logprobs=body.prompt_logprobs,
                    include_stop_str=body.include_stop_str_in_output)
    fmt.telemetry = telemetry(body, prompts)
    fmt.verbose_prompt = await ctx.tokens.decode(prompts[0]) if body.verbose and not body.stream else None
    return await serve(request, ctx, run, fmt, stream=body.stream)


@router.post("/v1/chat/completions", responses=STREAMED_200)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(1, body.n)
    prompt, mode, fmt = await _chat_prompt(ctx, body)
    max_tokens = body.max_new_tokens()
    if max_tokens is None:
        max_tokens = engine.max_tokens_left(len(prompt), body.n)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    guided = None
    if mode in ("required", "named") or (mode == "auto" and body.guided() is None):
        guided = call_grammar(body.tools, body.tool_name(), parallel=body.parallel_tool_calls,
                              triggered=mode == "auto", fmt=fmt)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, guided=guided,
                             **await token_rules(ctx, body))
    reasoning = speaks_think(getattr(ctx.tokens.tok, "chat_template", None))
    starts = reasoning and opens_thinking(await ctx.tokens.decode(prompt[-16:]))
    setup = ToolSetup(fmt, tuple(body.tools), body.parallel_tool_calls, mode in ("required", "named")) \
        if mode != "none" else False
    run = GenerationRun(engine, new_id("chatcmpl"), [prompt], params, metrics=ctx.metrics)
    out = ChatFormatter(run, model=ctx.model_name, token_str=ctx.tokens.token_str, n=body.n,
                        want_logprobs=body.logprobs, include_usage=body.include_usage(), tools=setup,
                        parallel_tool_calls=body.parallel_tool_calls, reasoning=reasoning, reasoning_starts=starts,
                        include_stop_str=body.include_stop_str_in_output)
    out.telemetry = telemetry(body, [prompt])
    out.verbose_prompt = await ctx.tokens.decode(prompt) if body.verbose and not body.stream else None
    return await serve(request, ctx, run, out, stream=body.stream)


@router.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatCompletionRequest, request: Request) -> dict:
    """How many prompt tokens this chat request would take (llama.cpp's route; OpenAI's Responses and Anthropic
    count the same way): its messages and tools rendered as `/v1/chat/completions` renders them; nothing runs."""
    ctx = ServerContext.of(request)
    ctx.require_engine()
    prompt, _, _ = await _chat_prompt(ctx, body)
    return {"object": "response.input_tokens", "input_tokens": len(prompt)}


def telemetry(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]]) -> Telemetry | None:
    """llama.cpp's timings/progress for a request that asked; one prompt and one choice only (a 400 otherwise:
    llama-server's requests have one, and per-choice telemetry has no shape)."""
    if body.verbose and body.stream:
        raise APIError(400, "verbose (llama.cpp's __verbose) is served on JSON answers, not streams; drop it or "
                       "stream without it", param="verbose")
    if not body.wants_telemetry():
        return None
    if len(prompts) > 1 or body.n > 1:
        field = "timings_per_token" if body.timings_per_token else "return_progress"
        raise APIError(400, f"{field} is served for one prompt and n=1 (got {len(prompts)} prompts, n={body.n})",
                       param=field)
    return Telemetry(len(prompts[0]), per_token=body.timings_per_token)


async def _chat_prompt(ctx: ServerContext, body: ChatCompletionRequest):
    """The prompt ids of a chat request (its template, tools and reasoning options applied; truncated as it
    asks), with its tool mode and the template's tool format."""
    template = getattr(ctx.tokens.tok, "chat_template", None)
    mode = body.tool_mode()
    fmt = format_for(template)
    kwargs = template_kwargs(template, body.chat_template_kwargs, body.reasoning_effort, body.thinking)
    if mode == "auto" and not fmt.renders_tools and body.guided() is not None:
        raise APIError(400, "this model's chat template cannot render tools, so tool_choice 'auto' answers in "
                       "a constrained JSON (a call or a reply), which a response format/guided decoding would "
                       "contradict; send one of them", param="tools")
    if mode != "none" and not fmt.renders_tools:
        dicts = generic_messages([m.as_template_dict() for m in body.messages], body.tools,
                                 forced=mode != "auto")
        prompt = await ctx.tokens.encode_chat(dicts, add_generation_prompt=body.add_generation_prompt,
                                              template_kwargs=kwargs)
    else:
        tools = template_tools(body.tools) if mode != "none" else None
        prompt = await ctx.tokens.prompt_ids(None, body.messages, tools=tools, template_kwargs=kwargs,
                                             add_generation_prompt=body.add_generation_prompt)
    return truncated(prompt, body), mode, fmt
