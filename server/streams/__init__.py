"""Resumable streams (llama.cpp's `X-Conversation-Id`): a streamed answer outlives its client and is read again
from any offset (server.streams.middleware, .kept, .routes)."""
