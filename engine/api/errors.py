"""Typed engine errors. The engine knows nothing of HTTP: `server.errors` maps each class to one
status code, and a caller can always tell what went wrong (the class, `code`, `param`) and what to do
about it (the message)."""


class EngineError(Exception):
    """Base class: something a caller asked for could not be done; nothing was changed."""

    code = "invalid_request"
    param: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidRequest(EngineError):
    """The request itself is malformed (bad token ids, bad lengths...)."""


class SequenceNotFound(EngineError):
    code = "sequence_not_found"


class RequestNotFound(EngineError):
    code = "request_not_found"


class SequenceBusy(EngineError):
    """A persistent sequence is already generating; one generation at a time per sequence."""

    code = "sequence_busy"


class PromptTooLong(EngineError):
    """Prompt plus max_tokens cannot fit in the model's context or in the whole cell pool (code
    `context_length_exceeded`, as OpenAI's and vLLM's)."""

    code = "context_length_exceeded"


class QueueFull(EngineError):
    """The waiting queue is at its bound; retry later."""

    code = "queue_full"


class EngineUnavailable(EngineError):
    """The engine is loading, stopped, shutting down, or its loop died."""

    code = "unavailable"


class ModelSourceError(ValueError):
    """A model could not be found, fetched or converted; the message says why and what to do."""


class StorageFull(EngineError):
    """The state directory could not take a write (disk full, read-only, quota): the sequence is intact in
    memory and its last saved state on disk is untouched; free space and save again."""

    code = "insufficient_storage"


class IncompatibleState(EngineError):
    """Saved state (an archive, cell files) was written by another model, dtype or KV layout, or is not a
    cellserve archive at all: import it into a server running the model that wrote it."""

    code = "incompatible_state"
