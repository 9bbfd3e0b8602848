"""llama-server's resumable-stream routes over the kept streams `ResumableStreams` fills (server.streams):
`GET /v1/stream?conv_id=ID&from=N` replays the conversation's SSE bytes from offset N and follows them live
until the stream ends; `DELETE /v1/stream?conv_id=ID` is the user's stop (the generation is cancelled; 204,
also when there was nothing to stop); `POST /v1/streams/lookup` `{"conversation_ids": [...]}` says, for the
ids asked about only, whether each stream is done and how many bytes it has."""

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import Field

from server.errors import APIError
from server.generation.sse import SSEResponse
from server.schema import StrictModel
from server.streams.kept import KeptStream, KeptStreams, OffsetLost

router = APIRouter()


class LookupRequest(StrictModel):
    conversation_ids: list[str] = Field(default_factory=list, max_length=1024)


@router.get("/v1/stream", responses={200: {"content": {"text/event-stream": {"schema": {}}}}})
async def replay(request: Request, conv_id: str = Query(""), offset: int = Query(0, ge=0, alias="from")) -> Response:
    streams = kept_streams(request)
    kept = streams.get(_required(conv_id))
    if kept is None:
        raise APIError(404, f"no stream for conversation {conv_id!r}: it never streamed here, was stopped, or "
                       f"ended more than {streams.ttl_s:g} s ago", code="stream_not_found")
    try:
        kept.check_offset(offset)
    except OffsetLost as exc:
        raise APIError(400, str(exc), param="from") from exc
    return SSEResponse(_bytes_from(kept, offset), encode=lambda chunk: chunk)


async def _bytes_from(kept: KeptStream, offset: int):
    try:
        async for chunk in kept.read(offset):
            yield chunk
    except OffsetLost:  # this reader fell behind the buffer's cap: its stream ends here
        return


@router.delete("/v1/stream", status_code=204)
async def stop(request: Request, conv_id: str = Query("")) -> Response:
    kept_streams(request).stop(_required(conv_id))
    return Response(status_code=204)


@router.post("/v1/streams/lookup")
async def lookup(body: LookupRequest, request: Request) -> list[dict]:
    return [s.describe() for s in kept_streams(request).lookup([c for c in body.conversation_ids if c])]


def _required(conv_id: str) -> str:
    if not conv_id:
        raise APIError(400, "give the conversation id as the query parameter conv_id (the X-Conversation-Id "
                       "header the stream was started with)", param="conv_id")
    return conv_id


def kept_streams(request: Request) -> KeptStreams:
    return request.app.state.streams
