"""What every API surface shares (openai/, responses/, anthropic/, sequences/, ... import it, never each other).

- run: `GenerationRun`, one HTTP generation as engine requests
- driver: the one run driver (start, collect a whole answer, stream, finish; a client that leaves);
  serve: a run answered in OpenAI's shapes through a `Formatter` (formatter: completion shapes);
  output: one choice accumulated (what Responses and Messages build on)
- sse: server-sent events (`data:` and named events), cancel-on-disconnect
- fields, messages, constraints: the request fields every generating route shares; sampling: those
  fields -> the engine's `SamplingParams`, and the token rules (bad words, min_tokens EOS, prediction)
- reasoning, tools, tool_formats/, toolcalls, reply: a reply split into reasoning, content and tool calls
- sequence_view: the sequence object
"""
