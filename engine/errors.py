"""Typed engine errors. The HTTP layer maps each class to one status code, so the engine never
needs to know about HTTP and a caller can always tell what went wrong and what to do about it."""


class EngineError(Exception):
    """Base class: something a caller asked for could not be done; nothing was changed."""

    status = 400
    code = "invalid_request"
    param: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidRequest(EngineError):
    """The request itself is malformed (bad token ids, bad lengths...)."""


class SequenceNotFound(EngineError):
    status = 404
    code = "sequence_not_found"


class RequestNotFound(EngineError):
    status = 404
    code = "request_not_found"


class SequenceBusy(EngineError):
    """A persistent sequence is already generating; one generation at a time per sequence."""

    status = 409
    code = "sequence_busy"


class PromptTooLong(EngineError):
    """Prompt plus max_tokens cannot fit in the model's context or in the whole cell pool. HTTP 400 with
    code `context_length_exceeded`, as OpenAI and vLLM answer, so clients' overflow handling fires."""

    status = 400
    code = "context_length_exceeded"


class QueueFull(EngineError):
    """The waiting queue is at its bound; retry later (HTTP 429 with Retry-After)."""

    status = 429
    code = "queue_full"


class EngineUnavailable(EngineError):
    """The engine is loading, stopped or shutting down (HTTP 503)."""

    status = 503
    code = "unavailable"
